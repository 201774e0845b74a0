"""Host memory: page-aligned arenas, the two-level pinned pool, the staging ring."""

from nostall.memory.host import PAGE, HostArena, round_up
from nostall.memory.pool import Block, PinnedPool, PoolStats, size_class
from nostall.memory.ring import StagingRing

__all__ = [
    "PAGE",
    "Block",
    "HostArena",
    "PinnedPool",
    "PoolStats",
    "StagingRing",
    "round_up",
    "size_class",
]
