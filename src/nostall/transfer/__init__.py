"""Host → device: the copy stream and the read/copy pipeline."""

from nostall.transfer.copy import CopyEngine
from nostall.transfer.loader import Loader, LoadResult, LoadStats, resolve_device

__all__ = ["CopyEngine", "LoadResult", "LoadStats", "Loader", "resolve_device"]
