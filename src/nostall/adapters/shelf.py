"""Which LoRA a name means, and the LoRAs read so far.

A name is a file ``<store>/loras/<name>.safetensors`` (or a path to a ``.safetensors``
file); an unknown name is :class:`~nostall.errors.UnknownModel` listing the names that
look like it. A LoRA is read once per file identity (device, inode, size, modification
time) and pipeline class: a file replaced on disk is read again, as checkpoints are.
"""

from __future__ import annotations

import difflib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from nostall.adapters.lora import Lora, read_lora
from nostall.errors import ArgumentError, UnknownModel

__all__ = ["MAX_WEIGHT", "Shelf", "lora_weights"]

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


def _pinned(lora: Lora) -> Lora:
    import dataclasses

    def pin(t):
        return None if t is None else t.pin_memory()

    layers = tuple(
        dataclasses.replace(x, down=pin(x.down), up=pin(x.up), bias=pin(x.bias))
        for x in lora.layers
    )
    return dataclasses.replace(lora, layers=layers)


class Shelf:
    """LoRAs by name under ``folder`` (``<store>/loras``; ``None``: paths only), read
    once per file identity and pipeline class; those read last are kept, up to
    ``budget`` bytes (a LoRA larger than the whole budget is read each time)."""

    def __init__(
        self, folder: str | os.PathLike | None, budget: int = 4 << 30, *, pin: bool = False
    ):
        self.folder = os.fspath(folder) if folder is not None else None
        self.budget = budget
        self.pin = pin  # page-locked factors: a fuse copies them to the GPU at link speed
        self._read: OrderedDict[tuple, Lora] = OrderedDict()
        self._lock = threading.Lock()

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
        where = self.folder or "(no loras folder: give a path)"
        raise UnknownModel(
            f"no LoRA {name!r} in {where}"
            + (f"; did you mean {', '.join(difflib.get_close_matches(name, names))}?"
               if difflib.get_close_matches(name, names) else "")
            + (f" (there: {', '.join(names[:20])})" if names else ""),
            name=name,
            available=names,
            close=difflib.get_close_matches(name, names),
        )  # fmt: skip

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
        if self.pin:
            lora = _pinned(lora)
        with self._lock:
            for k in [k for k in self._read if k[0] == path and k[5] == pipeline_class]:
                del self._read[k]  # an older version of the same file
            self._read[key] = lora
            while sum(x.nbytes for x in self._read.values()) > self.budget:
                self._read.popitem(last=False)
        return lora
