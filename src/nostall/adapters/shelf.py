"""Which LoRA a name means, and the LoRAs read so far.

A name is a file ``<store>/loras/<name>.safetensors`` (or a path to a ``.safetensors``
file); an unknown name is :class:`~nostall.errors.UnknownModel` listing the names that
look like it. A LoRA is read once per file identity (device, inode, size, modification
time) and pipeline class: a file replaced on disk is read again, as checkpoints are.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from nostall.adapters.lora import Lora, read_lora
from nostall.errors import ArgumentError, UnknownModel

__all__ = ["MAX_WEIGHT", "Shelf", "lora_bytes", "lora_weights"]

MAX_WEIGHT = 10.0  # a LoRA weight beyond this is a mistake, not a style


def lora_weights(loras: Mapping[str, float] | Iterable[Any] | None) -> list[tuple[str, float]]:
    """``{"name": weight}`` or ``[(name, weight)]`` as a checked list (names in order,
    each once; weights finite, |weight| <= :data:`MAX_WEIGHT`).

    >>> lora_weights({"ghibli": 0.8, "detail": 0.4})
    [('ghibli', 0.8), ('detail', 0.4)]
    """
    if loras is None:
        return []
    items = list(loras.items()) if isinstance(loras, Mapping) else list(loras)
    out: list[tuple[str, float]] = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ArgumentError(f"loras: {item!r} is not a (name, weight) pair", field="loras")
        name, w = item
        if not isinstance(name, (str, os.PathLike)) or not os.fspath(name):
            raise ArgumentError(f"loras: {name!r} is not a LoRA name", field="loras")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ArgumentError(
                f"loras: weight {w!r} of {name!r} must be a finite number",
                field="loras",
                allowed=f"[-{MAX_WEIGHT:g}, {MAX_WEIGHT:g}]",
            )
        if abs(w) > MAX_WEIGHT:
            raise ArgumentError(
                f"loras: weight {w!r} of {name!r} is beyond ±{MAX_WEIGHT:g}",
                field="loras",
                allowed=f"[-{MAX_WEIGHT:g}, {MAX_WEIGHT:g}]",
            )
        if any(os.fspath(name) == n for n, _ in out):
            raise ArgumentError(f"loras: {name!r} is named twice", field="loras")
        out.append((os.fspath(name), float(w)))
    return out


def _unet_config(folder: str | None) -> dict[str, Any] | None:
    if folder is None:
        return None
    path = os.path.join(folder, "unet", "config.json")
    if not os.path.isfile(path):
        return None
    import json

    from diffusers.configuration_utils import FrozenDict  # what unet.config is

    with open(path) as f:
        return FrozenDict(json.load(f))


def lora_bytes(folder: str | os.PathLike | None) -> int:
    """The bytes of the ``.safetensors`` files directly under ``folder`` (0 if none)."""
    if folder is None or not os.path.isdir(folder):
        return 0
    total = 0
    for entry in os.scandir(folder):
        if entry.name.endswith(".safetensors") and entry.is_file():
            total += entry.stat().st_size
    return total


_ALIGN = 512  # each factor starts on a 512-byte boundary of its block (any dtype's view)


def _factors(lora: Lora) -> list[Any]:
    return [t for x in lora.layers for t in (x.down, x.up, x.bias) if t is not None]


def _packed_bytes(lora: Lora) -> int:
    """The pool block ``lora``'s factors take (:func:`_packed`)."""
    from nostall.memory.pool import size_class

    return size_class(max(1, sum(-(-t.nbytes // _ALIGN) * _ALIGN for t in _factors(lora))))


def _packed(lora: Lora, pool: Any) -> Lora | None:
    """``lora`` with every factor copied into one block of ``pool``, or ``None`` when the
    pool has no room. The block stays held while the returned object lives (a finalizer
    releases it): whoever holds the LoRA may read its factors, however the shelf evicts."""
    import dataclasses
    import weakref

    import torch

    from nostall.errors import PoolExhausted

    tensors = _factors(lora)
    offsets, n = [], 0
    for t in tensors:
        offsets.append(n)
        n += -(-t.nbytes // _ALIGN) * _ALIGN
    try:
        block = pool.allocate(max(n, 1))
    except PoolExhausted:
        return None
    flat = block.tensor
    views = {}
    for t, off in zip(tensors, offsets, strict=True):
        v = flat[off : off + t.nbytes].view(t.dtype).view(t.shape)
        v.copy_(t)
        views[id(t)] = v

    def put(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else views[id(t)]

    layers = tuple(
        dataclasses.replace(x, down=put(x.down), up=put(x.up), bias=put(x.bias))
        for x in lora.layers
    )
    out = dataclasses.replace(lora, layers=layers, flat=flat[:n])
    weakref.finalize(out, block.release)
    return out


class Shelf:
    """LoRAs by name under ``folder`` (``<store>/loras``; ``None``: paths only), read
    once per file identity and pipeline class, and kept, least recently used dropped
    first, in a pool of ``budget`` bytes of host memory (page-locked for a CUDA
    ``device``: a fuse copies the factors to the GPU at link speed). A LoRA that finds
    no room there is read each time it is asked for. :meth:`close` gives the pool back.
    """

    def __init__(
        self,
        folder: str | os.PathLike | None,
        budget: int = 0,
        *,
        device: Any = "cpu",
    ):
        import torch

        self.folder = os.fspath(folder) if folder is not None else None
        self.budget = budget
        self.device = torch.device(device)
        self._pool: Any = None  # made at the first read: no pinning for a cache without LoRAs
        self._read: OrderedDict[tuple, Lora] = OrderedDict()
        self._lock = threading.Lock()

    def nbytes(self) -> int:
        """Bytes of the LoRAs kept now."""
        with self._lock:
            return sum(x.nbytes for x in self._read.values())

    def close(self) -> None:
        """Drop the LoRAs kept and give back their pool; a LoRA still held elsewhere
        keeps its block (and the pool) until it is dropped."""
        from nostall.errors import BusyError

        with self._lock:
            self._read.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            # a LoRA handed out may still view it: then it goes with the last one
            with contextlib.suppress(BusyError):
                pool.close(timeout=0)

    def names(self) -> list[str]:
        """The LoRA names under the folder."""
        if self.folder is None or not os.path.isdir(self.folder):
            return []
        return sorted(
            f.removesuffix(".safetensors")
            for f in os.listdir(self.folder)
            if f.endswith(".safetensors")
        )

    def path(self, name: str) -> str:
        """The file ``name`` means."""
        if name.endswith(".safetensors") or os.sep in name:
            if os.path.isfile(name):
                return os.path.abspath(name)
        elif self.folder is not None:
            p = os.path.join(self.folder, f"{name}.safetensors")
            if os.path.isfile(p):
                return p
        names = self.names()
        close = difflib.get_close_matches(name, names)
        where = self.folder or "(no loras folder: give a path)"
        raise UnknownModel(
            f"no LoRA {name!r} in {where}"
            + (f"; did you mean {', '.join(close)}?" if close else "")
            + (f" (there: {', '.join(names[:20])})" if names else ""),
            name=name,
            available=names,
            close=close,
        )

    def get(self, name: str, pipeline_class: str, pipeline_folder: str | None = None) -> Lora:
        """The LoRA ``name`` for ``pipeline_class``, read now if its file is new or changed
        (``pipeline_folder``: the base's, whose UNet config kohya names need)."""
        path = self.path(name)
        st = os.stat(path)
        key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, pipeline_class)
        with self._lock:
            got = self._read.get(key)
            if got is not None:
                self._read.move_to_end(key)
                return got
        lora = read_lora(path, pipeline_class, name=name, unet_config=_unet_config(pipeline_folder))
        if not 0 < _packed_bytes(lora) <= self.budget:
            return lora  # read each time: it could never be kept
        with self._lock:
            for k in [k for k in self._read if k[0] == path and k[5] == pipeline_class]:
                del self._read[k]  # an older version of the same file
            if self._pool is None:
                from nostall.memory.pool import PinnedPool

                cuda = self.device.type == "cuda"
                self._pool = PinnedPool(
                    self.budget, evict=False, pin=cuda, device=self.device if cuda else None
                )
            # The least recently used go until it fits; a LoRA dropped here that a fuse
            # still reads keeps its block until that caller lets go of it.
            while (kept := _packed(lora, self._pool)) is None and self._read:
                self._read.popitem(last=False)
            if kept is None:
                return lora
            self._read[key] = kept
        return kept
