"""``nostall.quantize``: convert a checkpoint to FP8 (e4m3, per-row scales), streaming.

Takes what the loader takes (a ``.safetensors`` file, a shard index, a diffusers or
transformers component folder) and also a whole pipeline folder (``model_index.json``:
every component with safetensors weights is converted, tokenizers and schedulers are
copied). The output keeps the input's layout and file names, so it loads wherever the
input did; see :mod:`nostall.quant.fp8` for which tensors change and how.

Everything is checked before anything is written: an FP8 or integer checkpoint, one
with no linear weight to convert, a ``<name>_scale`` tensor already present, an
existing output (without ``overwrite``). Tensors are read one at a time
(``safetensors.safe_open``) and written one at a time (:class:`StreamWriter`), so
memory stays at the largest tensor, whatever the checkpoint's size. Outputs appear
under their final names only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from nostall.checkpoint import Checkpoint, resolve
from nostall.checkpoint.dtypes import to_torch
from nostall.checkpoint.files import open_regular, parse_json
from nostall.checkpoint.header import FileIndex
from nostall.checkpoint.writer import StreamWriter
from nostall.errors import ArgumentError, CheckpointError
from nostall.quant.fp8 import (
    DEFAULT_SKIP,
    METADATA_KEY,
    SCALE_SUFFIX,
    quantize_weight,
    scheme_metadata,
    skip_reason,
)

__all__ = ["QuantizeReport", "quantize"]

Progress = Callable[[int, int], None]  # (source bytes done, total)


@dataclass
class QuantizeReport:
    """What a conversion did: per output file, tensors converted and kept, bytes."""

    source: str
    destination: str
    files: list[str] = field(default_factory=list)
    quantized: int = 0
    kept: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    kept_reasons: Counter = field(default_factory=Counter)

    @property
    def ratio(self) -> float:
        return self.bytes_out / self.bytes_in if self.bytes_in else 0.0


def quantize(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    skip: Iterable[str] = (),
    default_skip: bool = True,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> QuantizeReport:
    """Convert ``src`` to FP8 into ``dst`` (same layout and names).

    ``skip``: more regular expressions (``re.search`` on tensor names) whose tensors
    keep their dtype; ``default_skip=False`` drops :data:`~nostall.quant.fp8.DEFAULT_SKIP`
    (embeddings, first and last projections). ``progress(done, total)`` counts source
    bytes. Raises :class:`~nostall.CheckpointError` for inputs it cannot convert and
    :class:`~nostall.ArgumentError` for an output it may not write.

    >>> report = nostall.quantize("flux/transformer", "flux-fp8/transformer")  # doctest: +SKIP
    >>> report.ratio  # doctest: +SKIP
    0.502
    """
    source, target = os.fspath(src), os.fspath(dst)
    patterns = (*DEFAULT_SKIP, *skip) if default_skip else tuple(skip)
    jobs = _plan(source, target)  # (Checkpoint | None, src dir, dst dir) per component
    _check_target(source, target, overwrite)
    report = QuantizeReport(source, target)
    counts = [_check_convertible(c, patterns) for c, _, _ in jobs]
    if sum(counts) == 0:
        raise CheckpointError(
            "has no linear weight to convert (2-D '.weight' tensors whose dimensions are "
            "multiples of 16, outside the skip list); nothing would change",
            path=source,
        )
    # In a pipeline, a component with nothing to convert (a conv-only VAE) is copied.
    jobs = [(c if n else None, d, t) for (c, d, t), n in zip(jobs, counts, strict=True)]
    total = sum(c.nbytes for c, _, _ in jobs if c is not None)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    single = os.path.isfile(source) and not source.endswith(".json")
    if single:
        ((ckpt, _, _),) = jobs
        _convert_file(ckpt.files[0], target, patterns, report, advance)
        return report
    partial = target.rstrip(os.sep) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        _copy_tree(source, partial, skip={os.path.abspath(f.path) for c, _, _ in jobs if c
                                          for f in c.files} | _indexes(jobs))  # fmt: skip
        for ckpt, src_dir, _ in jobs:
            if ckpt is None:
                continue
            rel = os.path.relpath(src_dir, source) if os.path.isdir(source) else "."
            out_dir = os.path.normpath(os.path.join(partial, rel))
            _convert_checkpoint(ckpt, out_dir, patterns, report, advance)
        if overwrite and os.path.exists(target):
            shutil.rmtree(target) if os.path.isdir(target) else os.unlink(target)
        os.replace(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    report.files = [f.replace(partial, target, 1) for f in report.files]
    return report


# ---- planning and checks ---------------------------------------------------------------


def _read_json(path: str, what: str) -> dict:
    with open_regular(path, what=what) as f:
        doc = parse_json(f.read(), what=what, fix="re-save it", path=path)
    if not isinstance(doc, dict):
        raise CheckpointError(f"{what} is not a JSON object", path=path)
    return doc


def _plan(source: str, target: str) -> list[tuple[Checkpoint | None, str, str]]:
    if os.path.isfile(os.path.join(source, "model_index.json")):
        index = _read_json(os.path.join(source, "model_index.json"), "model_index.json")
        jobs = []
        for name, spec in sorted(index.items()):
            folder = os.path.join(source, name)
            if name.startswith("_") or not os.path.isdir(folder):
                continue
            if not isinstance(spec, list) or not os.path.isfile(
                os.path.join(folder, "config.json")
            ):
                continue
            try:
                ckpt = resolve(folder)
            except CheckpointError:
                continue  # a component without safetensors weights (copied as it is)
            jobs.append((ckpt, folder, os.path.join(target, name)))
        if not jobs:
            raise CheckpointError(
                "this pipeline folder has no component with safetensors weights", path=source
            )
        return jobs
    ckpt = resolve(source)
    where = ckpt.folder or (source if os.path.isdir(source) else os.path.dirname(source))
    return [(ckpt, where, target)]


def _indexes(jobs) -> set[str]:
    out = set()
    for ckpt, _, _ in jobs:
        if ckpt is not None and ckpt.source.endswith(".json"):
            out.add(os.path.abspath(ckpt.source))
        if ckpt is not None and ckpt.folder:
            for name in os.listdir(ckpt.folder):
                if ".safetensors.index" in name or name.endswith(".safetensors.index.json"):
                    out.add(os.path.abspath(os.path.join(ckpt.folder, name)))
    return out


def _check_target(source: str, target: str, overwrite: bool) -> None:
    s, t = os.path.abspath(source), os.path.abspath(target)
    if t == s or t.startswith(s.rstrip(os.sep) + os.sep) or s.startswith(t.rstrip(os.sep) + os.sep):
        raise ArgumentError(f"the output {target!r} overlaps the input {source!r}; pick another")
    if os.path.lexists(target) and not overwrite:
        raise ArgumentError(f"{target!r} exists; pass overwrite=True (--overwrite) to replace it")
    if (
        os.path.isfile(source)
        and not source.endswith(".json")
        and not target.endswith(".safetensors")
    ):
        raise ArgumentError(f"the output of a .safetensors file must be one too: {target!r}")
    parent = os.path.dirname(t) or "."
    if not os.path.isdir(parent):
        raise ArgumentError(f"the output's folder {parent!r} does not exist")


def _check_convertible(ckpt: Checkpoint, patterns: tuple[str, ...]) -> int:
    """How many tensors would be converted; CheckpointError for what cannot be."""
    floats = quantizable = 0
    for f in ckpt.files:
        if METADATA_KEY in f.metadata:
            raise CheckpointError("already converted by nostall quantize (FP8)", path=f.path)
        names = {e.name for e in f.tensors}
        for e in f.tensors:
            dtype = to_torch(e.dtype)
            if e.dtype.startswith("F8"):
                raise CheckpointError(
                    f"already holds FP8 tensors ({e.dtype}); convert the original "
                    "(bf16/fp16/fp32) checkpoint instead",
                    path=f.path,
                    tensor=e.name,
                )
            if dtype is not None and dtype.is_floating_point:
                floats += 1
            if skip_reason(e.name, e.shape, dtype, patterns) is None:
                quantizable += 1
                if e.name + SCALE_SUFFIX in names:
                    raise CheckpointError(
                        f"has both {e.name!r} and {e.name + SCALE_SUFFIX!r}: a layout nostall "
                        "does not know (already scaled weights?)",
                        path=f.path,
                        tensor=e.name,
                    )
    if floats == 0:
        raise CheckpointError(
            "has no floating-point tensors (an integer checkpoint?)", path=ckpt.source
        )
    return quantizable


# ---- conversion --------------------------------------------------------------------------


def _convert_checkpoint(ckpt, out_dir, patterns, report, advance) -> None:
    os.makedirs(out_dir, exist_ok=True)
    weight_map: dict[str, str] = {}
    for f in ckpt.files:
        base = os.path.basename(f.path)
        names = _convert_file(f, os.path.join(out_dir, base), patterns, report, advance)
        weight_map.update({n: base for n in names})
    if len(ckpt.files) > 1 or ckpt.source.endswith(".json"):
        index_src = ckpt.source if ckpt.source.endswith(".json") else _index_of(ckpt)
        original = _read_json(index_src, "shard index")
        total = sum(os.path.getsize(os.path.join(out_dir, b)) for b in set(weight_map.values()))
        meta = dict(original.get("metadata") or {})
        meta["total_size"] = total
        index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
        path = os.path.join(out_dir, os.path.basename(index_src))
        with open(path, "w") as out:
            json.dump(index, out, indent=2)


def _index_of(ckpt: Checkpoint) -> str:
    for name in sorted(os.listdir(ckpt.folder)):
        if name.endswith(".json") and ".safetensors.index" in name:
            return os.path.join(ckpt.folder, name)
    raise CheckpointError("sharded weights without an index file", path=ckpt.folder)


def _convert_file(f: FileIndex, out_path: str, patterns, report, advance) -> list[str]:
    from safetensors import safe_open

    plan = []
    entries = []
    dtypes = []
    for e in f.tensors:
        dtype = to_torch(e.dtype)
        why = skip_reason(e.name, e.shape, dtype, patterns)
        plan.append((e, why is None))
        if why is None:
            entries.append((e.name, torch.float8_e4m3fn, e.shape))
            entries.append((e.name + SCALE_SUFFIX, torch.float32, (e.shape[0],)))
            report.quantized += 1
            dtypes.append(e.dtype)
        else:
            entries.append((e.name, dtype, e.shape))
            report.kept += 1
            report.kept_reasons[why.split(" (")[0]] += 1
    meta = dict(f.metadata)
    meta[METADATA_KEY] = scheme_metadata(
        sum(1 for _, q in plan if q), sum(1 for _, q in plan if not q), dtypes
    )
    with safe_open(f.path, framework="pt") as src, StreamWriter(out_path, entries, meta) as w:
        for e, quantized in plan:
            t = src.get_tensor(e.name)
            if quantized:
                q, scale = quantize_weight(t)
                w.write(e.name, q)
                w.write(e.name + SCALE_SUFFIX, scale)
            else:
                w.write(e.name, t)
            del t
            advance(e.end - e.begin)
    report.files.append(out_path)
    report.bytes_in += f.data_bytes
    report.bytes_out += os.path.getsize(out_path) - 8 - _header_len(out_path)
    return [name for name, _, _ in entries]


def _header_len(path: str) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def _copy_tree(source: str, dest: str, *, skip: set[str]) -> None:
    """Copy ``source`` (a folder, or the folder of a file/index) minus ``skip``."""
    root = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    os.makedirs(dest, exist_ok=True)
    if not os.path.isdir(source):
        return  # an index: only its shards and the index itself are written
    for dirpath, _, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        os.makedirs(os.path.join(dest, rel), exist_ok=True)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.abspath(p) in skip:
                continue
            shutil.copy2(p, os.path.join(dest, rel, name))
