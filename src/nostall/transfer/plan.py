"""Where every byte of one load goes: file → host memory → one flat target buffer.

A :class:`LoadPlan` is computed from the validated headers before a byte is read.
It fixes two layouts:

* **host**: each file, from byte 0, at a 4 KiB-aligned offset of the host buffer
  (a pool block, a staging slot, or a CPU load's own memory), so file and host
  offsets share their alignment — what ``O_DIRECT`` needs;
* **target**: each tensor's offset in the flat buffer the returned tensors view,
  chosen so kernels see the alignment they see after ``from_pretrained`` — outputs
  then match it bit for bit (CPU matmuls sum in another order when a weight is 16-byte
  misaligned; GPU kernels lose vectorised loads). On a GPU every tensor starts on a
  256-byte boundary, as the caching allocator places it; on the CPU
  (``mirror_file=True``) a tensor keeps its file offset modulo 256, as the mmap
  views that ``from_pretrained`` computes with there. A tensor that changes dtype gets room for its
  *target* dtype and is gathered and cast on its own
  (:class:`~nostall.transfer.copy.Transfer`): peak memory is the target checkpoint
  plus the tensors being cast — never two full copies. When the files' own offsets
  are already aligned and nothing is cast, the data sections are copied as they are,
  one copy per chunk.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from nostall.errors import ArgumentError, CheckpointError
from nostall.memory.host import round_up
from nostall.store import Checkpoint, to_torch

__all__ = ["CASTABLE", "Cast", "Copy", "LoadPlan", "Slot"]

HOST_ALIGN = 4096  # O_DIRECT granularity; every file starts at such an offset in host memory
TARGET_ALIGN = 256  # keeps each tensor's alignment inside the flat target buffer
CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Slot:
    """One tensor: its bytes ``[begin, end)`` in file ``file`` and its place in the target."""

    name: str
    file: int
    begin: int
    end: int
    shape: tuple[int, ...]
    source: torch.dtype
    target: torch.dtype
    offset: int  # in the flat target buffer

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def target_bytes(self) -> int:
        return self.numel * self.target.itemsize


@dataclass(frozen=True)
class Copy:
    """Copy file bytes ``[lo, hi)`` to ``offset`` of the target buffer, unchanged."""

    lo: int
    hi: int
    offset: int


@dataclass(frozen=True)
class Cast:
    """File bytes ``[lo, hi)`` belong to ``slot``, whose dtype changes."""

    slot: Slot
    lo: int
    hi: int


class LoadPlan:
    """The host and target layouts of one checkpoint, and the copies between them.

    ``dtype`` is ``None`` (keep every dtype), one dtype for every floating tensor
    (fp16/bf16/fp32/fp64; fp8 and integer tensors keep theirs), or a mapping of
    tensor names to dtypes (names not in it keep theirs).

    ``names``: only these tensors go into the target (a component resident in part,
    :mod:`nostall.stream`); each keeps the alignment it has in the whole plan, and the
    host layout stays the whole files'.

    >>> plan = LoadPlan(resolve("model.safetensors"), torch.bfloat16)  # doctest: +SKIP
    >>> plan.casts, plan.target_bytes  # doctest: +SKIP
    (True, 23782131712)
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
        *,
        mirror_file: bool = False,
        names: frozenset[str] | None = None,
    ):
        self.checkpoint = checkpoint
        self.names = names
        files = checkpoint.files
        for d in _requested(dtype):
            if d not in CASTABLE:
                raise ArgumentError(
                    f"dtype={d} is not a cast target; use one of "
                    f"{', '.join(str(c) for c in CASTABLE)} (fp8 and integer tensors are never cast)"
                )
        self.host_base: list[int] = []
        self.host_span: list[int] = []
        h = 0
        for f in files:
            span = round_up(f.data_end, HOST_ALIGN)
            self.host_base.append(h)
            self.host_span.append(span)
            h += span
        self.host_bytes = max(h, HOST_ALIGN)

        entries = checkpoint.entries()
        if names is not None:
            unknown = sorted(names - {e.name for _, e in entries})
            if unknown:
                raise ArgumentError(
                    f"{len(unknown)} tensor(s) asked for are not in the checkpoint, e.g. "
                    f"{unknown[0]!r}"
                )
            entries = [(i, e) for i, e in entries if e.name in names]
        raw: list[tuple[int, object, torch.dtype, torch.dtype]] = []
        for i, e in entries:
            source = to_torch(e.dtype)
            if source is None:
                raise CheckpointError(
                    f"dtype {e.dtype} has no torch equivalent in torch {torch.__version__}; "
                    "upgrade torch or convert the checkpoint",
                    path=files[i].path,
                    tensor=e.name,
                )
            want = dtype.get(e.name, source) if isinstance(dtype, Mapping) else dtype
            target = want if want is not None and source in CASTABLE else source
            raw.append((i, e, source, target))
        self.casts = any(source != target for _, _, source, target in raw)
        aligned = all((e.begin - files[i].data_start) % TARGET_ALIGN == 0 for i, e, _, _ in raw)
        # (a subset is placed tensor by tensor: a data section holds the others too)
        self.packed = (aligned or mirror_file) and not self.casts and names is None

        def place(d: int, mod: int) -> int:
            # The first offset >= d that is congruent to mod (mod TARGET_ALIGN).
            return d + (mod - d) % TARGET_ALIGN

        slots: list[Slot] = []
        if self.packed:
            # Data sections as they are: a chunk is one copy, whatever it holds.
            dev_base, d = [], 0
            for f in files:
                base = place(d, f.data_start % TARGET_ALIGN) if mirror_file else d
                dev_base.append(base - f.data_start)
                d = round_up(base + f.data_bytes, TARGET_ALIGN)
            for i, e, source, target in raw:
                slots.append(
                    Slot(e.name, i, e.begin, e.end, e.shape, source, target, dev_base[i] + e.begin)
                )
            self._dev_base = dev_base
        else:
            d = 0
            for i, e, source, target in raw:
                keep = mirror_file and source == target
                d = place(d, e.begin % TARGET_ALIGN if keep else 0)
                slot = Slot(e.name, i, e.begin, e.end, e.shape, source, target, d)
                slots.append(slot)
                d += slot.target_bytes
            self._dev_base = []
        self.slots = slots
        self.target_bytes = d
        self._by_file: list[list[Slot]] = [[] for _ in files]
        for s in slots:
            if s.end > s.begin:
                self._by_file[s.file].append(s)
        for lst in self._by_file:
            lst.sort(key=lambda s: s.begin)
        self._begins = [[s.begin for s in lst] for lst in self._by_file]

    @property
    def num_tensors(self) -> int:
        return len(self.slots)

    def pieces(self, i: int, a: int, b: int) -> Iterator[Copy | Cast]:
        """The copies for file ``i``'s bytes ``[a, b)`` (file offsets), once they are in
        host memory."""
        f = self.checkpoint.files[i]
        if self.packed:
            lo, hi = max(a, f.data_start), min(b, f.data_end)
            if lo < hi:
                yield Copy(lo, hi, self._dev_base[i] + lo)
            return
        lst = self._by_file[i]
        k = max(0, bisect.bisect_right(self._begins[i], a) - 1)
        run: Copy | None = None  # tensors back to back in the file and in the target
        while k < len(lst) and lst[k].begin < b:
            s = lst[k]
            lo, hi = max(a, s.begin), min(b, s.end)
            if lo < hi:
                if s.source == s.target:
                    offset = s.offset + lo - s.begin
                    if run is not None and run.hi == lo and run.offset + run.hi - run.lo == offset:
                        # One copy for the run: tensors whose sizes are multiples of the
                        # alignment (nearly every weight) sit back to back on both sides.
                        run = Copy(run.lo, hi, run.offset)
                    else:
                        if run is not None:
                            yield run
                        run = Copy(lo, hi, offset)
                else:
                    if run is not None:
                        yield run
                        run = None
                    yield Cast(s, lo, hi)
            k += 1
        if run is not None:
            yield run

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors as views of the flat target buffer (``uint8``, ``target_bytes`` long)."""
        out: dict[str, torch.Tensor] = {}
        typed = _TypedViews(flat)
        for s in self.slots:
            if s.numel == 0:
                out[s.name] = torch.empty(s.shape, dtype=s.target, device=flat.device)
                continue
            out[s.name] = typed.view(s.offset, s.target_bytes, s.target, s.shape)
        return out

    def source_views(self, host: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors in their file dtypes as views of host memory in the host layout."""
        out: dict[str, torch.Tensor] = {}
        typed = _TypedViews(host)
        for s in self.slots:
            n = s.end - s.begin
            if n == 0:
                out[s.name] = torch.empty(s.shape, dtype=s.source)
                continue
            start = self.host_base[s.file] + s.begin
            if start % s.source.itemsize:
                out[s.name] = host[start : start + n].clone().view(s.source).view(s.shape)
            else:
                out[s.name] = typed.view(start, n, s.source, s.shape)
        return out


class _TypedViews:
    """Typed, shaped views of a flat ``uint8`` tensor at byte offsets.

    One ``as_strided`` per tensor on a per-dtype reinterpretation of the whole buffer,
    instead of a slice, a dtype view and a shape view: the same tensors (storage,
    address, shape, contiguous strides) in a third of the dispatcher calls. The views of
    FLUX's 1654 FP8 tensors took 11 ms instead of 19 (a shared 2-core machine), and on a
    GPU load they hold the GIL that the reader threads wait for. Offsets the dtype
    cannot start at take the three calls, which raise as they did.
    """

    def __init__(self, flat: torch.Tensor):
        self.flat = flat
        self._base = flat.storage_offset()
        self._typed: dict[torch.dtype, torch.Tensor | None] = {}

    def _reinterpreted(self, dtype: torch.dtype) -> torch.Tensor | None:
        if dtype not in self._typed:
            size = dtype.itemsize
            whole = self.flat.numel() - self.flat.numel() % size
            ok = self._base % size == 0 and whole > 0 and self.flat.is_contiguous()
            self._typed[dtype] = self.flat[:whole].view(dtype) if ok else None
        return self._typed[dtype]

    def view(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """``flat[offset : offset + nbytes]`` as a contiguous ``dtype`` tensor of ``shape``."""
        size = dtype.itemsize
        strides, numel = [], 1
        for d in reversed(shape):
            strides.append(numel)
            numel *= d
        typed = self._reinterpreted(dtype)
        # as_strided checks only the storage's bounds; the buffer's own are checked here,
        # and anything the three calls would refuse takes them.
        if (
            typed is None
            or offset % size
            or numel * size != nbytes
            or offset + nbytes > self.flat.numel()
        ):
            return self.flat[offset : offset + nbytes].view(dtype).view(shape)
        return typed.as_strided(shape, strides[::-1], (self._base + offset) // size)


def _requested(dtype: torch.dtype | Mapping[str, torch.dtype] | None) -> list[torch.dtype]:
    if dtype is None:
        return []
    if isinstance(dtype, Mapping):
        return list(dtype.values())
    if not isinstance(dtype, torch.dtype):
        raise ArgumentError(f"dtype={dtype!r} is not a torch.dtype (e.g. torch.bfloat16)")
    return [dtype]
