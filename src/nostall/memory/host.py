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
import errno
import logging
import mmap
import os
from collections.abc import Iterator

import torch

from nostall.errors import ArgumentError, ClosedError, DeviceError

__all__ = [
    "PAGE",
    "HostArena",
    "cuda_available",
    "hugepage_bytes",
    "memory_available",
    "memory_limit",
    "release_pages",
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

    With ``fd``, the mapping is instead the first ``nbytes`` of that file, ``MAP_SHARED``
    (a ``/dev/shm`` segment that several processes map: each sees the others' writes).
    The arena keeps its own duplicate of ``fd`` (closed by :meth:`close`); the file must
    already be at least ``nbytes`` long. Such an arena never writes bytes it did not
    receive: touching a segment commits the file's pages (``fallocate``) instead of
    zeroing them, because another process may have filled them.

    The arena owns the mapping. ``tensor`` is a ``uint8`` CPU tensor over all of
    it; views of it stay valid after :meth:`close` (close unregisters the pages;
    the mapping itself is freed when the last view is gone, by Python's buffer
    protocol, so a stale view can never point at unmapped memory).

    Construction reserves address space only (``MAP_NORESERVE``): no page is resident
    until something touches it. Pinning is explicit and incremental: :meth:`pin_segment`
    touches a segment's pages and registers them with CUDA; ``register=False`` only
    touches (callers that never register need not call it: writes fault pages in).

    ``device`` is the GPU whose CUDA context registers (and later unregisters) the
    pages. The registration is *portable*, so copies to every GPU of the process run
    at full speed from it; the device only decides which context the runtime creates
    if none exists yet — a process working on ``cuda:1`` must not grow a context on
    GPU 0 just because it pinned memory (default: the calling thread's current GPU).

    >>> arena = HostArena(64 << 20, segment_bytes=32 << 20)
    >>> [arena.pin_segment(i, register=False) for i in range(arena.num_segments)]  # touched, not registered
    [False, False]
    >>> arena.tensor.numel()
    67108864
    >>> arena.close()
    """

    def __init__(
        self,
        nbytes: int,
        *,
        segment_bytes: int = 1 << 30,
        hugepages: bool = True,
        device: int | None = None,
        fd: int | None = None,
    ):
        if nbytes <= 0:
            raise ArgumentError(f"arena size must be positive, got {nbytes}")
        if segment_bytes <= 0 or segment_bytes % PAGE:
            raise ArgumentError(f"segment_bytes={segment_bytes}: not a positive multiple of {PAGE}")
        self.nbytes = round_up(nbytes, PAGE)
        self.segment_bytes = segment_bytes
        self.device = device
        self._fd: int | None = None
        if fd is None:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
            self._map: mmap.mmap | None = mmap.mmap(-1, self.nbytes, flags=flags)
        else:
            self._fd = os.dup(fd)
            try:
                self._map = mmap.mmap(
                    self._fd,
                    self.nbytes,
                    flags=mmap.MAP_SHARED,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                )
            except BaseException:
                os.close(self._fd)
                raise
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
            with self._on_device():
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

    def commit(self, start: int, end: int) -> None:
        """Give a file-backed arena's bytes ``[start, end)`` their pages now (``fallocate``;
        what they hold is kept), so that writing them later cannot fail. Nothing for an
        anonymous arena, or where the file system cannot allocate ahead.

        Raises ``OSError`` (``ENOSPC``) when the file system is full: without this, the
        first write to a page a full tmpfs cannot back kills the process with ``SIGBUS``.
        """
        if self._fd is None or end <= start:
            return
        if self._map is None:
            raise ClosedError("host arena is closed")
        _fallocate(self._fd, start, end - start)

    def _touch(self, start: int, end: int) -> None:
        if self._fd is not None:
            # Other processes' bytes live in a shared file's pages: allocate, never zero.
            self.commit(start, end)
        else:
            # torch's zero_ is parallel across intra-op threads: the first touch of a
            # fresh mapping runs at memory speed instead of one page fault at a time.
            with torch.inference_mode(False):
                self.tensor[start:end].zero_()
        # Where the first touch fell back to 4 KiB pages (fragmented memory), ask the
        # kernel to collapse the range into huge pages: pinned 4 KiB pages both pin
        # slower and feed the GPU's copy engine slower.
        _madvise(self.address + start, end - start, _MADV_COLLAPSE)

    def _on_device(self) -> contextlib.AbstractContextManager:
        # torch's guard restores the previous device without creating its context.
        if self.device is None:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def close(self) -> None:
        """Unregister every pinned segment. Idempotent.

        The caller must ensure no copy still reads these pages (synchronise the
        events of the copies first); views remain valid as pageable memory.
        Raises :class:`~nostall.DeviceError` if CUDA refuses to unregister a segment
        (every segment is still tried, and the arena counts as closed).
        """
        if self._map is None:
            return
        failed: list[str] = []
        if any(self._registered):
            try:
                with self._on_device():
                    cudart = torch.cuda.cudart()
                    for i, r in enumerate(self._registered):
                        if r:
                            rc = cudart.cudaHostUnregister(self.address + self.segment_range(i)[0])
                            self._registered[i] = False
                            if int(rc) != 0:
                                failed.append(f"segment {i} (error {rc})")
            except Exception as e:  # CUDA torn down at interpreter exit
                raise DeviceError(f"cannot unregister pinned memory: {e}") from e
        # Drop our references; the mapping is unmapped once no tensor view uses it.
        self.tensor = None  # type: ignore[assignment]
        self._map = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        if failed:
            raise DeviceError(
                f"cudaHostUnregister refused {len(failed)} of the arena's segments: "
                f"{', '.join(failed)}; the pages stay locked until the process exits"
            )


_MADV_DONTNEED = 4


def release_pages(tensor: torch.Tensor, start: int, end: int) -> int:
    """Give the whole pages inside bytes ``[start, end)`` of a private anonymous
    mapping back to the OS (they read as zeros afterwards); returns bytes released.

    For a buffer that only partly stays in use: a CPU load that cast some tensors
    into new memory releases the bytes they came from.
    """
    lo = round_up(tensor.data_ptr() + start, PAGE)
    hi = (tensor.data_ptr() + end) // PAGE * PAGE
    if hi <= lo:
        return 0
    return hi - lo if _madvise(lo, hi - lo, _MADV_DONTNEED) else 0


def _fallocate(fd: int, offset: int, length: int) -> None:
    # fallocate(2) mode 0, not os.posix_fallocate: where the file system lacks fallocate,
    # glibc's emulation writes a zero into every block that reads zero, racing with
    # another process filling that block.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return  # no libc call to make: the writes allocate the pages
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if call(fd, 0, offset, length) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return  # pages are then allocated by the writes themselves
    raise OSError(err, f"fallocate of {length} bytes at offset {offset}: {os.strerror(err)}")


def _madvise(address: int, length: int, advice: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0
    except (OSError, AttributeError):
        return False


def hugepage_bytes(address: int, length: int, field: str = "AnonHugePages") -> int | None:
    """Bytes of ``[address, address + length)`` backed by transparent huge pages.

    Read from ``/proc/self/smaps``: ``field`` is ``AnonHugePages`` for anonymous memory,
    ``ShmemPmdMapped`` for a shared memory file; ``None`` where unavailable.
    """
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < address + length and hi > address
                elif inside and line.startswith(field + ":"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_available() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or ``None`` where unknown."""
    return _meminfo("MemAvailable")


# A cgroup limit this large means "no limit" (cgroup v1 writes 2**63 rounded to a page).
_UNLIMITED = 1 << 62


def _cgroup_limit(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> int | None:
    """The smallest memory limit over this process's cgroup and its ancestors (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``), or ``None`` when there is none."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates: list[str] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        comps = [c for c in path.split("/") if c]
        # The cgroup's own folder and its ancestors; inside a container the mount is
        # often the cgroup itself, so the path's tails are tried too.
        for k in range(len(comps) + 1):
            candidates.append(os.path.join(base, *comps[:k], name))
            candidates.append(os.path.join(base, *comps[k:], name))
    limits = []
    for file in dict.fromkeys(candidates):
        try:
            with open(file) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _UNLIMITED:
            limits.append(int(text))
    return min(limits) if limits else None


def _online_memory(root: str = "/sys/devices/system/memory") -> int | None:
    # Memory the kernel has online, counted in hot-plug blocks: on a VM whose balloon
    # holds memory back, MemTotal reads low (31 GiB of 256 seen at start) while the
    # blocks are all there.
    try:
        with open(os.path.join(root, "block_size_bytes")) as f:
            block = int(f.read().strip(), 16)
        online = 0
        for name in os.listdir(root):
            if name.startswith("memory") and name[6:].isdigit():
                with open(os.path.join(root, name, "state")) as f:
                    online += f.read().strip() == "online"
    except (OSError, ValueError):
        return None
    return online * block or None


def memory_limit() -> tuple[int | None, str]:
    """The most memory this process can use, and where that figure comes from.

    A container's cgroup limit first (``/proc/meminfo`` does not show it), then the
    machine's memory: the larger of ``MemTotal`` and the online hot-plug blocks.
    ``(None, "unknown")`` where neither can be read.

    >>> limit, source = memory_limit()
    >>> source in ("cgroup", "machine", "unknown")
    True
    """
    cgroup = _cgroup_limit()
    machine = max(
        (x for x in (_meminfo("MemTotal"), _online_memory()) if x is not None), default=None
    )
    if cgroup is not None and (machine is None or cgroup < machine):
        return cgroup, "cgroup"
    return machine, "machine" if machine is not None else "unknown"
