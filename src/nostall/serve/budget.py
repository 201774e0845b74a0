"""One device budget per process and GPU: the model cache, the embedding service's
encoders and every job's activations draw from one account.

A :class:`DeviceBudget` is created by whoever starts the serving parts of a process
(``nostall serve``, a benchmark, a test) and passed to each: the
:class:`~nostall.serve.embed.EmbeddingService` claims its encoders' bytes, the
:class:`~nostall.serve.worker.Worker` gives its model cache what is left. The account::

    total      free device memory when the budget is made (CUDA: what the driver
               reports free plus what torch's allocator holds unused)
    − external what another process on this device declared (a separate embedding
               service: ``nostall serve --embed-budget-gb``)
    − reserve  kept free for activations: each job's peak (denoise, the VAE decode, the
               Wan decode's scratch buffers) above the weights
    − claims   ``{"embedding service": …, "model cache": …}``
    = left

The model cache's device tier is one allocation made once (:mod:`nostall.cache.device`),
so the reserve must be right before it is taken: it is the largest activation peak
remembered for the served pipelines (measured per pipeline and shape on first use, kept
in ``activation-peaks.json`` beside the digest index) with a margin, at least 2 GiB; and
at least 10% of the total while a served pipeline has no peak measured yet. A job that
peaks above it is said once in the log and reserved for at the next start.

>>> b = DeviceBudget("cpu", total=10 << 30, external=2 << 30, reserve=1 << 30, cache_dir=False)
>>> b.claim("embedding service", 3 << 30) >> 30, b.claim_rest("model cache") >> 30
(3, 4)
>>> b.left
0
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from nostall.cache.device import DeviceTier
from nostall.cache.experts import expert_roles
from nostall.cache.report import human_bytes
from nostall.errors import ArgumentError, BudgetExceeded, NostallError
from nostall.store.catalog import ComponentEntry, PipelineEntry, Store
from nostall.store.dtypes import BITS
from nostall.transfer.loader import resolve_device

__all__ = [
    "PEAKS_FILE",
    "DeviceBudget",
    "DeviceMemory",
    "device_bytes",
    "is_out_of_memory",
    "text_encoder_bytes",
    "unfit",
    "video_only",
]

log = logging.getLogger(__name__)

PEAKS_FILE = "activation-peaks.json"
RESERVE_MARGIN = 1.25  # the allocator's fragmentation and a concurrent encoder batch
MIN_RESERVE = 2 << 30
RESERVE_SHARE = 0.10  # of the total, until peaks are measured
_FLOATS = {"F16", "BF16", "F32", "F64"}  # cast to the load dtype (FP8 weights are kept)
_TARGET_ALIGN = 256  # each tensor's start in the device tier (nostall.transfer.plan)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # an embedding service's


def device_bytes(c: ComponentEntry, dtype: torch.dtype | None) -> int:
    """The bytes ``c``'s weights take in the device tier, loaded in ``dtype`` (``None``:
    as stored), in whole slots. A lower bound by the few float32 modules a library keeps
    under a 16-bit ``dtype``; read off the headers, nothing is built. (FLUX.1-dev's
    transformer in bfloat16: 23.8 GB.)

    >>> transformer = Store("/models").entry("flux").components["transformer"]  # doctest: +SKIP
    >>> device_bytes(transformer, torch.bfloat16) / 1e9  # doctest: +SKIP
    """
    if c.checkpoint is None:
        return 0
    size = dtype.itemsize if dtype is not None and dtype.is_floating_point else None
    total = 0
    for _, e in c.checkpoint.entries():
        n = e.nbytes
        if size is not None and e.dtype in _FLOATS:
            n = n // (BITS[e.dtype] // 8) * size
        total += -(-n // _TARGET_ALIGN) * _TARGET_ALIGN
    return DeviceTier.slot_size(total)


def text_encoder_bytes(store: Store, dtype: torch.dtype | None = None) -> int:
    """The device bytes of every distinct text encoder in ``store``, loaded in ``dtype``:
    what an embedding service serving them all takes once each has been asked for (a
    worker beside a separate one on its GPU leaves this much out: ``external``)."""
    seen: dict[str, int] = {}
    for name in store.names():
        for role, c in store.entry(name).components.items():
            if c is not None and c.weights and role in TEXT_ENCODERS and c.digest not in seen:
                seen[c.digest] = device_bytes(c, dtype)
    return sum(seen.values())


def video_only(entry: PipelineEntry) -> bool:
    """A Wan pipeline: a worker decodes its latents (the VAE alone), nothing else."""
    vae = entry.components.get("vae")
    return vae is not None and vae.class_name == "AutoencoderKLWan"


def unfit(
    jobs: Iterable[tuple[PipelineEntry, Iterable[str]]],
    tier: int,
    dtype: torch.dtype | None,
    budget: DeviceBudget | None = None,
    least: Callable[[PipelineEntry, frozenset[str]], int | None] | None = None,
) -> BudgetExceeded | None:
    """The error naming every pipeline whose job the device tier of ``tier`` bytes can
    never hold, ``None`` when all fit. ``least(entry, roles left out)``: the fewest
    bytes the cache can serve a pipeline in, its largest component streamed in part
    (:mod:`nostall.cache.partial`; ``None``: it cannot stream). A job needs its pipeline's distinct weights
    components at once, but the roles it leaves out (``jobs``: ``(entry, roles)``; no
    text encoders where an embedding service stands in), and of a two-expert pipeline
    (Wan 2.2 A14B) only the larger expert, and that beside the rest but its text
    encoders (which leave once they have encoded). One that fits only without its text encoders is said in the log (it cannot
    fall back to encoding locally). ``budget``: the account the message shows.

    >>> error = unfit([(store.entry("flux"), ())], 20 << 30, torch.bfloat16)  # doctest: +SKIP
    >>> if error is not None:  # doctest: +SKIP
    ...     raise error  # "... flux needs 33.76 GB at once (its largest component, ..."
    """
    problems, most = [], 0
    for entry, leaves_out in jobs:
        leaves_out = frozenset(leaves_out)
        sizes = {c.role: device_bytes(c, dtype) for c in entry.distinct_weights(leaves_out)}
        need = sum(sizes.values())
        experts = expert_roles(entry, leaves_out)
        if experts is not None:  # one expert at a time beside the rest (cache.experts),
            need -= min(sizes[r] for r in experts)  # the text encoders gone where need be
            text = sum(n for r, n in sizes.items() if r.startswith("text_encoder"))
            larger = max(sizes[r] for r in experts)
            need = max(need - text, need - larger)
        if need > tier and least is not None:
            fewest = least(entry, leaves_out)
            if fewest is not None and fewest <= tier:
                log.info(
                    "%s needs %s whole, more than the GPU tier's %s: it is served with its "
                    "largest component resident in part (%s at least)",
                    entry.name,
                    human_bytes(need),
                    human_bytes(tier),
                    human_bytes(fewest),
                )
                continue
        if need > tier:
            role = max(sizes, key=sizes.__getitem__)
            most = max(most, need)
            problems.append(
                f"{entry.name} needs {human_bytes(need)} at once (its largest component, "
                f"{entry.name}/{role}, {human_bytes(sizes[role])})"
            )
            continue
        whole = sum(device_bytes(c, dtype) for c in entry.distinct_weights())
        if whole > tier and not video_only(entry):
            log.warning(
                "%s needs %s with its text encoders and the GPU tier holds %s: while the "
                "embedding service fails, its requests fail instead of encoding locally",
                entry.name,
                human_bytes(whole),
                human_bytes(tier),
            )
    if not problems:
        return None
    account = f"; this process's device budget: {budget.describe()}" if budget else ""
    return BudgetExceeded(
        f"the GPU tier ({human_bytes(tier)}) can never hold what these pipelines need, so "
        f"the worker does not start: {'; '.join(problems)}. Give the worker at least "
        f"{human_bytes(most)} (gpu_budget, --gpu-budget-gb{account}), load them in a "
        "smaller dtype, or take them out of the store",
        tier="gpu",
        requested=most,
        budget=tier,
        in_use=0,
    )


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is the device running out of memory (torch's ``OutOfMemoryError``,
    or a ``RuntimeError`` saying so from a kernel or library); nostall's typed errors
    (a tier that cannot be allocated, :class:`~nostall.BudgetExceeded`) are not."""
    if isinstance(e, NostallError):
        return False
    if isinstance(e, torch.OutOfMemoryError):
        return True
    # cuBLAS and cuDNN say it their own way ("CUBLAS_STATUS_ALLOC_FAILED")
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "out of memory" in text.lower() or "ALLOC_FAILED" in text
    )


class DeviceMemory:
    """What a budget reads off its device. On CUDA torch's caching allocator answers;
    on a CPU there is no allocator to ask (``allocated``/``peak`` are ``None``, so no
    peak is measured) and the total is a quarter of the memory limit, as the model
    cache's CPU default. Tests pass a subclass with made-up numbers."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    @property
    def name(self) -> str:
        """The kind of device: peaks are remembered per kind (``NVIDIA H200``)."""
        return torch.cuda.get_device_name(self.device) if self.cuda else "cpu"

    def free(self) -> int:
        if not self.cuda:
            from nostall.memory.host import memory_limit

            return (memory_limit()[0] or (16 << 30)) // 4
        free, _ = torch.cuda.mem_get_info(self.device)
        # the driver counts torch's cached, unused blocks as taken; this process can use them
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return free + cached

    def unreserved(self) -> int:
        """What the driver has free (torch's cached blocks not counted): a job needing
        more uses those blocks, which fragmentation may have cut too small."""
        return torch.cuda.mem_get_info(self.device)[0] if self.cuda else self.free()

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def release(self) -> None:
        """Give back what nothing references: garbage (a failed job's frames hold its
        tensors) and torch's cached blocks."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def floor(self, total: int, *, measured: bool = False) -> int:
        """The least activation reserve: a share of ``total`` until every pipeline's
        peak is ``measured``; none on a CPU (activations take the rest of the RAM)."""
        if not self.cuda:
            return 0
        return MIN_RESERVE if measured else max(MIN_RESERVE, int(total * RESERVE_SHARE))


class DeviceBudget:
    """The bytes one process may use on ``device``, split among its users.

    Args:
        total: bytes to split (default: the device's free memory now, see
            :class:`DeviceMemory`).
        external: bytes another process declared on this device (a separate embedding
            service whose encoders load later): left out.
        reserve: bytes kept free for activations (default: the largest peak remembered
            for ``pipelines`` on this kind of device, times 1.25, at least the floor:
            :meth:`DeviceMemory.floor`, a share of the total unless each of
            ``pipelines`` has a peak remembered).
        pipelines: the names whose remembered peaks size the default reserve (default:
            every name remembered for this kind of device, and the share).
        cache_dir: where ``activation-peaks.json`` lives (default: the digest index's
            folder, :func:`~nostall.store.digest_index.default_cache_dir`; ``False``: in
            memory only).
        memory: the device's numbers (default: :class:`DeviceMemory` of ``device``).

    Thread-safe. Raises :class:`~nostall.BudgetExceeded` when ``external`` and
    ``reserve`` leave nothing of ``total``.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        *,
        total: int | None = None,
        external: int = 0,
        reserve: int | None = None,
        pipelines: Iterable[str] | None = None,
        cache_dir: str | os.PathLike | bool | None = None,
        memory: DeviceMemory | None = None,
    ):
        self.device = resolve_device(device)
        for name, value in (("total", total), ("external", external), ("reserve", reserve)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ArgumentError(f"{name}={value!r} must be a number of bytes, 0 or more")
        self.memory = memory or DeviceMemory(self.device)
        self.kind = self.memory.name
        self.total = self.memory.free() if total is None else total
        self.external = external
        self._lock = threading.Lock()
        self._measuring = threading.local()  # this thread's measure() blocks, innermost last
        self._claims: dict[str, int] = {}
        self._said: set[tuple[str, str]] = set()  # peaks above the reserve, warned about
        self._write_failed = False
        self.path: str | None = None
        if cache_dir is not False:
            from nostall.store.digest_index import default_cache_dir

            root = default_cache_dir() if cache_dir in (None, True) else os.fspath(cache_dir)
            self.path = os.path.join(root, PEAKS_FILE)
        self._peaks: dict[str, dict[str, int]] = self._read().get(self.kind, {})
        if reserve is None:
            wanted = None if pipelines is None else set(pipelines)
            seen = [
                n
                for p, shapes in self._peaks.items()
                if wanted is None or p in wanted
                for n in shapes.values()
            ]
            measured = wanted is not None and all(p in self._peaks for p in wanted)
            floor = self.memory.floor(self.total, measured=measured)
            reserve = max([floor] + [int(n * RESERVE_MARGIN) for n in seen])
        self.reserve = reserve
        if self.left <= 0:
            raise BudgetExceeded(
                f"nothing of {self.device} is left to serve from: {self.describe()}; free "
                "memory on the device, or lower the activation reserve or the external share",
                tier="gpu",
                requested=external + reserve,
                budget=self.total,
                in_use=0,
            )

    # ---- the account ---------------------------------------------------------------

    @property
    def left(self) -> int:
        with self._lock:
            return self._left()

    def _left(self) -> int:
        return self.total - self.external - self.reserve - sum(self._claims.values())

    def claims(self) -> dict[str, int]:
        with self._lock:
            return dict(self._claims)

    def claim(self, who: str, nbytes: int) -> int:
        """Take ``nbytes`` for ``who``; returns them. :class:`~nostall.BudgetExceeded`
        names the account when they are not left; :class:`~nostall.ArgumentError` when
        ``who`` holds a claim already (one model cache, one embedding service)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ArgumentError(f"{who}: {nbytes!r} must be a number of bytes, 0 or more")
        with self._lock:
            if who in self._claims:
                raise ArgumentError(
                    f"{who} holds {human_bytes(self._claims[who])} of this budget already; "
                    "one budget serves one of each per process and device (release() first)"
                )
            left = self._left()
            if nbytes > left:
                raise BudgetExceeded(
                    f"{who} needs {human_bytes(nbytes)} of {self.device}, and "
                    f"{human_bytes(max(left, 0))} are left: {self._describe()}; give it less "
                    "(gpu_budget, --gpu-budget-gb), or lower the activation reserve or the "
                    "external share",
                    tier="gpu",
                    requested=nbytes,
                    budget=self.total,
                    in_use=self.total - left,
                )
            self._claims[who] = nbytes
            return nbytes

    def claim_rest(self, who: str) -> int:
        """Take everything left for ``who`` (the model cache's default)."""
        left = self.left
        if left <= 0:
            raise BudgetExceeded(
                f"nothing of {self.device} is left for {who}: {self.describe()}",
                tier="gpu",
                requested=1,
                budget=self.total,
                in_use=self.total,
            )
        return self.claim(who, left)

    def claim_cache(self, store: Store, gpu_budget: int | None, lora_room: int = 0) -> int:
        """The model cache's device tier: ``gpu_budget`` bytes, or (default) all that is
        left after ``lora_room`` bytes claimed for LoRA base copies (the weights a fused
        LoRA changes, kept to restore the base; without room they stay in host memory).
        On a CPU the default is what the store's components need."""
        from nostall.cache.host import cpu_tier_bytes

        if isinstance(lora_room, bool) or not isinstance(lora_room, int) or lora_room < 0:
            raise ArgumentError(f"lora_room={lora_room!r} must be a number of bytes, 0 or more")
        if lora_room:
            self.claim("LoRA base copies", lora_room)
        try:
            if gpu_budget is not None:
                return self.claim("model cache", gpu_budget)
            if self.device.type == "cpu":  # ordinary memory, committed at the first switch
                return self.claim("model cache", cpu_tier_bytes(store, self.left))
            return self.claim_rest("model cache")
        except BaseException:
            self.release("LoRA base copies")
            raise

    def release(self, who: str) -> None:
        """Give back what ``who`` claimed (nothing if it claimed nothing)."""
        with self._lock:
            self._claims.pop(who, None)

    def describe(self) -> str:
        """``120.50 GB free at start − 10.00 GB external − …``: the account in one line."""
        with self._lock:
            return self._describe()

    def _describe(self) -> str:
        parts = [f"{human_bytes(self.total)} free at start"]
        if self.external:
            parts.append(f"{human_bytes(self.external)} declared by another process")
        parts.append(f"{human_bytes(self.reserve)} activation reserve")
        parts += [f"{human_bytes(n)} {who}" for who, n in self._claims.items()]
        return " − ".join(parts)

    # ---- activation peaks ------------------------------------------------------------

    def peak(self, pipeline: str, shape: str) -> int | None:
        """The activation peak remembered for ``pipeline`` at ``shape``, if any."""
        with self._lock:
            return self._peaks.get(pipeline, {}).get(shape)

    @contextlib.contextmanager
    def measure(self, pipeline: str, shape: str) -> Iterator[None]:
        """Measure the block's activation peak (what it allocated above what it started
        and ended with) and :meth:`record` it; a block that ran out of memory records
        what it reached (at least that much is needed), one that raised anything else
        nothing, and nothing is measured where the device has no allocator to ask.

        Before the block, torch's cached blocks are given back when the driver has fewer
        bytes free than the remembered peak (blocks cut for earlier shapes may not hold
        this one's tensors)."""
        mem = self.memory
        base = mem.allocated()
        if base is None:
            yield
            return
        known = self.peak(pipeline, shape)
        if known is not None and known > mem.unreserved():
            mem.release()
        frames = self._frames()
        frame: dict[str, int | None] = {"top": None}  # the peak before a paused() part
        frames.append(frame)
        mem.reset_peak()
        try:
            yield
        except BaseException as e:
            top = _larger(mem.peak(), frame["top"])
            if is_out_of_memory(e) and top is not None:
                self.record(pipeline, shape, max(0, top - base))  # at least this much
            raise
        finally:
            frames.pop()
        top, after = _larger(mem.peak(), frame["top"]), mem.allocated()
        if top is not None and after is not None:
            # Above the larger of before and after: weights that arrived and stayed (a
            # first switch's tier, a module's buffers) are not activations.
            self.record(pipeline, shape, max(0, top - max(base, after)))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A part of this thread's :meth:`measure` block that is not its job (another job
        run inside it, at a paused denoising step): the block's peak so far is kept, and
        its measure resumes after the part, whose own blocks measure themselves."""
        frames = self._frames()
        if frames:
            frames[-1]["top"] = _larger(self.memory.peak(), frames[-1]["top"])
        try:
            yield
        finally:
            if frames:
                self.memory.reset_peak()

    def _frames(self) -> list[dict[str, int | None]]:
        frames = getattr(self._measuring, "frames", None)
        if frames is None:
            frames = self._measuring.frames = []
        return frames

    def record(self, pipeline: str, shape: str, nbytes: int) -> None:
        """Remember ``nbytes`` as ``pipeline``'s activation peak at ``shape`` (the larger
        of it and what was known), here and in the peaks file. A peak above the reserve
        is said once: the device tier was sized without it, so such jobs may run out
        of memory until the next start reserves it."""
        with self._lock:
            shapes = self._peaks.setdefault(pipeline, {})
            if nbytes <= shapes.get(shape, -1):
                return
            shapes[shape] = nbytes
            over = nbytes > self.reserve and (pipeline, shape) not in self._said
            if over:
                self._said.add((pipeline, shape))
        if over:
            log.warning(
                "%s at %s peaked at %s of activations, above the %s reserved when this "
                "process started: such jobs may run out of memory (and are retried once); "
                "the next start reserves %s (remembered in %s), or give the reserve "
                "(--activation-reserve-gb)",
                pipeline,
                shape,
                human_bytes(nbytes),
                human_bytes(self.reserve),
                human_bytes(int(nbytes * RESERVE_MARGIN)),
                self.path or "memory only",
            )
        self._write(pipeline, shape, nbytes)

    def status(self) -> dict[str, Any]:
        """The account and the remembered peaks (the worker's status page shows it)."""
        with self._lock:
            return {
                "device": str(self.device),
                "kind": self.kind,
                "total": self.total,
                "external": self.external,
                "reserve": self.reserve,
                "claims": dict(self._claims),
                "left": self._left(),
                "peaks": {p: dict(s) for p, s in self._peaks.items()},
            }

    # ---- the peaks file ----------------------------------------------------------------

    def _read(self) -> dict[str, dict[str, dict[str, int]]]:
        if self.path is None or not os.path.exists(self.path):
            return {}
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            return _valid(data)
        except (OSError, ValueError) as e:
            log.warning("%s is unreadable (%s); activation peaks are measured again", self.path, e)
            return {}

    def _write(self, pipeline: str, shape: str, nbytes: int) -> None:
        """Merge into the file (other processes write it too: the larger peak stays),
        written under a temporary name and renamed into place."""
        if self.path is None:
            return
        with self._lock:
            try:
                data = self._read()
                shapes = data.setdefault(self.kind, {}).setdefault(pipeline, {})
                shapes[shape] = max(nbytes, shapes.get(shape, 0))
                folder = os.path.dirname(self.path)
                os.makedirs(folder, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{PEAKS_FILE}.", dir=folder)
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        json.dump({"version": 1, "peaks": data}, f, indent=1, sort_keys=True)
                    os.replace(tmp, self.path)
                except BaseException:
                    os.unlink(tmp)
                    raise
            except OSError as e:
                if not self._write_failed:
                    self._write_failed = True
                    log.warning("cannot write %s (%s); peaks stay in memory", self.path, e)


def _valid(data: Any) -> dict[str, dict[str, dict[str, int]]]:
    """The peaks of a file's JSON: ``{"version": 1, "peaks": {kind: {pipeline: {shape:
    bytes}}}}``; ``ValueError`` for anything else."""
    peaks = data.get("peaks") if isinstance(data, dict) and data.get("version") == 1 else None
    if not isinstance(peaks, dict):
        raise ValueError("not a version 1 peaks file")
    out: dict[str, dict[str, dict[str, int]]] = {}
    for kind, pipes in peaks.items():
        for p, shapes in (pipes if isinstance(pipes, dict) else {}).items():
            for s, n in (shapes if isinstance(shapes, dict) else {}).items():
                if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                    out.setdefault(kind, {}).setdefault(p, {})[s] = n
    return out


def _larger(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)
