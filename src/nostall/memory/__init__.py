"""Host memory: page-aligned arenas, the two-level pinned pool, the host-wide shared pool,
the staging ring."""

from nostall.memory.host import PAGE, HostArena, round_up
from nostall.memory.pool import Block, PinnedPool, PoolStats, size_class
from nostall.memory.ring import StagingRing
from nostall.memory.shared import SharedPool

__all__ = [
    "PAGE",
    "Block",
    "HostArena",
    "PinnedPool",
    "PoolStats",
    "SharedPool",
    "StagingRing",
    "round_up",
    "size_class",
]
