"""The store: diffusers pipeline folders by name, and their components by content.

A store is a folder of pipeline folders (each with ``model_index.json`` and one
folder per component), addressed by folder name, or a mapping ``name → folder``.
Nothing is converted or copied: the standard layout is read where it lies.

Every component gets a **digest** that identifies its content, so pipelines that
ship the same T5, CLIP or VAE share one copy in every tier of the cache:

* weights: the class, the config (minus the fields that name where it was saved),
  every safetensors header (names, dtypes, shapes, offsets, metadata) and file size,
  and 16 sampled 4 KiB blocks of each file's data. Headers alone cannot tell two
  fine-tunes of one architecture apart; the samples do, at the cost of 16 small
  reads per file.
* tokenizers, schedulers and other files: every file's bytes (they are small).

Components of one **architecture** (same class, config and tensor layout) can share
one module: switching between two FLUX fine-tunes copies weights into the resident
module instead of building another.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nostall.checkpoint import Checkpoint, resolve
from nostall.checkpoint.files import open_regular, parse_json
from nostall.errors import CheckpointError, ReadError, UnknownModel

__all__ = ["ComponentEntry", "PipelineEntry", "Store"]

INDEX = "model_index.json"
# Config fields that say where or with what a component was saved, not what it is.
_VOLATILE = {"_name_or_path", "_diffusers_version", "transformers_version", "_commit_hash"}
_SAMPLES = 16
_SAMPLE_BYTES = 4096
_MAX_FILE_DIGEST = 256 << 20  # files components bigger than this are hashed by size + samples


@dataclass(frozen=True)
class ComponentEntry:
    """One component of a pipeline folder.

    Attributes:
        role: its name in the pipeline (``"transformer"``, ``"text_encoder_2"``).
        library, class_name: what ``model_index.json`` says builds it.
        folder: its folder.
        weights: whether it is a module with safetensors weights (else files:
            a tokenizer, scheduler, image processor).
        digest: content identity (shared components have equal digests).
        arch: for weights, the identity of the architecture (class, config, layout).
        checkpoint: for weights, the validated safetensors files.
        nbytes: tensor bytes on disk (0 for files).
    """

    role: str
    library: str
    class_name: str
    folder: str
    weights: bool
    digest: str
    arch: str | None = None
    checkpoint: Checkpoint | None = field(default=None, repr=False, compare=False)
    nbytes: int = 0


@dataclass(frozen=True)
class PipelineEntry:
    """A pipeline folder: its class, components (``None`` where the index has none) and
    the other keys of ``model_index.json`` (pipeline options such as
    ``force_zeros_for_empty_prompt``)."""

    name: str
    folder: str
    class_name: str
    components: dict[str, ComponentEntry | None]
    config: dict[str, Any] = field(repr=False, compare=False)

    @property
    def weights(self) -> list[ComponentEntry]:
        return [c for c in self.components.values() if c is not None and c.weights]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.weights)


class Store:
    """Pipeline folders by name; entries are read (and digested) on first use.

    >>> store = Store("/models")  # doctest: +SKIP
    >>> store.names()  # doctest: +SKIP
    ['flux-dev', 'sdxl']
    >>> [c.role for c in store.entry("flux-dev").weights]  # doctest: +SKIP
    ['text_encoder', 'text_encoder_2', 'transformer', 'vae']
    """

    def __init__(
        self,
        models: str | os.PathLike | Mapping[str, str | os.PathLike],
        *,
        variant: str | None = None,
    ):
        self.variant = variant
        if isinstance(models, Mapping):
            self._folders = {str(k): os.fspath(v) for k, v in models.items()}
            for name, folder in self._folders.items():
                if not os.path.isfile(os.path.join(folder, INDEX)):
                    raise CheckpointError(
                        f"pipeline {name!r}: no {INDEX} here; point at a diffusers pipeline "
                        "folder (the one save_pretrained wrote)",
                        path=folder,
                    )
        else:
            root = os.fspath(models)
            if not os.path.isdir(root):
                raise CheckpointError(
                    "the model store is not a folder; pass a folder of pipeline folders or a "
                    "mapping of names to pipeline folders",
                    path=root,
                )
            try:
                names = sorted(os.listdir(root))
            except OSError as e:
                raise ReadError(f"cannot list the model store: {e.strerror or e}", path=root) from e
            self._folders = {
                n: os.path.join(root, n)
                for n in names
                if os.path.isfile(os.path.join(root, n, INDEX))
            }
        self._entries: dict[str, PipelineEntry] = {}

    def names(self) -> list[str]:
        return sorted(self._folders)

    def entry(self, name: str) -> PipelineEntry:
        """The pipeline called ``name``; :class:`~nostall.UnknownModel` lists the others."""
        cached = self._entries.get(name)
        if cached is not None:
            return cached
        folder = self._folders.get(name)
        if folder is None:
            names = self.names()
            close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            shown = ", ".join(map(repr, names[:20])) + (" …" if len(names) > 20 else "")
            raise UnknownModel(
                f"no pipeline {name!r} in the store{hint} It has {len(names)}: {shown or 'none'}",
                name=str(name),
                available=names,
                close=close,
            )
        entry = self._entries[name] = _scan(name, folder, self.variant)
        return entry


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open_regular(path, what=what) as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"no {os.path.basename(path)}; the {what} is missing", path=path
        ) from None
    except OSError as e:
        raise ReadError(f"cannot read the {what}: {e.strerror or e}", path=path) from e
    doc = parse_json(raw, what=what, fix="re-save it with save_pretrained", path=path)
    if not isinstance(doc, dict):
        raise CheckpointError(f"the {what} must be a JSON object", path=path)
    return doc


def _scan(name: str, folder: str, variant: str | None) -> PipelineEntry:
    index_path = os.path.join(folder, INDEX)
    index = _read_json(index_path, "pipeline index")
    class_name = index.get("_class_name")
    if not isinstance(class_name, str):
        raise CheckpointError(
            'model_index.json has no "_class_name" naming the pipeline class', path=index_path
        )
    components: dict[str, ComponentEntry | None] = {}
    config: dict[str, Any] = {}
    for key, value in index.items():
        if key.startswith("_"):
            continue
        if (
            isinstance(value, list)
            and len(value) == 2
            and all(v is None or isinstance(v, str) for v in value)
        ):
            library, cls = value
            if library is None or cls is None:
                components[key] = None
                continue
            components[key] = _component(
                key, library, cls, os.path.join(folder, key), variant, index_path
            )
        else:
            config[key] = value
    return PipelineEntry(name, folder, class_name, components, config)


def _component(
    role: str, library: str, cls: str, folder: str, variant: str | None, index_path: str
) -> ComponentEntry:
    if not os.path.isdir(folder):
        raise CheckpointError(
            f"model_index.json names component {role!r} ({library}.{cls}) but its folder is "
            "missing; the download is incomplete",
            path=folder,
        )
    if _is_module(library, cls):
        config_path = os.path.join(folder, "config.json")
        config = _read_json(config_path, f"{role} config")
        try:
            ckpt = resolve(folder, variant=variant)
        except CheckpointError as e:
            if any(n.endswith((".bin", ".pt", ".ckpt")) for n in _listdir(folder)):
                raise CheckpointError(
                    f"component {role!r} has no safetensors weights (only pickled .bin/.ckpt "
                    "files); nostall reads safetensors only: convert them with "
                    "save_pretrained(safe_serialization=True)",
                    path=folder,
                ) from e
            raise
        layout = hashlib.sha256()
        layout.update(f"{library}.{cls}\n".encode())
        layout.update(_canonical(config))
        for f in ckpt.files:
            for e in f.tensors:
                layout.update(f"{e.name}|{e.dtype}|{list(e.shape)}\n".encode())
        content = layout.copy()
        for f in ckpt.files:
            content.update(
                f"{f.file_size}|{f.data_start}|{json.dumps(f.metadata, sort_keys=True)}\n".encode()
            )
            for e in f.tensors:
                content.update(f"{e.name}@{e.begin}:{e.end}\n".encode())
            content.update(_samples(f.path, f.data_start, f.data_end))
        return ComponentEntry(
            role,
            library,
            cls,
            folder,
            True,
            content.hexdigest()[:32],
            layout.hexdigest()[:32],
            ckpt,
            ckpt.nbytes,
        )
    digest = hashlib.sha256(f"{library}.{cls}\n".encode())
    for rel in sorted(_walk(folder)):
        path = os.path.join(folder, rel)
        size = os.path.getsize(path)
        digest.update(f"{rel}|{size}\n".encode())
        if size <= _MAX_FILE_DIGEST:
            with open_regular(path, what=f"{role} file") as f:
                digest.update(f.read())
        else:
            digest.update(_samples(path, 0, size))
    return ComponentEntry(role, library, cls, folder, False, digest.hexdigest()[:32])


def _is_module(library: str, cls: str) -> bool:
    """Whether ``library.cls`` is a torch module (weights) rather than files."""
    import importlib

    import torch.nn as nn

    try:
        lib = importlib.import_module(library)
        obj = getattr(lib, cls)
    except (ImportError, AttributeError, RuntimeError):
        return False  # not importable: loaded (and failing clearly) as files later
    return isinstance(obj, type) and issubclass(obj, nn.Module)


def _canonical(config: dict[str, Any]) -> bytes:
    return json.dumps(
        {k: v for k, v in config.items() if k not in _VOLATILE}, sort_keys=True
    ).encode()


def _samples(path: str, start: int, end: int) -> bytes:
    """``_SAMPLES`` blocks spread evenly over ``[start, end)`` of the file."""
    span = end - start
    if span <= 0:
        return b""
    out = []
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ReadError(f"cannot open for digesting: {e.strerror or e}", path=path) from e
    try:
        for k in range(_SAMPLES):
            off = start + (span - min(span, _SAMPLE_BYTES)) * k // max(1, _SAMPLES - 1)
            out.append(os.pread(fd, min(_SAMPLE_BYTES, span), off))
    except OSError as e:
        raise ReadError(f"cannot read for digesting: {e.strerror or e}", path=path) from e
    finally:
        os.close(fd)
    return b"".join(out)


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError as e:
        raise ReadError(f"cannot list the folder: {e.strerror or e}", path=folder) from e


def _walk(folder: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(folder):
        for name in files:
            out.append(os.path.relpath(os.path.join(root, name), folder))
    return out
