"""Real-size random pipeline folders: FLUX.1-dev, SDXL, SD3-medium and the Wan 2.1 / 2.2
text-to-video layouts, written offline.

The modules are built on ``meta`` from the published configs, and each tensor is
drawn on the GPU (N(0, 0.02), in the component's dtype) and written into shards the
way ``save_pretrained`` names them, with the index beside them. Tied tensors (T5's and
UMT5's shared embedding) are written once, as ``save_pretrained`` does. Tokenizers are the
small offline ones of :mod:`nostall.synthetic.tokenizers`: the pipelines only need token ids
in range, and the weights dominate every byte count.

The VAEs' normalisation layers get scale 1 and shift 0, as trained ones have them near:
with N(0, 0.02) there too, every decoded image came out 128 ± 1 grey whatever the
latents, and a benchmark could not tell one request's image from another's. With them,
images of different seeds differ by about 50 levels on average.

Components with the same layout, dtype and seed are the same bytes in every pipeline
(one digest, one copy in a cache's tiers); :func:`write_full` links them to a sibling
pipeline's files where one is written beside (``_SHARED``: ``flux-b`` has everything but
the transformer from ``flux``, ``sdxl-b`` and ``sdxl-c`` all but the UNet from ``sdxl``, ``sd3`` FLUX's T5-XXL and 16-channel VAE weights, the Wan
layouts one UMT5-XXL and one Wan 2.1 VAE), so the disk holds them once. Each
transformer is its own draw: Wan 2.2 A14B's two experts are two distinct 14B models,
neither of them ``wan-14b``'s. ``elsewhere`` puts a component's weight files on another
filesystem (a 64 GB disk does not take a bf16 A14B store, 69 GB), linked into the
pipeline folder. :func:`footprint` says what a set of pipelines takes on disk and in
memory, and :func:`check_room` refuses folders whose disks cannot take them.

SD3-medium is written in bf16, not the published fp16: its pipeline concatenates the
CLIP and T5 embeddings, so all its encoders must share one dtype, and in bf16 its
T5-XXL is FLUX's (9.5 GB saved on disk and in every tier; the layout and shapes are the
published ones). The Wan transformers and UMT5 are bf16, their VAE float32, as diffusers'
Wan examples load them.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nostall.synthetic.layouts import LAYOUTS as _FULL
from nostall.synthetic.layouts import Dtypes, t5_xxl, umt5_xxl
from nostall.synthetic.tokenizers import clip_tokenizer, t5_tokenizer

__all__ = [
    "FULL_PIPELINES",
    "check_room",
    "footprint",
    "t5_xxl",
    "umt5_xxl",
    "write_full",
    "write_full_store",
    "write_weights",
]

_SHARD = 10 * 10**9  # diffusers' and transformers' max_shard_size="10GB"


FULL_PIPELINES = tuple(_FULL)
_SEEDS = {
    n: i
    for i, n in enumerate(
        ("flux", "flux-b", "sdxl", "sd3", "wan-1.3b", "wan-14b", "wan22-a14b", "sdxl-b", "sdxl-c"),
        1,
    )
}
# The denoisers: drawn from the pipeline's seed plus this, so each is its own bytes
# (Wan 2.2's second expert is not its first).
_OWN = {"transformer": 0, "unet": 0, "transformer_2": 1000}


@dataclass(frozen=True)
class _Shared:
    """The components a pipeline has in common with earlier-written siblings."""

    siblings: tuple[str, ...]
    """Pipelines that have them, by preference: the first written beside is linked to."""
    roles: Mapping[str, str]
    """role -> the sibling's role of the same layout, dtype and seed (the same bytes)."""
    whole_folders: bool = False
    """The role folders are equal, config and all: link the folder, not only the weights."""


_WAN_SHARED = {"text_encoder": "text_encoder", "vae": "vae"}
_SDXL_ROLES = ("text_encoder", "text_encoder_2", "vae")
_SDXL_SHARED = _Shared(("sdxl",), {r: r for r in _SDXL_ROLES}, whole_folders=True)
_SHARED: dict[str, _Shared] = {
    "flux-b": _Shared(
        ("flux",), {r: r for r in ("text_encoder", "text_encoder_2", "vae")}, whole_folders=True
    ),
    # SDXL fine-tunes: their own UNet, the base model's text encoders and VAE
    "sdxl-b": _SDXL_SHARED,
    "sdxl-c": _SDXL_SHARED,
    # SD3's VAE has its own scaling in its config, FLUX's VAE weights
    "sd3": _Shared(("flux",), {"text_encoder_3": "text_encoder_2", "vae": "vae"}),
    "wan-14b": _Shared(("wan-1.3b",), _WAN_SHARED, whole_folders=True),
    # not wan-14b's transformer: the two experts are distinct models, and a cache keyed
    # by content would hold one copy of equal bytes
    "wan22-a14b": _Shared(("wan-14b", "wan-1.3b"), _WAN_SHARED, whole_folders=True),
}
_MARGIN = 2 * 10**9  # disk left free beside a store: indexes, logs, the page of a shard


def _dtype(dtypes: Dtypes, role: str) -> torch.dtype:
    return dtypes if isinstance(dtypes, torch.dtype) else dtypes[role]


def _seed(name: str, role: str) -> int:
    """The seed ``name``'s ``role`` is drawn from: a shared role takes its first sibling's
    (the same bytes wherever it is written), a denoiser the pipeline's own."""
    if role in _OWN:
        return _SEEDS[name] + _OWN[role]
    shared = _SHARED.get(name)
    if shared is not None and role in shared.roles:
        return _seed(shared.siblings[0], shared.roles[role])
    return zlib.crc32(role.encode())


def _home(name: str, role: str, names: tuple[str, ...]) -> tuple[str, str]:
    """The pipeline and role whose files ``name``'s ``role`` are, when ``names`` are all
    written (siblings first): its own, or a sibling's, followed along links."""
    shared = _SHARED.get(name)
    if shared is not None and role in shared.roles:
        for sibling in shared.siblings:
            if sibling in names:
                return _home(sibling, shared.roles[role], names)
    return name, role


def _in_order(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` with every pipeline after the siblings it links to."""
    out: list[str] = []

    def visit(name: str) -> None:
        if name in out:
            return
        for sibling in _SHARED[name].siblings if name in _SHARED else ():
            if sibling in names:
                visit(sibling)
        out.append(name)

    for name in names:
        visit(name)
    return tuple(out)


def _nbytes(module, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each distinct tensor (tied ones once) as written in ``dtype``."""
    out, seen = {}, set()
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[key] = t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
    return out


def _check_names(names: tuple[str, ...]) -> None:
    from nostall.errors import ArgumentError

    bad = [n for n in names if n not in _FULL]
    if bad:
        raise ArgumentError(f"no full-size layout for {bad}; choose from {list(_FULL)}")


def footprint(names: tuple[str, ...]) -> dict[str, Any]:
    """What the real-size pipelines ``names`` take, computed on ``meta`` (nothing drawn).

    ``pipelines``: name → role → bytes; ``disk_bytes``: the files, a component shared
    with a sibling among ``names`` counted once (``homes``: (pipeline, role) → bytes of
    each set of files); ``distinct_bytes``: the components of distinct bytes (what a
    model cache's host tier holds for all of them); ``separate_bytes``: every
    pipeline's components counted for it (what plain diffusers pipelines held side by
    side in memory take).

    >>> footprint(("sdxl",))["disk_bytes"] / 1e9  # doctest: +SKIP
    6.94...
    """
    _check_names(names)
    pipelines: dict[str, dict[str, int]] = {}
    homes: dict[tuple[str, str], int] = {}
    distinct: dict[tuple, int] = {}
    for name in names:
        _, modules, _, dtypes = _FULL[name]()
        pipelines[name] = {}
        for role, module in modules.items():
            dtype = _dtype(dtypes, role)
            n = sum(_nbytes(module, dtype).values())
            pipelines[name][role] = n
            homes[_home(name, role, names)] = n
            distinct[(type(module).__name__, str(dtype), _seed(name, role), n)] = n
    return {
        "pipelines": pipelines,
        "homes": homes,
        "disk_bytes": sum(homes.values()),
        "distinct_bytes": sum(distinct.values()),
        "separate_bytes": sum(sum(p.values()) for p in pipelines.values()),
    }


def check_room(
    folder: str,
    names: tuple[str, ...],
    written: tuple[str, ...] = (),
    *,
    elsewhere: Mapping[str, str] | None = None,
) -> int:
    """Bytes the pipelines ``names`` not in ``written`` will add under ``folder``, and under
    ``elsewhere``'s folders for their roles (see :func:`write_full`);
    :class:`~nostall.ArgumentError` when a disk has less free (with a 2 GB margin),
    naming the numbers. Folders on one filesystem are counted together.

    >>> check_room("/store", ("wan22-a14b",),
    ...            elsewhere={"transformer_2": "/dev/shm/w"})  # doctest: +SKIP
    69023357132
    """
    import shutil

    from nostall.errors import ArgumentError

    elsewhere = dict(elsewhere or {})
    todo = tuple(n for n in names if n not in written)
    if not todo:
        return 0
    need: dict[str, int] = {folder: 0, **{d: 0 for d in elsewhere.values()}}
    for (name, role), n in footprint(tuple(names))["homes"].items():
        if name not in written:
            need[elsewhere.get(role, folder)] += n
    by_disk: dict[int, list[str]] = {}  # st_dev -> its folders, ``folder`` first
    for where in need:
        by_disk.setdefault(_filesystem(where), []).append(where)
    refused = []
    for folders in by_disk.values():
        total = sum(need[w] for w in folders)
        free = shutil.disk_usage(_existing(folders[0])).free
        if total and total + _MARGIN > free:
            what = " and ".join(
                f"the real-size {', '.join(todo)} pipelines"
                if w == folder
                else f"the {', '.join(r for r, d in elsewhere.items() if d == w)} files"
                for w in folders
                if need[w]
            )
            refused.append(
                f"{' and '.join(folders)}: {what} need {total / 1e9:.1f} GB "
                f"and its disk has {free / 1e9:.1f} GB free"
            )
    if refused:
        raise ArgumentError(
            f"{'; '.join(refused)} (a {_MARGIN / 1e9:.0f} GB margin kept); free space there, "
            "write the store on a disk with room, or put a component's files on another "
            "disk (elsewhere=, --elsewhere ROLE=DIR)"
        )
    return sum(need.values())


def _filesystem(path: str) -> int:
    """The filesystem (``st_dev``) that will hold ``path``."""
    return os.stat(_existing(path)).st_dev


def _existing(path: str) -> str:
    """``path``, or its nearest folder above that exists (what will hold it)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return probe


def _stamped(folder: str, name: str) -> bool:
    """Whether ``folder`` holds the real-size ``name`` pipeline, completely written."""
    try:
        with open(os.path.join(folder, "nostall-store.json")) as f:
            return json.load(f) == {"size": "full", "name": name}
    except (OSError, ValueError):
        return False


def _check_elsewhere(elsewhere: Mapping[str, str], roles: set[str], what: str) -> dict[str, str]:
    """``elsewhere`` with absolute folders, each created; :class:`~nostall.ArgumentError`
    for a role not in ``roles`` or a folder that cannot be made or written."""
    from nostall.errors import ArgumentError

    bad = sorted(set(elsewhere) - roles)
    if bad:
        raise ArgumentError(
            f"elsewhere names {bad}, a role with no weights in {what}; give one of "
            f"{sorted(roles)} (ROLE=DIR)"
        )
    out = {}
    for role, where in elsewhere.items():
        path = os.path.abspath(os.fspath(where))
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ArgumentError(
                f"elsewhere {role}={where!r}: cannot create {path} ({e.strerror}); give a "
                "folder that can be made and written, on a filesystem with room"
            ) from e
        if not os.access(path, os.W_OK | os.X_OK):
            raise ArgumentError(
                f"elsewhere {role}={where!r}: {path} is not writable; give a folder that is"
            )
        out[role] = path
    return out


def write_full_store(
    folder: str | os.PathLike,
    names: tuple[str, ...],
    *,
    device: str | torch.device = "cuda",
    progress: Callable[[str], None] | None = None,
    elsewhere: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Write the real-size pipelines ``names`` under ``folder`` (siblings first, so shared
    components are links), after :func:`check_room`; return ``name → pipeline folder``.

    A pipeline already written there at full size is kept. ``elsewhere`` (role → folder)
    applies to every pipeline with that role (see :func:`write_full`).

    >>> write_full_store("/tmp/store", ("wan-14b", "wan22-a14b"),
    ...                  elsewhere={"transformer_2": "/dev/shm/wan"})  # doctest: +SKIP
    {'wan-14b': '/tmp/store/wan-14b', 'wan22-a14b': '/tmp/store/wan22-a14b'}
    """
    _check_names(names)
    root = os.fspath(folder)
    fp = footprint(names)
    roles = {r for p in fp["pipelines"].values() for r in p}
    elsewhere = _check_elsewhere(elsewhere or {}, roles, str(list(names)))
    written = tuple(n for n in names if _stamped(os.path.join(root, n), n))
    check_room(root, names, written, elsewhere=elsewhere)
    os.makedirs(root, exist_ok=True)
    out = {}
    for name in _in_order(names):
        path = out[name] = os.path.join(root, name)
        if name in written:
            continue
        if progress is not None:
            progress(f"writing full {name} pipeline to {path}")
        mine = {r: d for r, d in elsewhere.items() if r in fp["pipelines"][name]}
        write_full(name, path, device=device, progress=progress, elsewhere=mine)
        stamp = os.path.join(path, "nostall-store.json")
        with open(stamp + ".partial", "w") as f:
            json.dump({"size": "full", "name": name}, f)
        os.replace(stamp + ".partial", stamp)
    return {n: out[n] for n in names}


def write_full(
    name: str,
    folder: str,
    *,
    device: str | torch.device = "cuda",
    progress: Callable[[str], None] | None = None,
    elsewhere: Mapping[str, str] | None = None,
) -> None:
    """Write the real-size random pipeline ``name`` (one of :data:`FULL_PIPELINES`).

    ``flux-b`` shares every component but the transformer with ``flux`` (same bytes),
    as two FLUX fine-tunes in a service do; ``sd3`` shares T5-XXL and the VAE's weights
    with it; ``wan-14b`` and ``wan22-a14b`` share UMT5-XXL and the VAE with ``wan-1.3b``
    (and ``wan22-a14b`` with ``wan-14b``). Where such a sibling is written beside, they
    are links to its files.

    ``elsewhere`` maps a role to a folder: that role's shards and index are written in
    ``<folder>/<name>/<role>/`` and linked into the pipeline folder (its config stays
    there), so a store can span two filesystems.

    >>> write_full("wan22-a14b", "/store/wan22-a14b",
    ...            elsewhere={"transformer_2": "/dev/shm/wan"})  # doctest: +SKIP
    """
    import diffusers

    _check_names((name,))
    class_name, modules, files, dtypes = _FULL[name]()
    elsewhere = _check_elsewhere(elsewhere or {}, set(modules), str([name]))
    os.makedirs(folder, exist_ok=True)
    index: dict[str, Any] = {"_class_name": class_name, "_diffusers_version": diffusers.__version__}
    shared = _SHARED.get(name, _Shared((), {}))
    parent = os.path.dirname(os.path.abspath(folder))
    beside = next((s for s in shared.siblings if _stamped(os.path.join(parent, s), s)), None)
    sibling = os.path.join(parent, beside) if beside else ""
    for role, module in modules.items():
        lib = "diffusers" if isinstance(module, diffusers.ModelMixin) else "transformers"
        index[role] = [lib, type(module).__name__]
        sub = os.path.join(folder, role)
        linked = beside is not None and role in shared.roles
        if linked and shared.whole_folders and (os.path.islink(sub) or not os.path.lexists(sub)):
            if not os.path.islink(sub):
                os.symlink(os.path.join(sibling, shared.roles[role]), sub)
            if progress is not None:
                progress(f"  {name}/{role}: linked to {beside}/{shared.roles[role]}")
            continue
        if os.path.islink(sub):  # a link from an earlier write beside a sibling
            os.remove(sub)
        os.makedirs(sub, exist_ok=True)
        dtype = _dtype(dtypes, role)
        if lib == "diffusers":
            module.save_config(sub)
            stem = "diffusion_pytorch_model"
        else:
            module.config.torch_dtype = dtype
            # What save_pretrained records and loaders read to find the class.
            module.config.architectures = [type(module).__name__]
            module.config.save_pretrained(sub)
            stem = "model"
        if linked:  # its own config (SD3's VAE scaling), the sibling's weights
            _link_weights(os.path.join(sibling, shared.roles[role]), sub)
            if progress is not None:
                progress(f"  {name}/{role}: linked to {beside}/{shared.roles[role]}'s files")
            continue
        unit = _norm_keys(module) if role == "vae" else frozenset()
        target = os.path.join(elsewhere[role], name, role) if role in elsewhere else sub
        os.makedirs(target, exist_ok=True)
        seed = _seed(name, role)  # shared components: the same seed, the same bytes
        write_weights(module, target, stem, dtype, device, seed, progress, f"{name}/{role}", unit)
        if target != sub:
            _link_weights(target, sub)
            if progress is not None:
                progress(f"  {name}/{role}: files in {target}, linked")
    for role, obj in files.items():
        sub = os.path.join(folder, role)
        if isinstance(obj, tuple):
            kind, length = obj
            tok = clip_tokenizer(length) if kind == "clip" else t5_tokenizer(length)
            tok.save_pretrained(sub)
            index[role] = ["transformers", "CLIPTokenizer" if kind == "clip" else "T5TokenizerFast"]
        elif hasattr(obj, "save_pretrained"):
            obj.save_pretrained(sub)
            index[role] = ["diffusers", type(obj).__name__]
        else:  # a pipeline option (SDXL's force_zeros_for_empty_prompt, boundary_ratio)
            index[role] = obj
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)


def _norm_keys(module) -> frozenset[str]:
    """The state-dict keys of ``module``'s normalisation scales and shifts: GroupNorm's and
    LayerNorm's, and the ``gamma`` (and ``bias``) of diffusers' ``WanRMS_norm``, the Wan
    VAE's only normalisation."""
    keys = set()
    for prefix, m in module.named_modules():
        if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) or "gamma" in m._parameters:
            keys |= {f"{prefix}.{n}" if prefix else n for n, _ in m.named_parameters(recurse=False)}
    return frozenset(keys)


def _link_weights(source: str, folder: str) -> None:
    """Link ``source``'s weight files (shards and index) into ``folder``."""
    for f in sorted(os.listdir(source)):
        if f.endswith((".safetensors", ".safetensors.index.json")):
            dst = os.path.join(folder, f)
            if os.path.lexists(dst):
                os.remove(dst)
            os.symlink(os.path.join(source, f), dst)


def write_weights(
    module, folder, stem, dtype, device, seed, progress, what, unit: frozenset[str] = frozenset()
) -> None:
    """Draw and write ``module``'s tensors; the keys in ``unit`` (normalisation layers)
    as scale 1 (``*.weight``, ``*.gamma``) and shift 0 (``*.bias``)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    entries = []
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:  # tied: save_pretrained writes it once
            continue
        seen.add(id(t))
        entries.append((key, tuple(t.shape), dtype if t.is_floating_point() else t.dtype))
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for e in entries:
        n = e[2].itemsize
        for d in e[1]:
            n *= d
        if shards[-1] and size + n > _SHARD:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    gen = torch.Generator(device=device).manual_seed(seed % (2**31))
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = (
            f"{stem}.safetensors"
            if len(shards) == 1
            else f"{stem}-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for key, shape, dt in shard:
            if key in unit:
                fill = 1.0 if key.endswith((".weight", ".gamma")) else 0.0
                tensors[key] = torch.full(shape, fill, dtype=dt)
            elif dt.is_floating_point:
                t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
                tensors[key] = t.to(dt).cpu()
            else:
                tensors[key] = torch.zeros(shape, dtype=dt)
            weight_map[key] = fname
            total += tensors[key].numel() * tensors[key].element_size()
        tmp = os.path.join(folder, fname + ".partial")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(folder, fname))
        del tensors
        if progress is not None:
            progress(f"  {what}: shard {k + 1}/{len(shards)}")
    if len(shards) > 1:
        index = os.path.join(folder, f"{stem}.safetensors.index.json")
        # renamed into place: an index left linked to a sibling's is replaced, not written
        # through
        with open(index + ".partial", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        os.replace(index + ".partial", index)
