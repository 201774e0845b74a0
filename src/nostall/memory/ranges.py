"""Free-range bookkeeping for one contiguous buffer: best fit, coalescing, placement.

Used by the pinned pool (host bytes) and by the model cache's device tier (one device
allocation carved into component slots): neither ever asks the allocator underneath
for memory once it has its buffer, so a switch never pays for ``cudaMalloc`` or for
pinning.
"""

from __future__ import annotations

__all__ = ["Ranges"]


class Ranges:
    """The free ranges ``(offset, size)`` of a buffer of ``capacity`` bytes, in address
    order, adjacent ranges merged. Not thread-safe: its owner locks.

    >>> r = Ranges(100)
    >>> a, b = r.carve(30), r.carve(30)
    >>> r.give_back(a, 30); r.largest
    40
    >>> r.give_back(b, 30); r.largest
    100
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []

    @property
    def free(self) -> int:
        return sum(s for _, s in self._free)

    @property
    def largest(self) -> int:
        return max((s for _, s in self._free), default=0)

    def runs(self) -> list[tuple[int, int]]:
        return list(self._free)

    def carve(self, size: int, *, prefer: int | None = None, high: bool = False) -> int | None:
        """Take ``size`` bytes; return their offset, or ``None`` when no run fits.

        ``prefer``: take exactly that offset if it is free (a component going back to
        where it was keeps every view into it valid); otherwise best fit, ties to the
        lowest address, from the run's start (``high``: its end, for what leaves soon:
        the room it leaves then joins the free space above it).
        """
        if prefer is not None and self.take(prefer, size):
            return prefer
        best = None
        for i, (_, run) in enumerate(self._free):
            if run >= size and (best is None or run < self._free[best][1]):
                best = i
        if best is None:
            return None
        off, run = self._free[best]
        if run == size:
            del self._free[best]
        elif high:
            self._free[best] = (off, run - size)
            return off + run - size
        else:
            self._free[best] = (off + size, run - size)
        return off

    def take(self, offset: int, size: int) -> bool:
        """Take exactly ``[offset, offset + size)`` if it is entirely free."""
        for i, (off, run) in enumerate(self._free):
            if off <= offset and offset + size <= off + run:
                pieces = []
                if offset > off:
                    pieces.append((off, offset - off))
                if offset + size < off + run:
                    pieces.append((offset + size, off + run - offset - size))
                self._free[i : i + 1] = pieces
                return True
        return False

    def give_back(self, offset: int, size: int) -> None:
        """Return ``[offset, offset + size)``; it merges with free neighbours."""
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        free.insert(i, (offset, size))
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i] = (free[i][0], free[i][1] + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    def clear(self) -> None:
        self._free = []
