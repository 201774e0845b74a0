"""The tiered model cache: whole diffusers pipelines switched among GPU, pinned host and disk.

>>> import nostall
>>> cache = nostall.ModelCache("/models", device="cuda", gpu_budget=36 << 30)  # doctest: +SKIP
>>> with cache.use("flux-dev") as pipe:  # doctest: +SKIP
...     image = pipe("a cat").images[0]
"""

from nostall.cache.cache import CacheStats, ModelCache
from nostall.cache.report import ComponentSwitch, SwitchReport
from nostall.store.catalog import ComponentEntry, PipelineEntry, Store

__all__ = [
    "CacheStats",
    "ComponentEntry",
    "ComponentSwitch",
    "ModelCache",
    "PipelineEntry",
    "Store",
    "SwitchReport",
]
