"""The serve bench's fair peer: plain diffusers pipelines kept on the device by LRU.

:class:`~nostall.bench.serve_peer.PeerWorker` keeps one pipeline on the device at a time.
Nobody with a GPU that holds two or three pipelines of a larger catalog runs that; a
competent team without nostall keeps as many on the device as fit and moves the rest in
when asked (issue 31 asks the bench to race that). :class:`LruPeer` is that team's server:

* every pipeline loaded once with diffusers' ``from_pretrained`` into CPU memory, and the
  modules that fine-tunes share (the same text encoders, the same VAE files) loaded once
  and handed to the later pipelines' ``from_pretrained`` as that module object, so they
  are held, and moved, once. Two components are "the same" when their classes and the
  dtype they load in are, and their folders resolve to one path, or else their
  ``*.safetensors`` files have the same names and sizes, the same first and last MiB, and
  their ``config.json`` the same bytes: cheap to decide at boot, and what a link farm or a
  copied folder of a fine-tune's shared parts gives;
* the device holds components, not pipelines, up to ``budget_bytes`` of weights: a
  switch moves in what the pipeline asked for lacks, evicting the least recently used
  components it does not use first. Eviction points the parameters back at the CPU copy
  (free: no copy, as ``PeerWorker``'s mode ``to`` does); moving in is ``module.to(device)``;
* each component's CPU copy is one flat buffer of anonymous memory owned by the peer
  (``from_pretrained`` may leave tensors mapped from the file, which the page cache can
  drop), either pageable or page-locked with ``cudaHostRegister`` (``pinned``), and
  :meth:`LruPeer.set_pinned` switches between the two on one set of copies, so the bench
  races both from one boot.

It answers the bench's HTTP shape through :func:`~nostall.bench.serve_peer.create_peer_app`,
which takes it by duck typing (``folders``, ``mode``, ``generate``, ``close``)::

    peer = LruPeer(folders, device="cuda", budget_bytes=60 << 30, pinned=True)
    peer.load()
    with BackgroundServer(create_peer_app(peer)) as server:
        ...
    peer.close()
"""

from __future__ import annotations

import difflib
import gc
import hashlib
import json
import os
import time
from collections import OrderedDict
from typing import Any

import torch

from nostall.bench.serve_peer import PeerJob, point_back, run_job, stored_dtype, trim_heap
from nostall.bench.timing import sync
from nostall.errors import ArgumentError, ClosedError, DeviceError, InternalError, UnknownModel

__all__ = ["LruPeer"]

_ALIGN = 256  # each tensor's offset in a flat buffer: the widest dtype, and CUDA's own
_SEGMENT = 1 << 30  # bytes per registration (at most, but for one larger tensor)
_EDGE = 1 << 20  # bytes hashed at each end of a weight file to tell files apart

Kept = list[tuple[torch.nn.Module, str, bool, torch.Tensor]]


class LruPeer:
    """Plain diffusers pipelines whose components share the device by LRU under a budget.

    ``folders``: pipeline name → diffusers folder. ``budget_bytes``: the most weight bytes
    kept on ``device``; every pipeline must fit alone. ``pinned``: the CPU copies
    page-locked (a CUDA device only); :meth:`set_pinned` changes it later.
    ``host_budget_bytes``: the most bytes of CPU copies kept (``None``: all of them);
    beyond it the least recently used copies not on the device are dropped and read
    again from the store (``from_pretrained`` of the component) when next wanted, as a
    team whose RAM cannot hold its catalog does.

    :meth:`load` reads every pipeline into CPU memory (the server's boot); :meth:`switch`
    makes one pipeline resident; :meth:`generate` switches and runs a job; :meth:`close`
    frees everything, after which the peer refuses work (:class:`~nostall.ClosedError`).
    Not thread-safe: one caller at a time (the app's one thread).

    What it reports, keyed by component (``"<first pipeline>/<role>"``):
    ``component_bytes`` (weight bytes on the device), ``uses`` (pipeline → its component
    keys), ``modules`` (the one module object), ``resident`` (the ones on the device, least
    recently used first) and ``switches`` (per switch: ``model``, ``moved`` key → bytes,
    ``moved_bytes``, ``evicted`` keys, ``switch_s``).
    """

    def __init__(
        self,
        folders: dict[str, str],
        *,
        device: str | torch.device,
        budget_bytes: int,
        pinned: bool = False,
        host_budget_bytes: int | None = None,
    ):
        from nostall.transfer.loader import resolve_device

        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ArgumentError(
                f"budget_bytes={budget_bytes!r}; give the device's weight budget in bytes (> 0)",
                field="budget_bytes",
            )
        self.folders = dict(folders)
        self.device = resolve_device(device)
        self.budget_bytes = budget_bytes
        if host_budget_bytes is not None and (
            not isinstance(host_budget_bytes, int) or host_budget_bytes <= 0
        ):
            raise ArgumentError(
                f"host_budget_bytes={host_budget_bytes!r}; give the CPU copies' budget in "
                "bytes (> 0), or None for all of them",
                field="host_budget_bytes",
            )
        self.host_budget_bytes = host_budget_bytes
        self._check_pinnable(pinned)
        self._pinned = pinned
        self.pipes: dict[str, Any] = {}
        self.uses: dict[str, tuple[str, ...]] = {}
        self.modules: dict[str, torch.nn.Module] = {}
        self.component_bytes: dict[str, int] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()
        self.switches: list[dict[str, Any]] = []
        self.order = 0
        self.load_s = 0.0
        # key → the flat CPU buffer that owns the component's bytes, and its tensors' views
        self._flat: dict[str, torch.Tensor] = {}
        self._segments: dict[str, list[tuple[int, int]]] = {}  # (offset, bytes) registered
        self._kept: dict[str, Kept] = {}
        self._registered: set[str] = set()  # keys whose flat buffer is page-locked
        self._by_identity: dict[tuple, str] = {}
        # key → (component folder, class, dtype): where a dropped CPU copy is read again
        self._source: dict[str, tuple[str, type, torch.dtype]] = {}
        self.on_cpu: OrderedDict[str, int] = OrderedDict()  # CPU copies, least recent first
        self._state = "new"  # "new" → "loaded" → "closed"

    @property
    def pinned(self) -> bool:
        """Whether the CPU copies are page-locked (moves are then asynchronous DMA)."""
        return self._pinned

    @property
    def mode(self) -> str:
        """``"lru-pinned"`` or ``"lru-pageable"``: how the bench names this peer."""
        return "lru-pinned" if self._pinned else "lru-pageable"

    def _check_pinnable(self, flag: bool) -> None:
        if flag and self.device.type != "cuda":
            raise ArgumentError(
                f"pinned=True on device {self.device}: page-locked copies only help a CUDA "
                "device; use pinned=False, or device='cuda'",
                field="pinned",
            )

    def load(self) -> float:
        """Read every pipeline into CPU memory, sharing equal components (the server's
        boot; not timed as a switch). Returns the seconds it took.

        Raises :class:`~nostall.ArgumentError` (and closes the peer) when a pipeline's
        components alone exceed ``budget_bytes``."""
        if self._state == "closed":
            raise ClosedError("LruPeer.load() after close(); make a new peer")
        t = time.perf_counter()
        for name, folder in self.folders.items():
            if name not in self.pipes:
                self._load_one(name, folder)
                need = sum(self.component_bytes[k] for k in self.uses[name])
                if need > self.budget_bytes:
                    self.close()
                    raise ArgumentError(
                        f"pipeline {name!r} ({folder}) needs {need} bytes on the device but "
                        f"budget_bytes={self.budget_bytes}; give a budget of at least {need}, "
                        f"or leave {name!r} out",
                        field="budget_bytes",
                    )
            self._trim_host(keep=())
        self._state = "loaded"
        self.load_s = time.perf_counter() - t
        return self.load_s

    def _load_one(self, name: str, folder: str) -> None:
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        dtype = stored_dtype(folder)
        with open(os.path.join(folder, "model_index.json")) as f:
            index = json.load(f)
        shared: dict[str, str] = {}  # role → key of the module handed in
        identities: dict[str, list[tuple]] = {}
        for role, spec in index.items():
            sub = os.path.join(folder, role)
            if role.startswith("_") or not isinstance(spec, list) or not os.path.isdir(sub):
                continue
            identities[role] = _identities(sub, tuple(spec), dtype)
            known = [self._by_identity[i] for i in identities[role] if i in self._by_identity]
            if known:
                shared[role] = known[0]
        # a bar per component and per shard would bury the bench's lines
        diffusers_logging.disable_progress_bar()
        transformers_logging.disable_progress_bar()
        try:
            pipe = DiffusionPipeline.from_pretrained(
                folder, torch_dtype=dtype, **{r: self.modules[k] for r, k in shared.items()}
            )
        finally:
            diffusers_logging.enable_progress_bar()
            transformers_logging.enable_progress_bar()
        pipe.set_progress_bar_config(disable=True)
        uses = []
        for role, module in pipe.components.items():
            if not isinstance(module, torch.nn.Module):
                continue
            key = shared.get(role)
            if key is None:
                key = f"{name}/{role}"
                self._source[key] = (os.path.join(folder, role), type(module), dtype)
                self._own(key, module)
                for i in identities.get(role, ()):
                    self._by_identity.setdefault(i, key)
            elif self.modules[key] is not module:
                raise InternalError(f"from_pretrained did not keep the {role} handed to {name!r}")
            uses.append(key)
        self.pipes[name] = pipe
        self.uses[name] = tuple(dict.fromkeys(uses))

    def _own(self, key: str, module: torch.nn.Module) -> None:
        """Copy ``module``'s parameters and buffers into one flat CPU buffer the peer owns
        and point the module at views of it. The buffer lives until :meth:`close`; the
        module's CPU tensors are those views whenever the component is not resident."""
        entries = []
        for m in module.modules():
            entries += [(m, n, True, p.data) for n, p in m.named_parameters(recurse=False)]
            entries += [(m, n, False, b) for n, b in m.named_buffers(recurse=False)]
        # tied weights (one tensor under two names) get one view, counted once
        offsets: dict[tuple, int] = {}
        total = used = 0
        for _, _, _, t in entries:
            k = _alias(t)
            if k not in offsets:
                offsets[k] = total
                total += -(-t.nbytes // _ALIGN) * _ALIGN
                used += t.nbytes
        flat = torch.empty(total, dtype=torch.uint8)
        # registered in segments of up to _SEGMENT split at tensor edges: some hosts
        # refuse one huge registration, and no copy may span two registrations
        edges, start = [], 0
        for at in sorted(set(offsets.values())):
            if at - start >= _SEGMENT:
                edges.append((start, at - start))
                start = at
        if total > start:
            edges.append((start, total - start))
        self._segments[key] = edges
        views: dict[tuple, torch.Tensor] = {}
        kept: Kept = []
        for m, n, is_param, t in entries:
            k = _alias(t)
            if k not in views:
                at = offsets[k]
                views[k] = flat[at : at + t.nbytes].view(t.dtype).view(t.shape)
                views[k].copy_(t)
            kept.append((m, n, is_param, views[k]))
        point_back(kept)
        self.modules[key] = module
        self.component_bytes[key] = used
        self._flat[key] = flat
        self._kept[key] = kept
        self.on_cpu[key] = used
        self.on_cpu.move_to_end(key)
        if self._pinned:
            self._register(key)

    def _trim_host(self, keep: Any) -> None:
        """Drop the least recently used CPU copies, of components neither on the device
        nor in ``keep``, until the copies fit ``host_budget_bytes``."""
        if self.host_budget_bytes is None:
            return
        for key in list(self.on_cpu):
            if sum(self.on_cpu.values()) <= self.host_budget_bytes:
                return
            if key not in self.resident and key not in keep:
                self._drop(key)

    def _drop(self, key: str) -> None:
        """Let ``key``'s CPU copy go: its module keeps its shapes, on ``meta``, until
        :meth:`_reload` reads it from the store again."""
        self._unregister(key)
        for module, name, is_param, t in self._kept.pop(key):
            placeholder = torch.empty(t.shape, dtype=t.dtype, device="meta")
            if is_param:  # (a CPU parameter's data cannot become meta: a new Parameter)
                grad = getattr(module, name).requires_grad
                module._parameters[name] = torch.nn.Parameter(placeholder, requires_grad=grad)
            else:
                setattr(module, name, placeholder)
        del self._flat[key], self._segments[key], self.on_cpu[key]

    def _reload(self, key: str) -> None:
        """Read ``key``'s component from the store again (diffusers' or transformers'
        ``from_pretrained`` of its folder) into a CPU copy the peer owns."""
        folder, cls, dtype = self._source[key]
        fresh = cls.from_pretrained(folder, torch_dtype=dtype)
        # by qualified name, buffers that are not saved (position ids) included
        got = dict(fresh.named_parameters(remove_duplicate=False))
        got.update(fresh.named_buffers(remove_duplicate=False))
        ours = self.modules[key]
        for qual, m in ours.named_modules(remove_duplicate=False):
            for n, p in list(m._parameters.items()):
                if p is not None:
                    t = got[f"{qual}.{n}" if qual else n]
                    m._parameters[n] = torch.nn.Parameter(t.data, requires_grad=p.requires_grad)
            for n, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[n] = got[f"{qual}.{n}" if qual else n]
        del fresh, got
        self._own(key, ours)

    def _register(self, key: str) -> None:
        # Our own buffers, registered: torch's pin_memory() copies into its caching host
        # allocator, which rounds each block up to a power of two (a 23.8 GB FLUX
        # transformer would take 32 GiB of locked memory).
        flat = self._flat[key]
        if key in self._registered or flat.numel() == 0:
            return
        base, done = flat.data_ptr(), []
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):
            for at, size in self._segments[key]:
                rc = int(cudart.cudaHostRegister(base + at, size, 0))
                if rc != 0:
                    for d in done:  # none left half-registered
                        cudart.cudaHostUnregister(base + d)
                    raise DeviceError(
                        f"cudaHostRegister refused {size} bytes of {key}'s CPU copy "
                        f"(cudaError {rc}); check the locked-memory limit (ulimit -l) and "
                        "free host memory, or use pinned=False"
                    )
                done.append(at)
        self._registered.add(key)

    def _unregister(self, key: str) -> None:
        if key not in self._registered:
            return
        base, cudart = self._flat[key].data_ptr(), torch.cuda.cudart()
        with torch.cuda.device(self.device):
            for at, _ in self._segments[key]:
                rc = int(cudart.cudaHostUnregister(base + at))
                if rc != 0:
                    raise DeviceError(
                        f"cudaHostUnregister failed for {key}'s CPU copy (cudaError {rc})"
                    )
        self._registered.discard(key)

    def set_pinned(self, flag: bool) -> None:
        """Page-lock (``True``) or release (``False``) every CPU copy; :attr:`mode`
        follows. Costs the registration of every buffer, not a copy."""
        self._check_pinnable(flag)
        if self._state == "closed":
            raise ClosedError("LruPeer.set_pinned() after close(); make a new peer")
        # no copy may still read a buffer whose registration changes (moves are async
        # when pinned); a switch ends synced, but say it here, where it matters
        sync(self.device)
        for key in self._flat:
            if flag:
                self._register(key)
            else:
                self._unregister(key)
        self._pinned = flag

    def resident_bytes(self) -> int:
        """Weight bytes of the components on the device now."""
        return sum(self.resident.values())

    def switch(self, name: str) -> float:
        """Make every component of pipeline ``name`` resident, evicting the least recently
        used others; the seconds it took, synchronised (0.0 when nothing moved)."""
        if self._state != "loaded":
            raise ClosedError(f"LruPeer.switch({name!r}) while {self._state}; load() first")
        if name not in self.uses:
            known = sorted(self.uses)
            raise UnknownModel(
                f"no pipeline {name!r}; this peer serves {known}",
                name=name,
                available=known,
                close=difflib.get_close_matches(name, known),
            )
        need = self.uses[name]
        record: dict[str, Any] = {"model": name, "moved": {}, "evicted": [], "from_store": {}}
        missing = [k for k in need if k not in self.resident]
        seconds = 0.0
        if missing:
            sync(self.device)
            t = time.perf_counter()
            for key in missing:
                if key not in self._flat:  # its CPU copy was dropped: read it again
                    self._reload(key)
                    record["from_store"][key] = self.component_bytes[key]
                size = self.component_bytes[key]
                while self.resident_bytes() + size > self.budget_bytes:
                    # load() refused a pipeline larger than the budget, so a victim remains
                    victim = next(k for k in self.resident if k not in need)
                    point_back(self._kept[victim])  # the device copy freed to the cache
                    del self.resident[victim]
                    record["evicted"].append(victim)
                try:
                    # pinned: async DMA from our registered buffer, which lives until close
                    # and is never written after load; the sync below ends every copy
                    self.modules[key].to(self.device, non_blocking=self._pinned)
                except BaseException:
                    point_back(self._kept[key])  # not half on the device
                    raise
                self.resident[key] = size
                record["moved"][key] = size
            sync(self.device)
            seconds = time.perf_counter() - t
        for key in need:
            self.resident.move_to_end(key)
            self.on_cpu.move_to_end(key)
        self._trim_host(keep=need)
        record["moved_bytes"] = sum(record["moved"].values())
        record["switch_s"] = seconds
        self.switches.append(record)
        placed = torch.device(self.pipes[name]._execution_device)
        if placed != self.device:
            raise InternalError(f"{name!r} runs on {placed} after a switch to {self.device}")
        return seconds

    def generate(self, job: PeerJob, arrived: float) -> tuple[bytes, dict[str, Any]]:
        """Run ``job`` as plain diffusers would; its PNG and ``{"order", "phases"}``
        (``queue``, ``switch``, ``run``, ``total``: seconds, ``arrived`` a perf_counter)."""
        start = time.perf_counter()
        switch_s = self.switch(job.model)
        self.order += 1
        png, info = run_job(
            self.pipes[job.model], job, self.device, arrived, start, switch_s, self.order
        )
        last = self.switches[-1]
        moved = [
            {"role": k, "tier": "disk" if k in last["from_store"] else "host", "nbytes": n}
            for k, n in last["moved"].items()
        ]
        return png, {**info, "components": moved}

    def close(self) -> None:
        """Point every module back at its CPU copy, release the pins and drop everything.
        Safe to call twice."""
        if self._state == "closed":
            return
        self._state = "closed"
        sync(self.device)  # no copy still reads a buffer about to be unregistered
        for kept in self._kept.values():
            point_back(kept)
        self.resident.clear()
        try:
            for key in list(self._registered):
                self._unregister(key)  # before the memory goes back to the allocator
        finally:
            self.pipes.clear()
            self.modules.clear()
            self._kept.clear()
            self._flat.clear()
            self._by_identity.clear()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            trim_heap()

    def __enter__(self) -> LruPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _alias(t: torch.Tensor) -> tuple:
    """What makes two tensors the same bytes (a tied weight under two names)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _identities(folder: str, cls: tuple, dtype: torch.dtype) -> list[tuple]:
    """The keys under which a component folder is the same as another: its resolved path,
    and (when it has safetensors files) its files' names, sizes and edges with its config.
    Both carry the class and the dtype it loads in: equal bytes loaded as another class
    or cast to another dtype are another module."""
    out: list[tuple] = [("path", os.path.realpath(folder), cls, dtype)]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if files:
        sig = []
        for name in files:
            path = os.path.join(folder, name)
            size = os.path.getsize(path)
            h = hashlib.blake2b(digest_size=16)
            with open(path, "rb") as f:
                h.update(f.read(_EDGE))
                f.seek(max(0, size - _EDGE))
                h.update(f.read(_EDGE))
            sig.append((name, size, h.hexdigest()))
        config = os.path.join(folder, "config.json")
        conf = b""
        if os.path.exists(config):
            with open(config, "rb") as f:
                conf = f.read()
        out.append(("content", tuple(sig), hashlib.blake2b(conf).hexdigest(), cls, dtype))
    return out
