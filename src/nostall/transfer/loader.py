"""The load pipeline: storage → host (pool block, staging ring or own memory) → target.

Three routes, one shape (a :class:`~nostall.transfer.plan.LoadPlan` says where every
byte goes; a :class:`~nostall.transfer.copy.Transfer` copies it there):

* **pool**: bytes land in a pinned pool block and stay there, cached under the
  files' identity; a later load of the same files is a *memory-cache hit*: one
  host→device copy per slab, nothing read. The cached bytes are never handed out:
  GPU loads copy them to the device, CPU loads into memory of their own (a memcpy,
  the price of a cache that no caller can change).
* **ring**: a GPU load without a pool streams through the loader's small pinned
  staging ring (pinned once, when the loader first loads to a GPU).
* **host**: a CPU load without a pool reads into fresh page-aligned memory that
  the returned tensors own.

Reader threads fill chunks (``chunk_bytes``, read in ``block_bytes`` system calls);
the calling thread issues each chunk's copies as soon as the chunk lands, so
reading and copying overlap. Tensors are views into one flat target allocation per
checkpoint.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nostall.errors import ArgumentError, ClosedError, DeviceError, FileChanged, ReadError
from nostall.memory.host import PAGE, HostArena, release_pages, round_up
from nostall.memory.pool import Block, PinnedPool
from nostall.memory.ring import StagingRing
from nostall.store import Checkpoint, FileIndex, resolve
from nostall.store.backends import open_backend
from nostall.store.base import DEFAULT_BLOCK_BYTES, REMOTE_RANGE_BYTES, REMOTE_SUFFIX, ReadBackend
from nostall.store.digest import DataHasher, FileIdentity
from nostall.store.reader import ParallelReader, ReadRequest
from nostall.transfer.copy import CopyEngine, HostCopy, Transfer
from nostall.transfer.plan import HOST_ALIGN, LoadPlan

__all__ = ["LoadResult", "LoadStats", "Loader", "PendingLoad", "resolve_device"]

BUFFERED_BLOCK_BYTES = 8 << 20
_READ_MODES = ("auto", "buffered", "direct")


@dataclass(frozen=True)
class LoadStats:
    """What one load did and how long each phase took.

    Attributes:
        scenario: ``"read"`` (bytes came from storage) or ``"memory-cache hit"``.
        path: ``"pool"``, ``"ring"`` (pinned staging, no pool) or ``"host"`` (CPU, no pool).
        read_mode: the read strategy used (``"buffered"``, ``"direct"``), ``"-"`` for a hit.
        nbytes: tensor bytes loaded.
        read_s: first read issued → last byte landed in host memory.
        h2d_s: first copy started → last copy finished, on the copy stream (for a CPU
            load through a pool: the copy into the caller's own memory). Casts of
            tensors that change dtype run on the copy stream, inside this time.
        cast_s: the dtype cast after the read, for CPU loads without a pool.
        total_s: the whole call, headers included (and module assembly, for models).
        build_s: module construction on ``meta`` and tensor adoption (models only).
        degraded: one sentence per file whose explicit ``read_mode="direct"`` the file
            system refused: what was asked, what ran instead, and why (empty: none).
    """

    source: str
    device: str
    scenario: str
    path: str
    read_mode: str
    nbytes: int
    num_tensors: int
    read_s: float
    h2d_s: float
    cast_s: float
    total_s: float
    build_s: float = 0.0
    degraded: tuple[str, ...] = ()

    @property
    def gbps(self) -> float:
        return self.nbytes / self.total_s / 1e9 if self.total_s else 0.0


@dataclass
class LoadResult:
    """The loaded tensors, the checkpoint's ``__metadata__``, the phase timings, and the
    files' data digests when the load was asked to hash (``digest=True``) and read."""

    tensors: dict[str, torch.Tensor]
    stats: LoadStats
    metadata: dict[str, str] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    digests: list[str] | None = None


def resolve_device(device: str | torch.device) -> torch.device:
    """A concrete device (``cuda`` → ``cuda:<current>``); :class:`DeviceError` if unusable."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"{device!r} is not a device; use 'cpu' or 'cuda[:N]'") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"device {dev} is not supported; nostall loads to 'cpu' or 'cuda[:N]'")
    if dev.index is not None and dev.index < 0:
        raise DeviceError(f"device {device!r} has a negative index; use 'cuda[:N]' with N >= 0")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {dev} requested but this torch build or machine has no usable CUDA GPU; "
            "load with device='cpu' instead"
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise DeviceError(
            f"device cuda:{index} does not exist; {torch.cuda.device_count()} GPU(s) visible"
        )
    return torch.device("cuda", index)


class Loader:
    """Owns the reader threads, the copy streams and the staging ring of a worker.

    Loads are serialised (one at a time per loader); create one loader per worker
    and :meth:`close` it, or use it as a context manager. ``nostall.load_state_dict``
    uses a process-wide default loader created on first use.

    Args:
        threads: reader threads (default: usable CPUs, at most 16).
        block_bytes: bytes per read system call; default 2 MiB for ``O_DIRECT`` (MuseAI's
            figure) and 8 MiB for buffered reads (page cache → pinned pool on our H200:
            35.0 GB/s with 8 MiB against 28.6 GB/s with 2 MiB, 16 threads).
        chunk_bytes: bytes per copy to the device; reads complete per chunk (64 MiB:
            large copies run at link speed, and 16 threads keep 1 GiB in flight).
        read_mode: ``"auto"``/``"buffered"`` (page cache) or ``"direct"`` (``O_DIRECT``).
            A file whose file system refuses ``"direct"`` is read buffered, and the
            load's ``stats.degraded`` says so.
        strict: refuse to degrade instead: a refused ``"direct"`` raises
            :class:`~nostall.DegradedError` (nothing is loaded).
        ring_slots, ring_slot_bytes: the pinned staging ring for loads without a pool.
        connections: reader threads for checkpoints in object storage (one connection
            each, ranged GETs of 16 MiB); made on the first remote load.

    >>> with Loader(threads=2) as loader:  # doctest: +SKIP
    ...     result = loader.load("model.safetensors", device="cuda")
    ...     print(result.stats.gbps)
    """

    def __init__(
        self,
        *,
        threads: int | None = None,
        block_bytes: int | None = None,
        chunk_bytes: int = 64 << 20,
        read_mode: str = "auto",
        ring_slots: int | None = None,
        ring_slot_bytes: int = 32 << 20,
        strict: bool = False,
        connections: int = 32,
    ):
        if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
            raise ArgumentError(f"connections={connections!r} must be a positive integer")
        for name, value in (("chunk_bytes", chunk_bytes), ("ring_slot_bytes", ring_slot_bytes)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value <= 0
                or value % HOST_ALIGN
            ):
                raise ArgumentError(f"{name}={value!r} must be a positive multiple of {HOST_ALIGN}")
        if read_mode not in _READ_MODES:
            raise ArgumentError(
                f"read_mode={read_mode!r}; choose one of {', '.join(map(repr, _READ_MODES))}"
            )
        if block_bytes is None:
            block_bytes = DEFAULT_BLOCK_BYTES if read_mode == "direct" else BUFFERED_BLOCK_BYTES
        if block_bytes <= 0 or block_bytes % HOST_ALIGN:
            raise ArgumentError(f"block_bytes={block_bytes!r} must be a positive multiple of 4096")
        self.block_bytes = block_bytes
        self.chunk_bytes = chunk_bytes
        self.read_mode = read_mode
        self.strict = strict
        self._owned = _Owned(ParallelReader(threads=threads))
        self.connections = connections
        # Enough slots that every reader has one while the copies of others drain.
        self.ring_slots = ring_slots if ring_slots is not None else self._owned.reader.threads + 4
        self.ring_slot_bytes = ring_slot_bytes
        self._engines: dict[int, CopyEngine] = {}
        self._lock = threading.Lock()
        # A loader nobody closed still joins its readers and unpins its ring when collected.
        self._finalizer = weakref.finalize(self, self._owned.close)

    @property
    def threads(self) -> int:
        return self._owned.reader.threads if self._owned.reader else 0

    def load(
        self,
        source: str | os.PathLike | Checkpoint,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
        pool: PinnedPool | None = None,
    ) -> LoadResult:
        """Load every tensor of ``source`` onto ``device``; see :func:`nostall.load_state_dict`.

        ``dtype`` may also map tensor names to dtypes (names not in it keep theirs):
        ``load_model`` uses that to keep ``_keep_in_fp32_modules`` in float32. Only
        tensors whose dtype changes are cast; the others are loaded as they are.
        """
        return self.start(source, device=device, dtype=dtype, pool=pool).wait()

    def start(
        self,
        source: str | os.PathLike | Checkpoint,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
        pool: PinnedPool | None = None,
        key: Hashable | None = None,
        into: torch.Tensor | None = None,
        after: list[Any] | None = None,
        views: bool = True,
        digest: bool = False,
        names: frozenset[str] | None = None,
    ) -> PendingLoad:
        """Like :meth:`load`, but return once every copy is issued; ``wait()`` ends it.

        A memory-cache hit returns as soon as its copies are queued on the copy stream,
        so a caller can issue several components back to back, or build modules while
        the link is busy. Loads that read return after the last byte has landed.

        ``key`` caches the bytes in ``pool`` under that key instead of the files'
        identity (the model cache keys components by content). ``into`` is a flat
        ``uint8`` buffer on ``device`` of at least the plan's ``target_bytes`` that the
        tensors will view (the model cache's device slots); its owner orders the copies
        with ``after`` (events the copy stream waits for), instead of the default wait
        for the current stream. With ``into``, ``views=False`` returns no tensors: the
        caller's modules already view ``into`` (a prefetch back to the same slot), and
        building thousands of views would only hold the GIL beside a running inference.

        ``digest``: hash every data byte as it is read (reader threads, xxh3-128 leaves,
        :mod:`nostall.store.digest`); :attr:`PendingLoad.digests` then holds one
        digest per file. A memory-cache hit reads nothing and has none.

        ``names``: only these tensors are copied to the target and returned (the rest of
        a component streamed in part); the pool still caches the whole files.

        Every read compares each file's identity (``fstat``) with the one its header was
        read under, before and after the reads: a file rewritten or replaced meanwhile
        is a :class:`~nostall.FileChanged`, never a mix of two versions.
        """
        t0 = time.perf_counter()
        dev = resolve_device(device)
        if pool is not None and pool.closed:
            raise ClosedError("the pinned pool passed to load() is closed")
        ckpt = source if isinstance(source, Checkpoint) else resolve(source)
        plan = LoadPlan(ckpt, dtype, mirror_file=dev.type == "cpu", names=names)
        if into is not None:
            _check_into(into, plan, dev)
        elif not views:
            raise ArgumentError("views=False needs into= (the tensors would be lost)")
        with self._lock:
            if self._owned.reader is None:
                raise ClosedError("the loader is closed; create a new Loader")
            target = (into, after, views) if into is not None else None
            if pool is not None:
                out = self._via_pool(plan, dev, pool, key, target, digest)
            elif dev.type == "cuda":
                out = self._via_ring(plan, dev, target, digest)
            else:
                out = self._into_memory(plan, target, digest)
        return PendingLoad(out, plan, dev, t0)

    # ---- the three routes --------------------------------------------------------

    def _transfer(self, plan: LoadPlan, dev: torch.device, target) -> tuple[Transfer, Any]:
        if target is None:
            return Transfer(plan, self._engine(dev), _target_buffer(plan.target_bytes, dev)), None
        into, after, _ = target
        return Transfer(plan, self._engine(dev), into), None if after is None else list(after)

    def _via_pool(
        self,
        plan: LoadPlan,
        dev: torch.device,
        pool: PinnedPool,
        key: Hashable | None,
        target,
        digest: bool,
    ) -> _Outcome:
        key = _identity(plan.checkpoint) if key is None else key
        block = pool.lookup(key)
        hit = block is not None
        if block is None:
            block = pool.allocate(plan.host_bytes, key=key)
        moves: Transfer | None = None
        ok = False
        try:
            # Inside the try: an out-of-memory here must still give the block back.
            moves, after = self._transfer(plan, dev, target)
            views = target is None or target[2]
            if hit:
                out = self._copy_block(plan, block, moves, after, views)
            else:
                route = _BlockRoute(plan, block, self._chunk(plan))
                out = self._read(plan, route, moves, after, views, digest)
                out.path = "pool"
            ok = True
            return out
        except BaseException:
            if moves is not None:
                moves.abort()  # no copy may still read the block once it is released
            raise
        finally:
            if not ok and not hit:
                block.invalidate()  # half-read bytes must never be served as a cache hit
            # Released with copies possibly in flight: the block's fences keep its memory
            # from reuse until they end.
            block.release()

    def _copy_block(
        self, plan: LoadPlan, block: Block, moves: Transfer, after, views: bool
    ) -> _Outcome:
        moves.begin(after)
        for i, f in enumerate(plan.checkpoint.files):
            base = plan.host_base[i]
            # One copy never spans two registrations (CUDA refuses it).
            for a, b in block.split(base + f.data_start, base + f.data_end):
                block.fence(moves.land(i, a - base, b - base, block.tensor[a:b]))
        tensors = plan.views(moves.flat) if views else {}
        return _Outcome(tensors, "memory-cache hit", "pool", "-", moves=moves)

    def _via_ring(self, plan: LoadPlan, dev: torch.device, target, digest: bool) -> _Outcome:
        ring = self._staging_ring(dev)
        ring.reset()
        moves, after = self._transfer(plan, dev, target)
        try:
            out = self._read(
                plan, _RingRoute(plan, ring), moves, after, target is None or target[2], digest
            )
        except BaseException:
            moves.abort()
            raise
        finally:
            ring.drain()  # the next load refills the ring from slot 0
        out.path = "ring"
        return out

    def _into_memory(self, plan: LoadPlan, target, digest: bool) -> _Outcome:
        if target is not None:
            # A caller-owned CPU target: read through the ring-less route into our own
            # memory first would hold two copies; copy chunk by chunk instead.
            moves, _ = self._transfer(plan, torch.device("cpu"), target)
            arena = HostArena(plan.host_bytes, segment_bytes=round_up(plan.host_bytes, PAGE))
            try:
                route = _ArenaRoute(plan, arena, self._chunk(plan), copies=True)
                out = self._read(plan, route, moves, None, target[2], digest)
            finally:
                arena.close()
            out.path = "host"
            return out
        nbytes = plan.host_bytes
        arena = HostArena(nbytes, segment_bytes=round_up(nbytes, PAGE))
        out = self._read(
            plan, _ArenaRoute(plan, arena, self._chunk(plan)), None, None, True, digest
        )
        host = arena.tensor
        arena.close()  # nothing is registered; the tensors keep the mapping alive
        tensors = plan.source_views(host)
        if plan.casts:
            t = time.perf_counter()
            for s in plan.slots:
                if s.source != s.target:
                    tensors[s.name] = tensors[s.name].to(s.target)
                    # The file's bytes of a cast tensor are dead: give their pages back,
                    # so the load never holds two full copies.
                    base = plan.host_base[s.file]
                    release_pages(host, base + s.begin, base + s.end)
            out.cast_s = time.perf_counter() - t
        out.tensors, out.path = tensors, "host"
        return out

    # ---- the shared read → copy loop ---------------------------------------------

    def _read(
        self,
        plan: LoadPlan,
        route: _Route,
        moves: Transfer | None,
        after: list[Any] | None,
        views: bool,
        digest: bool,
    ) -> _Outcome:
        """Read every range the route asks for; as each lands, copy it (``moves``), and
        with ``digest`` hash it on the reader thread that landed it.

        Returns once every range has landed and its copies are issued; the caller ends
        the copies with ``moves.finish()``."""
        if self._owned.reader is None:  # start() checked it under the same lock
            raise ClosedError("the loader is closed; create a new Loader")
        files: list[ReadBackend] = []
        handle = None
        ckpt = plan.checkpoint
        hashers = [DataHasher(f.data_start, f.data_end) for f in ckpt.files] if digest else None
        try:
            for f in ckpt.files:
                files.append(
                    open_backend(
                        f.path, self.read_mode, block_bytes=self.block_bytes, strict=self.strict
                    )
                )
                _same_file(f, files[-1], "since its header was read")
            requests = []
            for i, f in enumerate(ckpt.files):
                for a, b in route.ranges(i):
                    expected = max(0, min(b, f.data_end) - a)
                    then = None
                    if hashers is not None:
                        then = functools.partial(hashers[i].feed, a)
                    requests.append(
                        ReadRequest(
                            files[i], a, b - a, expected, route.dest(i, a, b), (i, a, b), then
                        )
                    )
            if moves is not None:
                moves.begin(after)
            t0 = time.perf_counter()
            reader = self._owned.reader
            if any(b.name == "s3" for b in files):
                if self._owned.remote is None:
                    self._owned.remote = ParallelReader(threads=self.connections)
                reader = self._owned.remote
            handle = reader.submit(requests)
            # Views need the buffer, not its bytes: build them while the reads run.
            tensors = plan.views(moves.flat) if moves is not None and views else {}
            for i, a, b in handle.completed():
                event = moves.land(i, a, b, route.host(i, a, b)) if moves is not None else None
                route.landed(i, a, b, event)
            read_s = time.perf_counter() - t0
            for f, backend in zip(ckpt.files, files, strict=True):
                _same_file(f, backend, "while it was read")
            mode = files[0].name if files else "-"
            digests = [h.digest() for h in hashers] if hashers is not None else None
            out = _Outcome(tensors, "read", "", mode, read_s, moves=moves, digests=digests)
            out.degraded = tuple(b.degraded for b in files if b.degraded)
            return out
        except BaseException:
            if handle is not None:
                handle.cancel()  # no reader thread may still write into memory we give back
            if moves is not None:
                moves.abort()  # ... nor a copy still read from it
            raise
        finally:
            for r in files:
                r.close()

    def _chunk(self, plan: LoadPlan) -> int:
        """Bytes per read request: ``chunk_bytes``; for a checkpoint in object storage one
        ranged GET (16 MiB), so that every connection has a request of its own even for a
        small checkpoint, and each lands (and is copied) as soon as it arrives."""
        if any(f.path.endswith(REMOTE_SUFFIX) for f in plan.checkpoint.files):
            return min(self.chunk_bytes, REMOTE_RANGE_BYTES)
        return self.chunk_bytes

    # ---- owned resources ---------------------------------------------------------

    def prepare(self, device: str | torch.device) -> None:
        """Create the copy stream and pin the staging ring for ``device`` now, off the
        request path (otherwise the first GPU load does it)."""
        dev = resolve_device(device)
        if dev.type == "cuda":
            with self._lock:
                self._engine(dev)
                self._staging_ring(dev)

    def _engine(self, dev: torch.device) -> CopyEngine | HostCopy:
        if dev.type != "cuda":
            return HostCopy()
        engine = self._engines.get(dev.index)
        if engine is None:
            engine = self._engines[dev.index] = CopyEngine(dev)
        return engine

    def _staging_ring(self, dev: torch.device) -> StagingRing:
        if self._owned.ring is None:
            # Registered through the first GPU's context, portable to the others.
            self._owned.ring = StagingRing(
                slots=self.ring_slots, slot_bytes=self.ring_slot_bytes, pin=True, device=dev.index
            )
        return self._owned.ring

    def close(self) -> None:
        """Join the reader threads and unpin the staging ring. Idempotent."""
        with self._lock:
            self._owned.close()
            self._engines.clear()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Owned:
    """The threads and pinned memory a :class:`Loader` owns, apart from the loader so a
    finalizer can close them without keeping the loader alive."""

    reader: ParallelReader | None
    remote: ParallelReader | None = None
    ring: StagingRing | None = None

    def close(self) -> None:
        for part in (self.reader, self.remote, self.ring):
            if part is not None:
                part.close()
        self.reader = self.remote = self.ring = None


@dataclass
class _Outcome:
    tensors: dict[str, torch.Tensor]
    scenario: str
    path: str
    mode: str
    read_s: float = 0.0
    cast_s: float = 0.0
    moves: Transfer | None = None
    digests: list[str] | None = None
    degraded: tuple[str, ...] = ()


class PendingLoad:
    """A load whose copies may still be running; :meth:`wait` finishes it (once).

    The tensors may be looked at (shapes, dtypes, addresses) before ``wait()``; their
    values are only there after it.
    """

    def __init__(self, out: _Outcome, plan: LoadPlan, dev: torch.device, t0: float):
        self._out, self._plan, self._dev, self._t0 = out, plan, dev, t0
        self._result: LoadResult | None = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self._out.tensors

    @property
    def scenario(self) -> str:
        return self._out.scenario

    @property
    def digests(self) -> list[str] | None:
        """With ``digest=True`` on a load that read: each file's data digest (hex), in
        the checkpoint's file order; known as soon as :meth:`Loader.start` returns."""
        return self._out.digests

    @property
    def done(self) -> Any:
        """After :meth:`wait`: the CUDA event that marks the end of the copies (``None``
        on a CPU or when nothing was copied)."""
        return self._out.moves.done if self._out.moves is not None else None

    def wait(self, *, join: bool = True) -> LoadResult:
        """Wait for the copies. With ``join`` (the default) the current stream is ordered
        after them; without, the caller orders its consumer with :attr:`done`.
        Idempotent."""
        if self._result is None:
            out, ckpt = self._out, self._plan.checkpoint
            h2d_s = out.moves.finish(join=join) if out.moves is not None else 0.0
            stats = LoadStats(
                source=ckpt.source,
                device=str(self._dev),
                scenario=out.scenario,
                path=out.path,
                read_mode=out.mode,
                nbytes=ckpt.nbytes,
                num_tensors=self._plan.num_tensors,
                read_s=out.read_s,
                h2d_s=h2d_s,
                cast_s=out.cast_s,
                total_s=time.perf_counter() - self._t0,
                degraded=out.degraded,
            )
            metadata: dict[str, str] = {}
            for f in ckpt.files:
                metadata.update(f.metadata)
            self._result = LoadResult(out.tensors, stats, metadata, ckpt, out.digests)
        return self._result


class _Route:
    """Where one read pass puts each file range, and what happens once it has landed.

    ``ranges(i)`` are file ``i``'s byte ranges to read (file offsets, from byte 0 so
    host and file offsets share alignment); ``dest`` gives a reader thread the memory
    for one (or ``None`` if the load was cancelled while it waited for it); ``host``
    is that memory as a uint8 tensor; ``landed`` runs on the loading thread after the
    range's copies were issued, with the event of the last one.
    """

    def ranges(self, i: int) -> list[tuple[int, int]]:
        raise NotImplementedError

    def dest(self, i: int, a: int, b: int) -> Callable[[threading.Event], memoryview | None]:
        raise NotImplementedError

    def host(self, i: int, a: int, b: int) -> torch.Tensor:
        raise NotImplementedError

    def landed(self, i: int, a: int, b: int, event: Any) -> None:
        pass


class _BlockRoute(_Route):
    """Into a pool block, in the plan's host layout; each chunk fences the block."""

    def __init__(self, plan: LoadPlan, block: Block, chunk_bytes: int):
        self.plan, self.block, self.chunk_bytes = plan, block, chunk_bytes
        self._view = block.view()

    def ranges(self, i: int) -> list[tuple[int, int]]:
        base = self.plan.host_base[i]
        out = []
        # A chunk never spans two registrations: it is copied in one piece.
        for a, b in self.block.split(base, base + self.plan.host_span[i]):
            out += _chunks(a - base, b - base, self.chunk_bytes)
        return out

    def dest(self, i, a, b):
        lo = self.plan.host_base[i]
        view = self._view
        return lambda cancel: view[lo + a : lo + b]

    def host(self, i, a, b):
        lo = self.plan.host_base[i]
        return self.block.tensor[lo + a : lo + b]

    def landed(self, i, a, b, event):
        self.block.fence(event)


class _RingRoute(_Route):
    """Through the staging ring: chunk ``seq`` waits for slot ``seq % slots`` to be free."""

    def __init__(self, plan: LoadPlan, ring: StagingRing):
        self.ring = ring
        self._seq: dict[tuple[int, int], int] = {}
        self._ranges: list[list[tuple[int, int]]] = []
        slot = ring.slot_bytes
        for i in range(len(plan.checkpoint.files)):
            pieces = []
            for a in range(0, plan.host_span[i], slot):
                self._seq[(i, a)] = len(self._seq)
                pieces.append((a, min(a + slot, plan.host_span[i])))
            self._ranges.append(pieces)

    def ranges(self, i):
        return self._ranges[i]

    def dest(self, i, a, b):
        seq, ring = self._seq[(i, a)], self.ring

        def acquire(cancel: threading.Event) -> memoryview | None:
            view = ring.acquire(seq, cancel)
            return None if view is None else view[: b - a]

        return acquire

    def host(self, i, a, b):
        o = self.ring.offset(self._seq[(i, a)])
        return self.ring.arena.tensor[o : o + b - a]

    def landed(self, i, a, b, event):
        # The slot is refilled only after this copy's event has completed.
        self.ring.issued(self._seq[(i, a)], event)


class _ArenaRoute(_Route):
    """Into page-aligned host memory in the plan's host layout: the returned CPU tensors'
    own memory, or (``copies``) a staging area copied chunk by chunk to a given target."""

    def __init__(self, plan: LoadPlan, arena: HostArena, chunk_bytes: int, copies: bool = False):
        self.plan, self.chunk_bytes = plan, chunk_bytes
        self._view = arena.view(0, arena.nbytes)
        self._host = arena.tensor if copies else None

    def host(self, i, a, b):
        lo = self.plan.host_base[i]
        return self._host[lo + a : lo + b]

    def ranges(self, i):
        return _chunks(0, self.plan.host_span[i], self.chunk_bytes)

    def dest(self, i, a, b):
        lo = self.plan.host_base[i]
        view = self._view
        return lambda cancel: view[lo + a : lo + b]


def _chunks(start: int, end: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, end)) for a in range(start, end, step)]


def _identity(ckpt: Checkpoint) -> tuple:
    # ctime as well as mtime: a rewrite in place that restores the mtime (rsync -t,
    # touch -r) still moves the ctime, which no user call can set.
    ids = []
    for f in ckpt.files:
        st = os.stat(f.path)
        ids.append(
            (
                os.path.realpath(f.path),
                st.st_dev,
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
                st.st_ctime_ns,
            )
        )
    return ("nostall-checkpoint", tuple(ids))


def _same_file(f: FileIndex, backend: ReadBackend, when: str) -> None:
    """:class:`FileChanged` unless the open file is the one whose header was read."""
    if f.identity is None:
        return
    try:
        now = FileIdentity.of(os.fstat(backend.fd))
    except OSError as e:
        raise ReadError(f"cannot stat the open file: {e.strerror or e}", path=f.path) from e
    if now != f.identity:
        raise FileChanged(
            f"the file changed {when} (size {f.identity.size} → {now.size}, modified "
            f"{f.identity.mtime_ns} → {now.mtime_ns} ns, inode {f.identity.ino} → {now.ino}); "
            "its bytes were not used. Switch or load again to read the new version, and "
            "write checkpoints under a temporary name, renamed into place when complete",
            path=f.path,
        )


def _check_into(into: torch.Tensor, plan: LoadPlan, dev: torch.device) -> None:
    if not isinstance(into, torch.Tensor) or into.dtype != torch.uint8 or into.dim() != 1:
        raise ArgumentError(f"into= must be a flat uint8 tensor, got {into!r:.80}")
    if into.device != dev:
        raise ArgumentError(f"into= is on {into.device}, the load goes to {dev}")
    if into.numel() < plan.target_bytes or not into.is_contiguous():
        raise ArgumentError(
            f"into= holds {into.numel()} bytes; this checkpoint needs {plan.target_bytes} "
            "contiguous bytes"
        )


def _target_buffer(nbytes: int, dev: torch.device) -> torch.Tensor:
    """The flat buffer the loaded tensors view: device memory, or for a CPU load private
    page-aligned memory (freed when the last tensor viewing it is garbage)."""
    if dev.type == "cuda":
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)
    arena = HostArena(max(nbytes, 1), segment_bytes=round_up(max(nbytes, 1), PAGE))
    flat = arena.tensor
    arena.close()
    return flat
