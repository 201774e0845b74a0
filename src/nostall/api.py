"""The top-level calls: ``load_state_dict`` and ``load_model``."""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import time

import torch
from torch import nn

from nostall.errors import CheckpointError
from nostall.memory.pool import PinnedPool
from nostall.store import resolve
from nostall.transfer.loader import Loader, LoadStats

__all__ = ["default_loader", "load_model", "load_model_with_stats", "load_state_dict"]

_default: Loader | None = None
_default_lock = threading.Lock()


def default_loader() -> Loader:
    """The process-wide :class:`Loader` behind :func:`load_state_dict`.

    Created on first use (never at import), closed at interpreter exit. It owns
    reader threads and, after the first GPU load without a pool, a small pinned
    staging ring, so one-shot loads never pay for pinning gigabytes. Services
    that want to own these resources create their own :class:`Loader`.
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = Loader()
            atexit.register(_default.close)
        return _default


def local_source(path, cache_dir=None):
    """``path``, with an ``s3://`` URL mirrored first (:func:`nostall.store.digest_index.local_source`)."""
    from nostall.store.digest_index import local_source as mirrored

    return mirrored(path, cache_dir)


def load_state_dict(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    pool: PinnedPool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors checkpoint onto ``device``.

    ``path`` is a ``.safetensors`` file, a ``.safetensors.index.json`` of shards, or a
    diffusers/transformers component folder, local or in object storage
    (``s3://bucket/key``: ranged GETs on many connections straight into host memory,
    endpoint and credentials from the standard AWS variables; ``cache_dir`` keeps a
    disk copy for the next process, see :func:`~nostall.store.digest_index.local_source`). Reader threads fill host memory and
    each chunk is copied to the GPU as soon as it lands; the tensors are views into
    one flat device allocation per checkpoint. ``dtype`` casts floating tensors
    (fp16/bf16/fp32/fp64; fp8 and integers are kept) on the device after the copy.

    With a ``pool``, the bytes land in a pinned pool block and stay cached there:
    loading the same files again is one host→device copy. The cached bytes are never
    handed out, so nothing a caller does to its tensors (a LoRA fuse, an optimizer
    step) can change what a later load serves: on ``device="cpu"`` the tensors are a
    private copy of the block (one host memcpy: 4.8 GB/s on one thread, 31 GB/s on 16,
    measured on our H200 host — the price of an immutable cache; load without a pool
    to skip it). Without a pool, CPU
    tensors own fresh page-aligned memory. The cache key is the files' path, device,
    inode, size, mtime and ctime, so a file rewritten in place is read again.

    Raises :class:`~nostall.CheckpointError` for malformed or incomplete checkpoints,
    :class:`~nostall.ReadError` when a read fails, :class:`~nostall.PoolExhausted`
    when the pool cannot hold the checkpoint, :class:`~nostall.DeviceError` for an
    unusable device.

    >>> import nostall, torch
    >>> sd = nostall.load_state_dict("flux/transformer", device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> pool = nostall.PinnedPool(64 << 30)  # doctest: +SKIP
    >>> sd = nostall.load_state_dict("flux/transformer", device="cuda", pool=pool)  # doctest: +SKIP
    """
    path = local_source(path, cache_dir)
    return default_loader().load(path, device=device, dtype=dtype, pool=pool).tensors


def load_model(
    path: str | os.PathLike,
    model_cls: type[nn.Module] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    pool: PinnedPool | None = None,
    strict: bool = True,
    variant: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> nn.Module:
    """Build a diffusers or transformers module from a component folder, skipping init.

    The module is constructed on the ``meta`` device (no weight is initialised or
    allocated), then adopts the loaded tensors as its parameters without a copy.
    ``model_cls`` defaults to the class named in ``config.json`` (``_class_name``
    for diffusers, ``architectures`` for transformers). Missing, unexpected and
    mis-shaped tensors are reported together in one :class:`~nostall.ModelMismatchError`.

    FP8 checkpoints (``nostall quantize``'s, or "scaled FP8" files) load as they are:
    linear weights stay e4m3 with their scales, and compute by upcasting per call
    (:mod:`nostall.quant.modules`); ``dtype`` casts only the other tensors.

    Process-wide effect: the cyclic garbage collector is paused while the headers, the
    module and its parameters are made (not during the reads), as
    :func:`~nostall.assemble.gc_paused` says.

    >>> import nostall, torch
    >>> vae = nostall.load_model("sdxl/vae", device="cuda", dtype=torch.float16)  # doctest: +SKIP

    ``path`` may be in object storage (``s3://bucket/sdxl/vae``), as for
    :func:`load_state_dict`.
    """
    return load_model_with_stats(
        local_source(path, cache_dir),
        model_cls,
        device=device,
        dtype=dtype,
        pool=pool,
        strict=strict,
        variant=variant,
    )[0]


def load_model_with_stats(
    path: str | os.PathLike,
    model_cls: type[nn.Module] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    pool: PinnedPool | None = None,
    strict: bool = True,
    variant: str | None = None,
    loader: Loader | None = None,
) -> tuple[nn.Module, LoadStats]:
    """:func:`load_model`, also returning the phase timings (``build_s`` included)."""
    from nostall.assemble import (
        adopt,
        as_stored_dtypes,
        build_empty,
        gc_paused,
        resolve_model_class,
        target_dtypes,
    )

    # Paused while the Python objects are made (headers, module, parameters), not across
    # the reads, which allocate little and may take minutes from object storage: what
    # they make is not garbage yet, so collecting only costs time (see gc_paused).
    with gc_paused():
        path = local_source(path)
        ckpt = resolve(path, variant=variant)
        folder = ckpt.folder or os.path.dirname(os.path.abspath(ckpt.files[0].path))
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise CheckpointError(
                "no config.json beside the weights, so the module cannot be built; pass the "
                "component folder (config.json + weights)",
                path=folder,
            )
        cls = model_cls or resolve_model_class(folder)
        t0 = time.perf_counter()
        module = build_empty(cls, folder, dtype=dtype)
        build_s = time.perf_counter() - t0
        # Per-tensor dtypes: the library's own from_pretrained keeps some modules in fp32.
        if dtype is not None:
            casts = target_dtypes(module, dtype)
        else:  # as stored, but what diffusers keeps in float32 (as_stored_dtypes)
            casts = as_stored_dtypes(module, {e.name: e.dtype for _, e in ckpt.entries()})
        fp8 = {e.name for _, e in ckpt.entries() if e.dtype.startswith("F8")}
        if casts and fp8:
            # FP8 weights stay FP8 (a plain cast would drop their scales)
            casts = {k: v for k, v in casts.items() if k not in fp8}
    result = (loader or default_loader()).load(ckpt, device=device, dtype=casts, pool=pool)
    with gc_paused():
        t0 = time.perf_counter()
        tensors, scales = result.tensors, {}
        if fp8:
            from nostall.quant.modules import install_fp8, prepare_fp8

            metadata = {k: v for f in ckpt.files for k, v in f.metadata.items()}
            tensors, scales = prepare_fp8(tensors, metadata, path=folder)
        module = adopt(module, tensors, strict=strict, path=folder)
        if scales:
            install_fp8(module, scales, path=folder)
        build_s += time.perf_counter() - t0
    stats = dataclasses.replace(
        result.stats, build_s=build_s, total_s=result.stats.total_s + build_s
    )
    return module, stats
