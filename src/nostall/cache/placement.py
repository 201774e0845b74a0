"""Placement policy: where a component goes, and who leaves to make room. Pure.

Both tiers are one buffer carved into contiguous ranges: the device tier's slots
(:mod:`~nostall.cache.device`) and the host tier's pool blocks
(:mod:`~nostall.cache.host`). This module decides over offsets and byte counts only —
no torch, no memory, no locks, no clock — so every rule is tested with plain numbers
(``tests/cache/test_placement.py``); the tiers apply its answers.

The rules:

* **Certain or nothing.** A resident leaves only when its leaving makes the placement
  certain. Free bytes are not room: the component needs one free *run*, and evicting
  residents whose ranges are scattered can free enough bytes and still no run long
  enough. Each answer here is computed over the ranges themselves, so a placement that
  could fail under fragmentation evicts nobody.
* **Device tier** (:func:`make_room`): least recently used first, by switch number;
  within the oldest switch, the smallest component that frees enough on its own, else
  the largest (fewest components to bring back later). After placing, evict further
  down to the watermark, so the next switch or a prefetch finds room without evicting.
* **Host tier** (:func:`admit`): frequency admission. A newcomer is admitted only if
  its room can be taken from residents requested less often than it was (ties keep
  the residents; :class:`Requests` halves the counts every ``age_every`` requests so
  old favourites fade). Plain LRU over a working set larger than the budget evicts
  every model just before it is needed again: each request then pays a disk read and
  gains nothing.

Free runs are found as the pool's and the device tier's own allocator finds them
(:class:`nostall.memory.ranges.Ranges`: best fit, ties to the lowest address), so the
offset predicted for a block is the one the pool will carve.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Admission",
    "Extent",
    "Requests",
    "Room",
    "admit",
    "best_fit",
    "evictable",
    "free_runs",
    "lru_victim",
    "make_room",
]


@dataclass(frozen=True)
class Extent:
    """A resident component: ``key`` occupies ``[offset, offset + size)`` of its tier.

    ``last_used``: the device tier's switch number, or the host tier's request number,
    of its last use. ``count``: its (aged) request count (host tier).
    """

    key: str
    offset: int
    size: int
    last_used: int = 0
    count: int = 0

    def overlaps(self, offset: int, size: int) -> bool:
        return self.offset < offset + size and offset < self.offset + self.size


def free_runs(capacity: int, taken: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The free ``(offset, size)`` runs of a buffer of ``capacity`` bytes whose ranges
    ``taken`` (``(offset, size)``, disjoint) are in use, in address order.

    >>> free_runs(100, [(10, 20), (50, 10)])
    [(0, 10), (30, 20), (60, 40)]
    """
    runs, at = [], 0
    for off, size in sorted(taken):
        if off > at:
            runs.append((at, off - at))
        at = max(at, off + size)
    if at < capacity:
        runs.append((at, capacity - at))
    return runs


def best_fit(runs: Sequence[tuple[int, int]], size: int) -> int | None:
    """The offset the tiers' allocator carves ``size`` bytes at: the smallest run that
    fits, ties to the lowest address; ``None`` when none fits.

    >>> best_fit([(0, 10), (30, 20), (60, 40)], 15)
    30
    """
    best = None
    for off, run in runs:
        if run >= size and (best is None or run < best[1]):
            best = (off, run)
    return None if best is None else best[0]


def evictable(
    key: str,
    uses: int,
    *,
    keep: Iterable[str],
    protected: Iterable[str],
    current: Iterable[str],
    prefetch: bool,
) -> bool:
    """Whether a device-tier resident may leave: not in use, not needed by the switch
    being planned (``keep``), not prefetched and waiting for its switch
    (``protected``), and, for a prefetch, not the last pipeline handed out without
    ``use()`` (``current``)."""
    return (
        uses == 0 and key not in keep and key not in protected and not (prefetch and key in current)
    )


def lru_victim(idle: Iterable[Extent], need: int) -> Extent | None:
    """The device tier's next victim among ``idle`` when ``need`` bytes are wanted:
    least recently used first; within the oldest switch, the smallest that frees
    ``need`` on its own, else the largest."""
    idle = list(idle)
    if not idle:
        return None
    oldest = min(e.last_used for e in idle)
    group = [e for e in idle if e.last_used == oldest]
    enough = [e for e in group if e.size >= need]
    return min(enough, key=lambda e: e.size) if enough else max(group, key=lambda e: e.size)


@dataclass(frozen=True)
class Room:
    """What :func:`make_room` decided: evict ``fit`` (in order), place the newcomer,
    then evict ``trim`` to get down to the watermark."""

    fit: tuple[str, ...]
    trim: tuple[str, ...]


def make_room(
    capacity: int,
    residents: Sequence[Extent],
    idle: Iterable[str],
    size: int,
    *,
    watermark: int,
) -> Room | None:
    """Device tier: which of the ``idle`` residents leave so that ``size`` bytes find
    one free run, and which leave after it to bring the tier down to ``watermark``
    bytes used. ``None`` when even every idle resident leaving leaves no run long
    enough: then nobody is evicted.

    >>> a, b = Extent("a", 60, 40, last_used=1), Extent("b", 0, 40, last_used=2)
    >>> make_room(100, [a, b], {"a", "b"}, 50, watermark=100)  # a is older, and enough
    Room(fit=('a',), trim=())
    """
    idle = set(idle)
    candidates = [e for e in residents if e.key in idle]
    gone: list[Extent] = []
    while True:
        left = [e for e in residents if e not in gone]
        if best_fit(free_runs(capacity, [(e.offset, e.size) for e in left]), size) is not None:
            break
        victim = lru_victim([e for e in candidates if e not in gone], size)
        if victim is None:
            return None
        gone.append(victim)
    used = sum(e.size for e in residents if e not in gone) + size
    trim: list[Extent] = []
    while used > watermark:
        victim = lru_victim([e for e in candidates if e not in gone and e not in trim], 0)
        if victim is None:
            break
        trim.append(victim)
        used -= victim.size
    return Room(tuple(e.key for e in gone), tuple(e.key for e in trim))


class Requests:
    """How often each key was requested, halved every ``age_every`` requests; and the
    number of each key's last request.

    >>> r = Requests(age_every=4)
    >>> [r.request("a") for _ in range(3)]
    [0, 1, 2]
    >>> r.request("b"), r.count("a")  # the 4th request ages every count
    (0, 1)
    """

    def __init__(self, age_every: int = 64):
        self.age_every = age_every
        self._counts: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._n = 0

    def request(self, key: str) -> int:
        """Count a request for ``key``; return its count *before* this request."""
        before = self._counts.get(key, 0)
        self._counts[key] = before + 1
        self._n += 1
        self._last[key] = self._n
        if self._n % self.age_every == 0:
            self._counts = {k: c // 2 for k, c in self._counts.items() if c // 2}
        return before

    def count(self, key: str) -> int:
        return self._counts.get(key, 0)

    def last(self, key: str) -> int:
        return self._last.get(key, 0)


@dataclass(frozen=True)
class Admission:
    """The host tier admits a newcomer: evict ``victims``; the pool then carves its
    block at ``offset``."""

    offset: int
    victims: tuple[str, ...]


def admit(
    size: int,
    capacity: int,
    residents: Sequence[Extent],
    *,
    prior: int,
    keep: Iterable[str] = (),
    reserved: Sequence[tuple[int, int]] = (),
) -> Admission | None:
    """Host tier: whether a newcomer of ``size`` bytes (its block, rounded), requested
    ``prior`` times before, is admitted; ``None`` when not, and then nobody leaves.

    ``residents``: the blocks held now, each with its request ``count`` and
    ``last_used``; ``keep``: residents that must stay (the switch being planned uses
    them); ``reserved``: ``(offset, size)`` ranges already promised to newcomers of the
    same switch, not allocated yet.

    Residents leave least valuable first (fewest requests, then least recently
    requested), only those requested less often than the newcomer (or not since their
    count aged away), and only as many as make one run long enough; of those, only the
    ones whose ranges the newcomer's run needs.

    >>> low = Extent("low", 0, 30, count=1)
    >>> busy = Extent("busy", 60, 30, count=9)
    >>> admit(50, 100, [low, busy], prior=3)  # evicting low frees a run of 60
    Admission(offset=0, victims=('low',))
    >>> admit(70, 100, [low, busy], prior=3) is None  # low alone cannot make 70
    True
    """
    if size > capacity:
        return None
    keep = set(keep)
    taken = [(e.offset, e.size) for e in residents] + list(reserved)
    offset = best_fit(free_runs(capacity, taken), size)
    if offset is not None:
        return Admission(offset, ())
    order = sorted(
        (e for e in residents if e.key not in keep), key=lambda e: (e.count, e.last_used)
    )
    gone: list[Extent] = []
    for e in order:
        # Ties keep the resident; a count that aged to zero no longer defends it.
        if not (e.count < prior or e.count == 0):
            break
        gone.append(e)
        left = [(x.offset, x.size) for x in residents if x not in gone] + list(reserved)
        offset = best_fit(free_runs(capacity, left), size)
        if offset is None:
            continue
        needed = [x for x in gone if x.overlaps(offset, size)]
        # With only those gone, the allocator's best fit may pick another run, as
        # long as it fits; predict that one, where a later newcomer is reserved around.
        left = [(x.offset, x.size) for x in residents if x not in needed] + list(reserved)
        offset = best_fit(free_runs(capacity, left), size)
        if offset is None:  # the run found above is free now; RuntimeError: no imports here
            raise RuntimeError(f"placement lost the free run for {size} bytes")
        return Admission(offset, tuple(x.key for x in needed))
    return None
