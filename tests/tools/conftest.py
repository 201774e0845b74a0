"""The publishing tools (``tools/benchdocs``) are a package beside the library, not
installed with it: their tests import it from the checkout."""

from __future__ import annotations

import sys
from pathlib import Path

_TOOLS = str(Path(__file__).resolve().parents[2] / "tools")
if _TOOLS not in sys.path:
    sys.path.insert(0, _TOOLS)
