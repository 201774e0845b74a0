"""Collection rules for the whole repository (``tests/conftest.py`` holds the fixtures).

``--doctest-modules`` imports every module under ``src/nostall``. The serving modules
import their optional dependencies (``nostall[serve]``) at the top; where those are not
installed, their docstring examples are not collected instead of failing to import.
"""

from __future__ import annotations

import importlib.util

_OPTIONAL = {
    "fastapi": [
        "src/nostall/serve/app.py",
        "src/nostall/serve/embed.py",
        "src/nostall/serve/fleet.py",
    ],
    "prometheus_client": ["src/nostall/serve/metrics.py"],
}

collect_ignore = [
    path
    for module, paths in _OPTIONAL.items()
    if importlib.util.find_spec(module) is None
    for path in paths
]
# The tests' conftest.py files are plugins, loaded as such; collected again as doctest
# modules, the ones outside a package collide on their shared name ``conftest``.
collect_ignore_glob = ["tests/conftest.py", "tests/*/conftest.py"]
