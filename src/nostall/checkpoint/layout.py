"""Resolve what a user points at into the safetensors files that make it up.

Three shapes of checkpoint exist in the wild, and all stay in their standard
layout (no conversion step):

* one ``.safetensors`` file;
* a sharded checkpoint: ``*.safetensors.index.json`` whose ``weight_map`` names,
  for every tensor, the shard file (in the same folder) that holds it;
* a diffusers / transformers component folder: ``config.json`` beside
  ``diffusion_pytorch_model.safetensors`` or ``model.safetensors`` (either may be
  sharded through its ``.index.json``), optionally with a variant such as
  ``diffusion_pytorch_model.fp16.safetensors``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from nostall.checkpoint.header import FileIndex, TensorEntry, read_header
from nostall.errors import CheckpointError, ReadError

__all__ = ["Checkpoint", "resolve"]

# The weight file stems diffusers and transformers write, in the order we prefer.
_STEMS = ("diffusion_pytorch_model", "model")


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: its files and where each tensor lives.

    Attributes:
        source: what the user passed (file, index or folder).
        files: the safetensors files, each with its validated header, in a stable order.
        folder: the component folder holding ``config.json``, when there is one.
    """

    source: str
    files: tuple[FileIndex, ...]
    folder: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data across all files."""
        return sum(f.data_bytes for f in self.files)

    @property
    def num_tensors(self) -> int:
        return sum(len(f) for f in self.files)

    def entries(self) -> list[tuple[int, TensorEntry]]:
        """``(file number, entry)`` for every tensor, file by file in file order."""
        return [(i, e) for i, f in enumerate(self.files) for e in f.tensors]


def resolve(path: str | os.PathLike, *, variant: str | None = None) -> Checkpoint:
    """Find and validate the files of the checkpoint at ``path``.

    ``path`` is a ``.safetensors`` file, a ``.safetensors.index.json`` or a component
    folder. ``variant`` picks ``<stem>.<variant>.safetensors`` in a folder.

    >>> ckpt = resolve("flux/transformer")  # doctest: +SKIP
    >>> len(ckpt.files), ckpt.nbytes  # doctest: +SKIP
    (3, 23782131712)
    """
    source = os.fspath(path)
    if os.path.isdir(source):
        return _resolve_folder(source, variant)
    if not os.path.exists(source):
        raise CheckpointError(
            "no such file or folder; pass a .safetensors file, a .safetensors.index.json "
            "or a folder with config.json",
            path=source,
        )
    if source.endswith(".json"):
        return Checkpoint(source, _resolve_index(source), folder=None)
    return Checkpoint(source, (read_header(source),), folder=None)


def _resolve_folder(folder: str, variant: str | None) -> Checkpoint:
    suffix = f".{variant}.safetensors" if variant else ".safetensors"
    for stem in _STEMS:
        single = os.path.join(folder, stem + suffix)
        index = single + ".index.json"
        if os.path.isfile(index):
            return Checkpoint(folder, _resolve_index(index), folder=folder)
        if os.path.isfile(single):
            return Checkpoint(folder, (read_header(single),), folder=folder)
    others = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if len(others) == 1 and variant is None:
        return Checkpoint(folder, (read_header(os.path.join(folder, others[0])),), folder=folder)
    wanted = " or ".join(s + suffix for s in _STEMS)
    found = f"; it holds {', '.join(others)}" if others else ""
    raise CheckpointError(
        f"no {wanted} (or its .index.json) in this folder{found}; pass the file itself "
        "or the right variant=",
        path=folder,
    )


def _resolve_index(index_path: str) -> tuple[FileIndex, ...]:
    try:
        with open(index_path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ReadError(f"cannot read the shard index: {e.strerror or e}", path=index_path) from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"shard index is not valid JSON: {e}", path=index_path) from e
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            'shard index needs a "weight_map" object mapping tensor names to shard files',
            path=index_path,
        )
    folder = os.path.dirname(index_path)
    shard_names = sorted(set(weight_map.values()))
    missing = [s for s in shard_names if not os.path.isfile(os.path.join(folder, s))]
    if missing:
        raise CheckpointError(
            f"{len(missing)} shard file(s) named in the index are missing from {folder or '.'}: "
            f"{', '.join(missing)}; the download is incomplete",
            path=index_path,
        )
    files = tuple(read_header(os.path.join(folder, s)) for s in shard_names)
    by_shard = {s: {e.name for e in f.tensors} for s, f in zip(shard_names, files, strict=False)}
    for name, shard in weight_map.items():
        if name not in by_shard[shard]:
            raise CheckpointError(
                f"the index places this tensor in {shard}, which does not hold it; the index "
                "and the shards come from different checkpoints",
                path=index_path,
                tensor=name,
            )
    seen: dict[str, str] = {}
    for shard, names in by_shard.items():
        for name in names:
            if name in seen:
                raise CheckpointError(
                    f"tensor is stored twice, in {seen[name]} and {shard}",
                    path=index_path,
                    tensor=name,
                )
            seen[name] = shard
    return files
