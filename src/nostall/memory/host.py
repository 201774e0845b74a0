"""Page-aligned host memory, optionally page-locked for the GPU in segments.

Why anonymous ``mmap`` + ``cudaHostRegister`` instead of ``torch.empty(...,
pin_memory=True)``: on our H200 host ``cudaHostAlloc`` pins at 1.4–1.7 GB/s
(a FLUX-size buffer costs 14–17 s), while touching an anonymous mapping with
many threads and registering it runs at 10–20 GiB/s. The mapping is also
page-aligned, which ``O_DIRECT`` reads need.

Registration happens in segments: some hosts refuse one huge registration, and
a single copy may not span two registrations (CUDA answers "invalid argument"),
so every copy must stay inside one segment — :meth:`HostArena.split` cuts
ranges at segment boundaries.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
from collections.abc import Iterator

import torch

from nostall.errors import ClosedError, DeviceError

__all__ = [
    "PAGE",
    "HostArena",
    "cuda_available",
    "hugepage_bytes",
    "memory_available",
    "round_up",
]

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
# cudaHostRegisterPortable: the pages count as pinned in every CUDA context.
_REGISTER_PORTABLE = 1
# Linux >= 6.1: synchronously collapse a range into transparent huge pages.
_MADV_COLLAPSE = 25


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def cuda_available() -> bool:
    """True when this torch has CUDA and a GPU is visible (does not create a context)."""
    return torch.cuda.is_available()


class HostArena:
    """An anonymous, page-aligned mapping of ``nbytes``, pinned segment by segment.

    The arena owns the mapping. ``tensor`` is a ``uint8`` CPU tensor over all of
    it; views of it stay valid after :meth:`close` (close unregisters the pages;
    the mapping itself is freed when the last view is gone, by Python's buffer
    protocol, so a stale view can never point at unmapped memory).

    Pinning is explicit and incremental: :meth:`pin_segment` touches a segment's
    pages and registers them with CUDA. Without CUDA, pinning only touches.

    >>> arena = HostArena(64 << 20, segment_bytes=32 << 20)
    >>> for i in range(arena.num_segments):
    ...     arena.pin_segment(i, register=False)
    >>> arena.tensor.numel()
    67108864
    """

    def __init__(self, nbytes: int, *, segment_bytes: int = 1 << 30, hugepages: bool = True):
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes}")
        if segment_bytes <= 0 or segment_bytes % PAGE:
            raise ValueError(f"segment_bytes={segment_bytes} must be a positive multiple of {PAGE}")
        self.nbytes = round_up(nbytes, PAGE)
        self.segment_bytes = segment_bytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        self._map: mmap.mmap | None = mmap.mmap(-1, self.nbytes, flags=flags)
        if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            # Fewer page faults on first touch and fewer pages to lock; harmless where
            # transparent huge pages are off.
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        # Arenas outlive the caller's context: never an inference tensor, or the pinning
        # thread (outside inference mode) could not write to it.
        with torch.inference_mode(False):
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        self._registered: list[bool] = [False] * self.num_segments
        self._touched: list[bool] = [False] * self.num_segments

    @property
    def num_segments(self) -> int:
        return -(-self.nbytes // self.segment_bytes)

    def segment_range(self, i: int) -> tuple[int, int]:
        start = i * self.segment_bytes
        return start, min(start + self.segment_bytes, self.nbytes)

    def is_registered(self, i: int) -> bool:
        return self._registered[i]

    @property
    def pinned_bytes(self) -> int:
        return sum(
            self.segment_range(i)[1] - self.segment_range(i)[0]
            for i, r in enumerate(self._registered)
            if r
        )

    def view(self, start: int, end: int) -> memoryview:
        """A fresh memoryview of bytes ``[start, end)``; it keeps the mapping alive."""
        if self._map is None:
            raise ClosedError("host arena is closed")
        return memoryview(self._map)[start:end]

    def split(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """Cut ``[start, end)`` at segment boundaries (one CUDA copy per piece)."""
        while start < end:
            stop = min(end, (start // self.segment_bytes + 1) * self.segment_bytes)
            yield start, stop
            start = stop

    def pin_segment(self, i: int, *, register: bool) -> bool:
        """Touch segment ``i`` and, if ``register``, page-lock it for CUDA.

        Returns whether the segment ended up registered. A refused registration is
        logged and leaves the segment pageable: copies from it stay correct, only slower.
        """
        if self._map is None:
            raise ClosedError("host arena is closed")
        start, end = self.segment_range(i)
        if not self._touched[i]:
            self._touch(start, end)
            self._touched[i] = True

        if register and not self._registered[i]:
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(self.address + start, end - start, _REGISTER_PORTABLE)
            if int(rc) != 0:
                log.warning(
                    "cudaHostRegister refused %d bytes at segment %d (error %s); "
                    "this segment stays pageable and copies from it run at pageable speed",
                    end - start,
                    i,
                    rc,
                )
                return False
            self._registered[i] = True
        return self._registered[i]

    def _touch(self, start: int, end: int) -> None:
        # torch's zero_ is parallel across intra-op threads: the first touch of a
        # fresh mapping runs at memory speed instead of one page fault at a time.
        with torch.inference_mode(False):
            self.tensor[start:end].zero_()
        # Where the first touch fell back to 4 KiB pages (fragmented memory), ask the
        # kernel to collapse the range into huge pages: pinned 4 KiB pages both pin
        # slower and feed the GPU's copy engine slower.
        _madvise(self.address + start, end - start, _MADV_COLLAPSE)

    def close(self) -> None:
        """Unregister every pinned segment. Idempotent.

        The caller must ensure no copy still reads these pages (synchronise the
        events of the copies first); views remain valid as pageable memory.
        """
        if self._map is None:
            return
        if any(self._registered):
            try:
                cudart = torch.cuda.cudart()
            except Exception as e:  # CUDA torn down at interpreter exit
                raise DeviceError(f"cannot unregister pinned memory: {e}") from e
            for i, r in enumerate(self._registered):
                if r:
                    cudart.cudaHostUnregister(self.address + self.segment_range(i)[0])
                    self._registered[i] = False
        # Drop our references; the mapping is unmapped once no tensor view uses it.
        self.tensor = None  # type: ignore[assignment]
        self._map = None


def _madvise(address: int, length: int, advice: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0
    except (OSError, AttributeError):
        return False


def hugepage_bytes(address: int, length: int) -> int | None:
    """Bytes of ``[address, address + length)`` backed by transparent huge pages.

    Read from ``/proc/self/smaps`` (``AnonHugePages``); ``None`` where unavailable.
    """
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < address + length and hi > address
                elif inside and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total


def memory_available() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or ``None`` where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
