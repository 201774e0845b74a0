"""The store: diffusers pipeline folders by name, and their components by content.

A store is a folder of pipeline folders (each with ``model_index.json`` and one
folder per component), addressed by folder name, or a mapping ``name → folder``.
Nothing is converted or copied: the standard layout is read where it lies.

**Identified by content.** Every component carries a key (``digest``) that every tier
of the cache files it under. Two components share a key, and so one copy, only when
every byte that makes them up is equal:

* weights: the class, the config (minus the fields that name where it was saved),
  every safetensors header (tensor names, dtypes, shapes, offsets, metadata), and a
  digest of **every data byte** of every file (xxh3-128,
  :mod:`nostall.store.digest`). A file's data digest is computed by the reader
  threads the first time nostall reads the file (never as a pass of its own), and kept
  in the digest index (:mod:`nostall.store.digest_index`) under the file's identity, so a
  new process knows it without reading. Until all of a component's file digests are
  known, its key is made of its files' identities (device, inode, size, times): it
  shares nothing, except with itself reached through another path (a symlink, as in a
  Hugging Face cache). Once learned, the content decides: a later component with the
  same content is given the key this process first served that content under.
  A digest the index claims is not trusted with sharing: two sets of files share one
  copy only once this process has hashed both (:mod:`nostall.store.keys`), and a row
  the bytes contradict is logged and replaced.
* tokenizers, schedulers and other files: every file's bytes (they are small), read
  at scan time: the files at the folder's top level and one folder down (transformers
  reads ``additional_chat_templates/`` there), never further.

**Bounded.** A component folder holds a few files at its top level (config, weights,
their shard index; a tokenizer's files), and nothing is walked below that (but a
tokenizer's or scheduler's one folder down, above): a folder of
more than 1,000 entries, or files of more than 1 GiB where small files belong, is a
:class:`~nostall.CheckpointError` naming it (a link to the wrong folder, ``/usr/lib``),
refused in milliseconds. A component folder that is a link to another component's
folder (a shared VAE), and files that are links (a Hugging Face cache), are read as
they are.

**Never stale.** :meth:`Store.entry` re-stats every file and folder a pipeline was
scanned from (microseconds) and scans it again when one changed, so a file rewritten
in place under a running worker is served new, under a new key. A file that changes
while it is read is the loader's :class:`~nostall.FileChanged`.

Components of one **architecture** (same class, config and tensor layout) can share
one module: switching between two FLUX fine-tunes copies weights into the resident
module instead of building another.

**One per process.** Whatever serves a folder in a process (the model cache, the
embedding service, a fleet's router) takes one :class:`Store`, or asks
:meth:`Store.shared` for it by path: one scan and one identity per file, and one
answer to "which bytes are these".
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nostall.errors import (
    AdapterError,
    ArgumentError,
    CheckpointError,
    FileChanged,
    InternalError,
    ReadError,
    UnknownModel,
)
from nostall.store import Checkpoint, resolve
from nostall.store.base import REMOTE_SUFFIX
from nostall.store.digest import FileIdentity, hash_file_data
from nostall.store.digest_index import DigestIndex, default_cache_dir, local_source
from nostall.store.files import open_regular
from nostall.store.folders import (
    MAX_FILES_BYTES,
    Stamp,
    check_links,
    check_role,
    check_size,
    component_files,
    link_hint,
    listdir,
    read_json,
    stamp,
)
from nostall.store.keys import Keys, content_digest, identity_key

__all__ = ["CONTROLNET_PIPELINES", "ComponentEntry", "PipelineEntry", "Store"]

log = logging.getLogger(__name__)

# the diffusers pipeline a base pipeline becomes with a ControlNet attached
CONTROLNET_PIPELINES = {
    "StableDiffusionPipeline": "StableDiffusionControlNetPipeline",
    "StableDiffusionXLPipeline": "StableDiffusionXLControlNetPipeline",
    "StableDiffusion3Pipeline": "StableDiffusion3ControlNetPipeline",
    "FluxPipeline": "FluxControlNetPipeline",
}
# the ControlNet classes each base takes, and the config fields a ControlNet shares with
# its base's denoiser (another value: a ControlNet of another model)
_CONTROLNET_CLASSES = {
    "StableDiffusionPipeline": ("ControlNetModel",),
    "StableDiffusionXLPipeline": ("ControlNetModel", "ControlNetUnionModel"),
    "StableDiffusion3Pipeline": ("SD3ControlNetModel",),
    "FluxPipeline": ("FluxControlNetModel",),
}
_SHARED_FIELDS = (
    "in_channels",
    "cross_attention_dim",
    "block_out_channels",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "pooled_projection_dim",
    "addition_embed_type",
    "projection_class_embeddings_input_dim",
)

INDEX = "model_index.json"
# Config fields that say where or with what a component was saved, not what it is.
_VOLATILE = {"_name_or_path", "_diffusers_version", "transformers_version", "_commit_hash"}


@dataclass(frozen=True)
class ComponentEntry:
    """One component of a pipeline folder.

    Attributes:
        role: its name in the pipeline (``"transformer"``, ``"text_encoder_2"``).
        library, class_name: what ``model_index.json`` says builds it.
        folder: its folder.
        weights: whether it is a module with safetensors weights (else files:
            a tokenizer, scheduler, image processor).
        digest: the key every tier of the cache files it under: equal keys, equal bytes
            (see the module doc).
        arch: for weights, the identity of the architecture (class, config, layout).
        checkpoint: for weights, the validated safetensors files.
        nbytes: tensor bytes on disk (0 for files).
        content: the content digest once every byte's digest is known, hashed by this
            process or claimed by the digest index (``None`` until the first read of a
            weights component whose files the index did not know). A claim is served
            under a key other files share only once proven (:mod:`nostall.store.keys`).
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
    content: str | None = None
    stamps: tuple[Stamp, ...] = field(default=(), repr=False, compare=False)
    config_key: bytes = field(default=b"", repr=False, compare=False)  # canonical config

    @property
    def exact(self) -> bool:
        """Whether its content digest is known (else a read will learn it)."""
        return self.content is not None


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
    stamps: tuple[Stamp, ...] = field(default=(), repr=False, compare=False)

    @property
    def weights(self) -> list[ComponentEntry]:
        return [c for c in self.components.values() if c is not None and c.weights]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.weights)

    def distinct_weights(self, without: frozenset[str] = frozenset()) -> list[ComponentEntry]:
        """The weights components but the roles in ``without``, one per digest;
        :class:`~nostall.ArgumentError` names a role in ``without`` that is not one."""
        roles = [c.role for c in self.weights]
        unknown = sorted(frozenset(without) - set(roles))
        if unknown:
            raise ArgumentError(
                f"without={unknown}: pipeline {self.name!r} has no weights component of that "
                f"name; it has {roles}"
            )
        return list({c.digest: c for c in self.weights if c.role not in without}.values())


class Store:
    """Pipeline folders by name; entries are scanned on first use and re-checked on each.

    Args:
        models: a folder of pipeline folders, or a mapping ``name → pipeline folder``,
            or an ``s3://bucket/prefix`` holding pipeline folders (mirrored under
            ``cache_dir``: :func:`~nostall.store.digest_index.local_source`).
        variant: weights variant (``"fp16"``) in every component folder.
        cache_dir: where the digest index lives (default: ``$NOSTALL_CACHE_DIR``,
            ``$XDG_CACHE_HOME/nostall`` or ``~/.cache/nostall``; ``False``: in memory).

    ``Store(...)`` always scans anew; :meth:`Store.shared` gives the one this process
    already has for the same folder, variant and index (``key``).

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
        cache_dir: str | os.PathLike | bool | None = None,
    ):
        self.variant = variant
        self.root: str | None = None  # the folder of pipeline folders, when given one
        self._left_out: dict[str, str] = {}  # folders of the root that are no pipeline: why
        self.source = models if isinstance(models, str) else None  # an s3:// URL, kept
        models = local_source(models, cache_dir)
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
            root = self.root = os.fspath(models)
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
            self._left_out = {
                n: why
                for n in names
                if n not in self._folders and (why := _not_a_pipeline(os.path.join(root, n)))
            }
        self.index = DigestIndex(cache_dir)
        self.key = _share_key(models, variant, cache_dir)
        self._entries: dict[str, PipelineEntry] = {}
        self._attached: dict[str, tuple[str, str]] = {}  # name -> (base, controlnet folder)
        self._keys = Keys()  # which key each component is served under, and its proof
        self._lock = threading.RLock()

    @classmethod
    def shared(
        cls,
        models: str | os.PathLike | Mapping[str, str | os.PathLike] | Store,
        *,
        variant: str | None = None,
        cache_dir: str | os.PathLike | bool | None = None,
    ) -> Store:
        """The store of ``models`` that this process already has, else a new one.

        Stores are shared by the real path of the folder (or of every folder of a
        mapping), the variant and the digest index's folder. The registry holds them
        weakly: a store lives as long as something that uses it (a cache, a service)
        does, and a later call after the last user is gone scans afresh (and sees
        pipeline folders added since). A :class:`Store` passed in is returned as it
        is, if ``variant`` and ``cache_dir`` agree with it.

        >>> cache_store = Store.shared("/models")  # doctest: +SKIP
        >>> Store.shared("/models/../models") is cache_store  # doctest: +SKIP
        True
        """
        if isinstance(models, Store):
            models.check_options(variant=variant, cache_dir=cache_dir)
            return models
        key = _share_key(models, variant, cache_dir)
        with _SHARED_LOCK:
            store = _SHARED.get(key)
            if store is None:
                store = _SHARED[key] = cls(models, variant=variant, cache_dir=cache_dir)
            return store

    def check_options(
        self, *, variant: str | None = None, cache_dir: str | os.PathLike | bool | None = None
    ) -> None:
        """Raise :class:`~nostall.ArgumentError` when ``variant`` or ``cache_dir`` (given,
        not ``None``) differ from this store's: a store passed on carries its own."""
        if variant is not None and variant != self.variant:
            raise ArgumentError(
                f"variant={variant!r}, but the Store passed reads variant {self.variant!r}; "
                "give the variant to Store(...) and leave it out here"
            )
        if cache_dir is not None and _index_key(cache_dir) != self.key[2]:
            raise ArgumentError(
                f"cache_dir={cache_dir!r}, but the Store passed keeps its digest index in "
                f"{self.key[2]!r}; give cache_dir to Store(...) and leave it out here"
            )

    def names(self) -> list[str]:
        return sorted(self._folders)

    def with_controlnet(self, base: str, controlnet: str | os.PathLike, label: str) -> str:
        """The name (``base+label``) of pipeline ``base`` with the ControlNet in folder
        ``controlnet`` attached: diffusers' ControlNet pipeline class for ``base``'s,
        ``base``'s components plus ``controlnet``; an :meth:`entry` like any other, whose
        shared components are the base's, key for key."""
        folder = os.path.abspath(os.fspath(controlnet))
        entry = self.entry(base)
        if entry.class_name not in CONTROLNET_PIPELINES:
            raise ArgumentError(
                f"pipeline {base!r} ({entry.class_name}) takes no ControlNet here; nostall "
                f"attaches them to {', '.join(sorted(CONTROLNET_PIPELINES))}",
                field="controlnet",
            )
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise CheckpointError(
                "not a ControlNet folder (no config.json): give the folder that "
                "ControlNetModel.save_pretrained wrote",
                path=folder,
            )
        name = f"{base}+{label}"
        with self._lock:
            if self._attached.get(name, (base, folder)) != (base, folder):
                self._entries.pop(name, None)  # the label now means another folder
            self._attached[name] = (base, folder)
        return name

    def _with_controlnet(self, name: str) -> PipelineEntry:
        base_name, folder = self._attached[name]
        base = self.entry(base_name)
        config = read_json(os.path.join(folder, "config.json"), "ControlNet config")
        cls = config.get("_class_name")
        if not isinstance(cls, str):
            raise CheckpointError(
                'the ControlNet config has no "_class_name"',
                path=os.path.join(folder, "config.json"),
            )
        allowed = _CONTROLNET_CLASSES[base.class_name]
        if cls not in allowed:
            raise AdapterError(
                f"the ControlNet in {folder} is a {cls}; {base.class_name} takes "
                f"{' or '.join(allowed)} (a ControlNet for another architecture?)",
                path=folder,
                field="controlnet",
            )
        denoiser = base.components.get("unet") or base.components.get("transformer")
        if denoiser is not None:
            own = read_json(os.path.join(denoiser.folder, "config.json"), "denoiser config")
            for key in _SHARED_FIELDS:
                if key in config and key in own and config[key] != own[key]:
                    raise AdapterError(
                        f"the ControlNet in {folder} does not fit {base_name}: its {key} is "
                        f"{config[key]!r}, the base's {own[key]!r} (a ControlNet for another "
                        "model?)",
                        path=folder,
                        layer=key,
                        field="controlnet",
                    )
        comp = self._component("controlnet", "diffusers", cls, folder, folder)
        return PipelineEntry(
            name,
            base.folder,
            CONTROLNET_PIPELINES[base.class_name],
            {**base.components, "controlnet": comp},
            base.config,
            base.stamps,
        )

    def entry(self, name: str) -> PipelineEntry:
        """The pipeline called ``name``, as its files are now; :class:`~nostall.UnknownModel`
        lists the others."""
        if name in self._attached:
            with self._lock:
                cached = self._entries.get(name)
                if cached is not None and _unchanged(cached):
                    return cached
                entry = self._entries[name] = self._with_controlnet(name)
                return entry
        folder = self._folders.get(name)
        if folder is None:
            names = self.names()
            close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            shown = ", ".join(map(repr, names[:20])) + (" …" if len(names) > 20 else "")
            why = self._left_out.get(str(name))
            if why is not None:
                raise UnknownModel(
                    f"no pipeline {name!r} in the store: {why}. It has {len(names)}: "
                    f"{shown or 'none'}",
                    name=str(name),
                    available=names,
                    close=close,
                    left_out=why,
                )
            raise UnknownModel(
                f"no pipeline {name!r} in the store{hint} It has {len(names)}: {shown or 'none'}",
                name=str(name),
                available=names,
                close=close,
            )
        with self._lock:
            cached = self._entries.get(name)
            if cached is not None and _unchanged(cached):
                return cached
            entry = self._entries[name] = self._scan(name, folder)
            return entry

    def must_hash(self, c: ComponentEntry) -> bool:
        """Whether a read of ``c`` from disk must hash its bytes: its content is unknown,
        or the index claims for it what it claims for other files too, unproven."""
        if c.checkpoint is None:
            return False
        with self._lock:
            return self._keys.must_hash(c.content, c.checkpoint)

    def learn(self, c: ComponentEntry, digests: list[str]) -> str:
        """Record the data digests of ``c``'s files (in its checkpoint's file order), read
        and hashed by the switch that just loaded it; return the key that content is
        served under from now on (``c.digest``, or an earlier copy's key when the same
        bytes were already known under another). A digest index row that the bytes
        contradict is logged and replaced; ``c`` was served from its own bytes."""
        ckpt = c.checkpoint
        if ckpt is None or len(digests) != len(ckpt.files):
            raise InternalError(
                f"{len(digests)} digests for component {c.role!r} of "
                f"{0 if ckpt is None else len(ckpt.files)} files"
            )
        for f, d in zip(ckpt.files, digests, strict=True):
            if f.identity is None:
                continue
            claimed = self.index.get(f.identity)
            if claimed is not None and claimed != d:
                log.warning(
                    "%s: the digest index %s said its data hashes to %s…, its bytes hash to "
                    "%s…: the row was wrong (edited, corrupted, written by another version, "
                    "or an index copied from another machine); replaced, and component %r is "
                    "keyed by its bytes",
                    f.path,
                    self.index.path or "(in memory)",
                    claimed[:16],
                    d[:16],
                    c.role,
                )
            self.index.put(f.identity, f.path, d)
            with self._lock:
                self._keys.hashed(f.identity, d)
        content = content_digest(c.library, c.class_name, c.config_key, ckpt, digests)
        with self._lock:
            key = self._keys.learned(content, c.digest)
            for name, e in list(self._entries.items()):
                roles = [
                    r for r, x in e.components.items() if x is not None and x.digest == c.digest
                ]
                if not roles:
                    continue
                if key != c.digest:
                    # Another copy of these bytes is served already: pipelines holding this
                    # one are scanned again (and find that key) on their next entry().
                    del self._entries[name]
                    continue
                comps = dict(e.components)
                for r in roles:
                    comps[r] = dataclasses.replace(comps[r], content=content)
                self._entries[name] = dataclasses.replace(e, components=comps)
        return key

    def index_files(self, name: str, *, threads: int = 8) -> int:
        """Hash ``name``'s weight files that the digest index does not know yet, now, in
        ``threads`` threads (a pass of its own: for preparing a store ahead of its first
        switch, e.g. right after downloading it); returns the bytes hashed."""
        from concurrent.futures import ThreadPoolExecutor

        todo = []
        for c in self.entry(name).weights:
            for f in c.checkpoint.files:
                if f.identity is not None and self.index.get(f.identity) is None:
                    todo.append(f)

        def one(f) -> int:
            digest = hash_file_data(f.path, f.data_start, f.data_end)
            if FileIdentity.stat(f.path) != f.identity:
                raise FileChanged("the file changed while it was hashed", path=f.path)
            self.index.put(f.identity, f.path, digest)
            with self._lock:
                self._keys.hashed(f.identity, digest)
            kept = f.path.removesuffix(REMOTE_SUFFIX)
            if kept != f.path and os.path.isfile(kept):
                # A remote file the read just kept on disk (cache_dir): the same bytes.
                self.index.put(FileIdentity.stat(kept), kept, digest)
            return f.data_bytes

        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(one, todo))
        with self._lock:
            self._entries.pop(name, None)  # scanned again: now with content keys
        return done

    # ---- scanning ----------------------------------------------------------------------

    def _scan(self, name: str, folder: str) -> PipelineEntry:
        try:
            return self._scan_unlocked(name, folder)
        except FileNotFoundError as e:
            raise FileChanged(
                f"a file or folder of pipeline {name!r} vanished while it was scanned "
                f"({e.filename}); scan it again once the store is complete",
                path=folder,
            ) from e

    def _scan_unlocked(self, name: str, folder: str) -> PipelineEntry:
        index_path = os.path.join(folder, INDEX)
        stamps = [stamp(folder), stamp(index_path)]
        index = read_json(index_path, "pipeline index")
        class_name = index.get("_class_name")
        if not isinstance(class_name, str):
            raise CheckpointError(
                'model_index.json has no "_class_name" naming the pipeline class',
                path=index_path,
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
                check_role(key, index_path)
                components[key] = self._component(
                    key, library, cls, os.path.join(folder, key), index_path
                )
            else:
                config[key] = value
        return PipelineEntry(name, folder, class_name, components, config, tuple(stamps))

    def _component(
        self, role: str, library: str, cls: str, folder: str, index_path: str
    ) -> ComponentEntry:
        if not os.path.isdir(folder):
            raise CheckpointError(
                f"model_index.json names component {role!r} ({library}.{cls}) but its folder is "
                "missing; the download is incomplete",
                path=folder,
            )
        listing = listdir(folder)
        check_size(role, folder, len(listing))
        check_links(folder, listing)
        if _is_module(library, cls):
            return self._weights(role, library, cls, folder, listing)
        folders, names = component_files(role, folder, listing)
        stamps = [stamp(folder)] + [stamp(os.path.join(folder, rel)) for rel in folders]
        files = []
        for rel in names:
            path = os.path.join(folder, rel)
            stamps.append(stamp(path))
            files.append((rel, path, stamps[-1][1].size))
        held = sum(size for _, _, size in files)
        if held > MAX_FILES_BYTES:
            raise CheckpointError(
                f"component {role!r} ({library}.{cls}) is read as files, and its folder holds "
                f"{held / 2**30:.1f} GiB of them, more than the {MAX_FILES_BYTES >> 30} GiB a "
                f"tokenizer or scheduler needs{link_hint(folder)}; point it at the "
                "component's own folder (a module class nostall cannot import is read as files "
                "too: install its library)",
                path=folder,
            )
        digest = hashlib.sha256(f"files|{library}.{cls}\n".encode())
        for rel, path, size in files:
            digest.update(f"{rel}|{size}\n".encode())
            try:
                with open_regular(path, what=f"{role} file") as f:
                    for block in iter(lambda f=f: f.read(16 << 20), b""):
                        digest.update(block)
            except OSError as e:
                raise ReadError(f"cannot read the {role} file: {e.strerror or e}", path=path) from e
        content = digest.hexdigest()[:32]
        with self._lock:
            key = self._keys.files(content)
        return ComponentEntry(
            role, library, cls, folder, False, key, content=content, stamps=tuple(stamps)
        )

    def _weights(
        self, role: str, library: str, cls: str, folder: str, listing: list[str]
    ) -> ComponentEntry:
        config_path = os.path.join(folder, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(
                f"component {role!r} ({library}.{cls}) has no config.json: not a component "
                f"folder save_pretrained wrote{link_hint(folder)}; download the component "
                "again or point it at its own folder",
                path=folder,
            )
        stamps = [stamp(folder), stamp(config_path)]
        config = read_json(config_path, f"{role} config")
        try:
            ckpt = resolve(folder, variant=self.variant)
        except CheckpointError as e:
            if any(n.endswith((".bin", ".pt", ".ckpt")) for n in listing):
                raise CheckpointError(
                    f"component {role!r} has no safetensors weights (only pickled .bin/.ckpt "
                    "files); nostall reads safetensors only: convert them with "
                    "save_pretrained(safe_serialization=True)",
                    path=folder,
                ) from e
            raise
        if ckpt.source.endswith(".json"):
            stamps.append(stamp(ckpt.source))
        for f in ckpt.files:
            stamps.append((f.path, f.identity or FileIdentity.stat(f.path)))
        layout = hashlib.sha256()
        layout.update(f"{library}.{cls}\n".encode())
        layout.update(_canonical(config))
        for f in ckpt.files:
            for e in f.tensors:
                layout.update(f"{e.name}|{e.dtype}|{list(e.shape)}\n".encode())
        config_key = _canonical(config)
        files = identity_key(library, cls, config_key, ckpt)
        with self._lock:
            known = [self._keys.digest(f.identity, self.index) for f in ckpt.files]
            if all(known):
                content = content_digest(library, cls, config_key, ckpt, known)
                verified = self._keys.verified(ckpt)
                key = self._keys.weights(content, files, verified=verified)
            else:
                # Not known yet: the files' identities (a symlinked copy is the same file)
                # until a read hashes them.
                content, key = None, files
        return ComponentEntry(
            role,
            library,
            cls,
            folder,
            True,
            key,
            layout.hexdigest()[:32],
            ckpt,
            ckpt.nbytes,
            content=content,
            stamps=tuple(stamps),
            config_key=config_key,
        )


# Stores by _share_key, held weakly: an entry lives while a user holds its store.
_SHARED: weakref.WeakValueDictionary[tuple, Store] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def _index_key(cache_dir: str | os.PathLike | bool | None) -> str | bool:
    if cache_dir is False:
        return False
    folder = default_cache_dir() if cache_dir is None or cache_dir is True else cache_dir
    return os.path.realpath(os.fspath(folder))


def _share_key(models, variant: str | None, cache_dir) -> tuple:
    """What makes two stores the same: where the pipelines are, the variant read and
    where the digest index lives."""
    if isinstance(models, Mapping):
        where: object = tuple(
            sorted((str(k), os.path.realpath(os.fspath(v))) for k, v in models.items())
        )
    elif isinstance(models, str) and models.startswith("s3://"):
        where = models
    else:
        where = os.path.realpath(os.fspath(models))
    return (where, variant, _index_key(cache_dir))


def files_key(c: ComponentEntry) -> str:
    """``c``'s key by its files' identities, whether or not its content digest is known:
    what a host tier shared between processes files it under (their digest indexes may
    know the content at different times; the files are the same)."""
    if c.checkpoint is None:
        return c.digest
    return identity_key(c.library, c.class_name, c.config_key, c.checkpoint)


def _unchanged(entry: PipelineEntry) -> bool:
    stamps = list(entry.stamps)
    for c in entry.components.values():
        if c is not None:
            stamps.extend(c.stamps)
    for path, identity in stamps:
        try:
            if FileIdentity.stat(path) != identity:
                return False
        except OSError:
            return False
    return True


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


def _not_a_pipeline(path: str) -> str | None:
    """Why the store's entry ``path`` is not served as a pipeline, for the ones a user may
    have meant as one (a folder, or a link); ``None`` for other files and hidden names."""
    name = os.path.basename(path)
    if name.startswith("."):
        return None
    if os.path.islink(path) and not os.path.exists(path):
        return f"{path} is a link to {os.readlink(path)!r}, which does not exist"
    if not os.path.isdir(path):
        return None
    index = os.path.join(path, INDEX)
    if os.path.lexists(index):
        return (
            f"{index} is not a readable regular file (a dangling link, a folder, or no "
            "permission); make it the model_index.json that save_pretrained wrote"
        )
    return (
        f"the folder {path} has no {INDEX}, so it is not a diffusers pipeline folder; "
        "save it with pipeline.save_pretrained(...), or copy the model_index.json in"
    )
