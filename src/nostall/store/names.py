"""Checkpoints whose tensor names are not the diffusers class's, read under its names.

The community ships some models as single files in the model's original key layout:
ComfyUI's Wan 2.1 / 2.2 transformers (``wan2.1_t2v_14B_fp8_scaled.safetensors``,
``wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors``), often in ComfyUI's scaled FP8: ``<layer>.weight`` in
e4m3, ``<layer>.scale_weight`` (one float32 per tensor), ``<layer>.scale_input`` and a
``scaled_fp8`` marker. Put such a file in a component folder beside the diffusers
``config.json`` (the one diffusers' ``-Diffusers`` repository has for that component)
and nostall reads it as it is: the entries are renamed, nothing is converted or copied.

* **Which names**: diffusers' own single-file converter for the class
  (``convert_wan_transformer_to_diffusers``) is run over
  stand-ins for the tensors, so the mapping is diffusers' and follows its releases. A
  converter that does anything but rename (splits, concatenations: FLUX's original
  layout, Wan-Animate's) is refused, naming the fix.
* **ComfyUI's scale names** become nostall's (``<layer>.weight_scale``,
  ``<layer>.input_scale``), in any component (UMT5 too), where the file holds FP8.

Each renamed entry keeps the name it has in the file (:attr:`TensorEntry.stored`), for
readers that open the file by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re

from nostall.errors import CheckpointError
from nostall.store.folders import read_json
from nostall.store.header import FileIndex, TensorEntry

__all__ = ["NATIVE_LAYOUTS", "diffusers_names"]

# diffusers class -> (its single-file converter in diffusers.loaders.single_file_utils,
# a pattern only the original layout's names match).
NATIVE_LAYOUTS: dict[str, tuple[str, re.Pattern]] = {
    "WanTransformer3DModel": (
        "convert_wan_transformer_to_diffusers",
        re.compile(r"^(model\.diffusion_model\.)?blocks\.\d+\.(self_attn\.|cross_attn\.|ffn\.\d)"),
    ),
}
_COMFY_SCALES = ((".scale_weight", ".weight_scale"), (".scale_input", ".input_scale"))


class _Stand:
    """Stands for one tensor while a converter renames: any tensor operation on it fails."""

    __slots__ = ("entry",)

    def __init__(self, entry: TensorEntry):
        self.entry = entry


def diffusers_names(files: tuple[FileIndex, ...], folder: str) -> tuple[tuple[FileIndex, ...], str]:
    """``files`` with their entries under the names the folder's diffusers class has, and
    the layout they were read in (``"diffusers"`` when nothing was renamed)."""
    names = [e.name for f in files for e in f.tensors]
    renames: dict[str, str] = {}
    layouts = []
    native = _native_layout(names, folder)
    if native is not None:
        renames = _converted(files, folder, *native)
        layouts.append(f"the original {native[0]} layout")
    fp8 = any(e.dtype.startswith("F8") for f in files for e in f.tensors)
    if fp8 and any(n.endswith(_COMFY_SCALES[0][0]) for n in names):
        for n in names:
            new = renames.get(n, n)
            for theirs, ours in _COMFY_SCALES:
                if new.endswith(theirs):
                    renames[n] = new[: -len(theirs)] + ours
        layouts.append("ComfyUI's scaled FP8")
    if not renames:
        return files, "diffusers"
    out = []
    for f in files:
        tensors = tuple(
            dataclasses.replace(e, name=renames[e.name], stored=e.name) if e.name in renames else e
            for e in f.tensors
        )
        out.append(dataclasses.replace(f, tensors=tensors))
    seen: set[str] = set()
    for f in out:
        for e in f.tensors:
            if e.name in seen:
                raise CheckpointError(
                    f"two tensors are read as {e.name!r} once renamed from {' and '.join(layouts)}"
                    "; the file mixes layouts: save it again in one",
                    path=folder,
                    tensor=e.stored or e.name,
                )
            seen.add(e.name)
    return tuple(out), " and ".join(layouts)


def _native_layout(names: list[str], folder: str) -> tuple[str, str] | None:
    """``(class name, converter)`` where the names are a known original layout and the
    folder's config names that class."""
    candidates = [
        (cls, conv)
        for cls, (conv, pattern) in NATIVE_LAYOUTS.items()
        if any(map(pattern.match, names))
    ]
    config = os.path.join(folder, "config.json")
    if not candidates or not os.path.isfile(config):
        return None
    cls = read_json(config, "component config").get("_class_name")
    return next(((c, conv) for c, conv in candidates if c == cls), None)


def _converted(
    files: tuple[FileIndex, ...], folder: str, cls: str, converter: str
) -> dict[str, str]:
    """Old name -> new name, as diffusers' ``converter`` renames the tensors."""
    utils = importlib.import_module("diffusers.loaders.single_file_utils")
    stands = {e.name: _Stand(e) for f in files for e in f.tensors}
    try:
        out = getattr(utils, converter)(dict(stands))
    except (TypeError, AttributeError, IndexError, KeyError) as e:
        raise CheckpointError(
            f"diffusers' {converter} changes this {cls} checkpoint's tensors, not only their "
            f"names ({type(e).__name__}: {e}); nostall reads renamed layouts as they are. "
            f"Convert it once: {cls}.from_single_file(...).save_pretrained(folder)",
            path=folder,
        ) from None
    moved = {id(v): k for k, v in out.items() if isinstance(v, _Stand)}
    lost = [n for n, s in stands.items() if id(s) not in moved]
    alone = list(getattr(utils, converter)({lost[0]: stands[lost[0]]})) if lost else []
    if len(moved) == len(out) and len(alone) == 1 and alone[0] in out:
        # Two names became one (the later overwrote the earlier): the file mixes layouts.
        name, new = lost[0], alone[0]
        raise CheckpointError(
            f"two tensors are read as {new!r} once renamed from the original {cls} layout "
            f"({name!r} and another); the file mixes layouts: save it again in one",
            path=folder,
            tensor=name,
        )
    if len(moved) != len(out) or len(out) != len(stands):
        raise CheckpointError(
            f"diffusers' {converter} makes {len(out)} tensors of this checkpoint's "
            f"{len(stands)}, not a renaming; nostall reads renamed layouts as they are. "
            f"Convert it once: {cls}.from_single_file(...).save_pretrained(folder)",
            path=folder,
        )
    return {name: moved[id(s)] for name, s in stands.items() if moved[id(s)] != name}
