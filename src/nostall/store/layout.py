"""Resolve what a user points at into the safetensors files that make it up.

Three shapes of checkpoint exist in the wild, and all stay as they are on disk (no
conversion step):

* one ``.safetensors`` file;
* a sharded checkpoint: ``*.safetensors.index.json`` whose ``weight_map`` names,
  for every tensor, the shard file (in the index's folder or below it) that holds it;
* a diffusers / transformers component folder: ``config.json`` beside
  ``diffusion_pytorch_model.safetensors`` or ``model.safetensors`` (either may be
  sharded through its index), optionally with a variant such as
  ``diffusion_pytorch_model.fp16.safetensors``.

A sharded variant's index is ``<stem>.safetensors.index.<variant>.json`` with shards
``<stem>.<variant>-00001-of-00002.safetensors``: both libraries' ``_add_variant``
put the variant before the last suffix (diffusers 0.42, transformers 5.24).

A component folder whose file uses the model's original key names (the community's Wan
single files, ComfyUI's scaled FP8) is read under the diffusers class's names:
:mod:`nostall.store.names`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from nostall.errors import ArgumentError, CheckpointError, ReadError
from nostall.store.base import REMOTE_SUFFIX
from nostall.store.files import open_regular, parse_json
from nostall.store.header import FileIndex, TensorEntry, read_header

__all__ = ["Checkpoint", "resolve"]

# The weight file stems diffusers and transformers write, in the order we prefer.
_STEMS = ("diffusion_pytorch_model", "model")


def _index_names(stem: str, variant: str | None) -> tuple[str, ...]:
    """The names a stem's shard index may have, newest convention first."""
    if variant is None:
        return (f"{stem}.safetensors.index.json",)
    return (
        f"{stem}.safetensors.index.{variant}.json",  # save_pretrained today
        f"{stem}.{variant}.safetensors.index.json",  # older writers
        # diffusers' legacy name, which its _fetch_index_file_legacy still reads
        f"{stem}.safetensors.{variant}.index.json",
    )


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: its files and where each tensor lives.

    Attributes:
        source: what the user passed (file, index or folder).
        files: the safetensors files, each with its validated header, in a stable order.
        folder: the component folder holding ``config.json``, when there is one.
        layout: the names the files were read in: ``"diffusers"``, or what
            :func:`~nostall.store.names.diffusers_names` renamed from.
    """

    source: str
    files: tuple[FileIndex, ...]
    folder: str | None = None
    layout: str = "diffusers"

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


def resolve(
    path: str | os.PathLike,
    *,
    variant: str | None = None,
    allow_outside: bool = False,
) -> Checkpoint:
    """Find and validate the files of the checkpoint at ``path``.

    Args:
        path: a ``.safetensors`` file, a ``.safetensors.index.json`` or a component folder.
        variant: in a folder, pick ``<stem>.<variant>.safetensors``, or the sharded
            variant's index ``<stem>.safetensors.index.<variant>.json`` (the older
            ``<stem>.<variant>.safetensors.index.json`` is read too).
        allow_outside: let a shard index name shard files outside its own folder
            (``"../x.safetensors"``, an absolute path). Off by default, so that an
            index from an untrusted download reads only files beside it (subfolders
            are always allowed).

    Raises :class:`~nostall.CheckpointError` naming the file for anything missing,
    malformed or not a regular file, :class:`~nostall.ReadError` when the OS refuses
    a read, :class:`~nostall.ArgumentError` for an unusable ``variant``.

    >>> ckpt = resolve("flux/transformer")  # doctest: +SKIP
    >>> len(ckpt.files), ckpt.nbytes  # doctest: +SKIP
    (3, 23782131712)
    """
    source = os.fspath(path)
    if variant is not None and (
        not isinstance(variant, str) or not variant or "/" in variant or os.sep in variant
    ):
        raise ArgumentError(
            f"variant={variant!r} must be a non-empty file name part such as 'fp16', "
            "without path separators"
        )
    if os.path.isdir(source):
        return _resolve_folder(source, variant, allow_outside)
    if not _present(source):
        raise CheckpointError(
            "no such file or folder; pass a .safetensors file, a .safetensors.index.json "
            "or a folder with config.json",
            path=source,
        )
    if source.endswith(".json"):
        return Checkpoint(source, _resolve_index(source, allow_outside), folder=None)
    from nostall.store.names import diffusers_names

    # A file beside its config.json is read under the config's class's names too.
    files, layout = diffusers_names((read_header(source),), os.path.dirname(source) or ".")
    return Checkpoint(source, files, folder=None, layout=layout)


def _resolve_folder(folder: str, variant: str | None, allow_outside: bool) -> Checkpoint:
    # exists(), not isfile(): a FIFO or device under a weight file's name is refused
    # by name (open_regular), instead of being skipped as if absent.
    suffix = f".{variant}.safetensors" if variant else ".safetensors"
    for stem in _STEMS:
        for name in _index_names(stem, variant):
            index = os.path.join(folder, name)
            if os.path.exists(index):
                return _component(folder, _resolve_index(index, allow_outside))
        single = os.path.join(folder, stem + suffix)
        if _present(single):
            return _component(folder, (read_header(single),))
    try:
        listing = os.listdir(folder)
    except OSError as e:
        raise ReadError(
            f"cannot list the folder: {e.strerror or e}; check that this process may read it",
            path=folder,
        ) from e
    # A mirror's stub (<name>.safetensors.remote) stands for a weight file not on disk.
    others = sorted(
        {n.removesuffix(REMOTE_SUFFIX) for n in listing if n.endswith(".safetensors")}
        | {
            n.removesuffix(REMOTE_SUFFIX)
            for n in listing
            if n.endswith(".safetensors" + REMOTE_SUFFIX)
        }
    )
    if len(others) == 1 and variant is None:
        return _component(folder, (read_header(os.path.join(folder, others[0])),))
    wanted = " or ".join(s + suffix for s in _STEMS)
    index = _index_names("<stem>", variant)[0]
    found = f"; it holds {', '.join(others)}" if others else ""
    raise CheckpointError(
        f"no {wanted} (or its index {index}) in this folder{found}; pass the file itself "
        "or the right variant=",
        path=folder,
    )


def _component(folder: str, files: tuple[FileIndex, ...]) -> Checkpoint:
    """A component folder's checkpoint, its entries under the diffusers class's names."""
    from nostall.store.names import diffusers_names

    files, layout = diffusers_names(files, folder)
    return Checkpoint(folder, files, folder=folder, layout=layout)


def _resolve_index(index_path: str, allow_outside: bool) -> tuple[FileIndex, ...]:
    try:
        with open_regular(index_path, what="shard index") as f:
            raw = f.read()
    except OSError as e:
        raise ReadError(f"cannot read the shard index: {e.strerror or e}", path=index_path) from e
    doc = parse_json(
        raw,
        what="shard index",
        fix="the download is corrupt: fetch the .index.json again",
        path=index_path,
    )
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
    outside = [s for s in shard_names if _is_outside(s)]
    if outside and not allow_outside:
        raise CheckpointError(
            f"{len(outside)} shard file(s) named in the index lie outside its folder "
            f"{folder or '.'}: {', '.join(map(repr, outside))}; a downloaded index names "
            "shards beside it, so this one may be crafted to read other files. Move the "
            "shards beside the index, or pass allow_outside=True if you trust it",
            path=index_path,
        )
    missing = [s for s in shard_names if not _present(os.path.join(folder, s))]
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


def _present(path: str) -> bool:
    """The file is there, or a mirror's stub stands for it (its bytes are remote)."""
    return os.path.exists(path) or (
        path.endswith(".safetensors") and os.path.isfile(path + REMOTE_SUFFIX)
    )


def _is_outside(shard: str) -> bool:
    """Whether a weight_map entry leaves the index's folder: absolute, or up through ``..``.

    Judged on the text alone: a symlink inside the folder is the owner's choice.
    """
    if os.path.isabs(shard) or os.path.splitdrive(shard)[0]:
        return True
    parts = os.path.normpath(shard).replace(os.sep, "/").split("/")
    return parts[0] == ".."
