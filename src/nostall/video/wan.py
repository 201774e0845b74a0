"""Chunked temporal decoding for the Wan 2.1 / 2.2 video VAE (diffusers ``AutoencoderKLWan``).

``vae.decode(z)`` returns the whole video at once: for an 81-frame 720p clip that is a
~900 MB fp32 tensor on the GPU, produced in one burst at the end of the denoising loop.
The Wan decoder is causal in time and already runs one latent frame at a time inside
``decode``; :func:`decode_chunks` exposes that loop as a generator so the frames can be
converted, copied to the host and encoded while the next chunk decodes. Device memory
stays proportional to one chunk (plus the decoder's small per-layer feature cache).

The concatenated chunks are bit-identical to ``vae.decode(z).sample`` (same kernels on
the same inputs in the same order), so switching to the streaming path changes no pixel.

Example::

    z = denormalize(vae, latents)                  # what WanPipeline does before decode
    for chunk in decode_chunks(vae, z):            # (B, 3, t, H, W), t = 1, 4, 4, ...
        frames = to_uint8_frames(chunk)            # see nostall.video.frames
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from nostall.errors import (
    ArgumentError,
    DegradedError,
    DeviceError,
    LatentsError,
    UnsupportedError,
)
from nostall.video.exact import ExactDecoder, ExactState, FastDecoder, unsupported_reason
from nostall.video.kernels import triton_available

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan

__all__ = [
    "check_latents",
    "check_latents_data",
    "decode_chunks",
    "denormalize",
    "frame_count",
    "vae_placement",
]

log = logging.getLogger(__name__)

MODES = ("eager", "exact", "fast")

# Wan VAEs (2.1 and 2.2) compress time 4x: the first latent frame decodes to 1 frame,
# every later one to 4.
_TEMPORAL_FACTOR = 4


def frame_count(latent_frames: int) -> int:
    """Number of video frames a Wan VAE decodes from ``latent_frames`` latent frames.

    Example::

        >>> frame_count(21)   # the 81-frame Wan 2.1 default
        81
    """
    if isinstance(latent_frames, bool) or not isinstance(latent_frames, int):
        raise TypeError(f"latent_frames must be an int, got {type(latent_frames).__name__}")
    if latent_frames < 1:
        raise ArgumentError(
            f"latent_frames must be >= 1 (a Wan video has at least one latent frame), "
            f"got {latent_frames}"
        )
    return 1 + _TEMPORAL_FACTOR * (latent_frames - 1)


def check_latents(vae: AutoencoderKLWan, z: torch.Tensor, *, placement: bool = True) -> None:
    """Raise :class:`LatentsError` unless ``z`` can be decoded by ``vae``.

    ``z`` must be a floating-point 5-D tensor ``(B, C, T, h, w)`` with ``C ==
    vae.config.z_dim`` (16 for Wan 2.1, 48 for the Wan 2.2 5B VAE), no empty dimension,
    the dtype and device of the VAE's weights, and no NaN or inf (which would decode to
    a black or garbage video). ``placement=False`` skips the dtype and device
    comparison, for latents still on the host that will be moved with
    ``z.to(device=..., dtype=...)`` before decoding.

    ``vae`` must be diffusers' ``AutoencoderKLWan`` (or ``torch.compile`` of one):
    anything else raises :class:`~nostall.UnsupportedError` before its config is read.

    The NaN/inf check is one reduction over the latents (tens of MB at most); on a GPU
    it waits for the work that produced them.

    Example (a tiny Wan 2.1 VAE with random weights; a real one checks the same way)::

        >>> from diffusers import AutoencoderKLWan
        >>> vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()
        >>> check_latents(vae, torch.zeros(1, 16, 21, 60, 104))   # fine: returns None
        >>> check_latents(vae, torch.zeros(16, 21, 60, 104))
        Traceback (most recent call last):
        nostall.errors.LatentsError: latents must be 5-D (B, C, T, h, w) = (B, 16, T, h, w); ...
    """
    wan = _as_wan(vae)  # before vae.config is read: other objects may have no z_dim
    _check_shape(z, int(wan.config.z_dim))
    if placement:
        _check_placement(wan, z)
    _check_finite(z)


def check_latents_data(z: torch.Tensor, *, z_dim: int | None) -> None:
    """What :func:`check_latents` checks of the tensor itself, without a VAE: 5-D
    ``(B, z_dim, T, h, w)``, floating point, no empty dimension, no NaN or inf; for
    latents read before the VAE is loaded (``z_dim`` from its ``config.json``; ``None``:
    any channel count). Raises :class:`LatentsError`.

    >>> check_latents_data(torch.zeros(1, 16, 21, 60, 104), z_dim=16)   # fine: returns None
    """
    _check_shape(z, z_dim)
    _check_finite(z)


def _check_shape(z: Any, z_dim: int | None) -> None:
    expected = f"(B, {'C' if z_dim is None else z_dim}, T, h, w)"
    if not isinstance(z, torch.Tensor):
        raise LatentsError(
            f"latents must be a torch.Tensor of shape {expected}, got {type(z).__name__}"
        )
    shape = tuple(z.shape)
    if z.dim() != 5:
        hint = " (add the batch dimension with z.unsqueeze(0))" if z.dim() == 4 else ""
        raise LatentsError(
            f"latents must be 5-D (B, C, T, h, w) = {expected}; got shape {shape} "
            f"({z.dim()}-D){hint}"
        )
    if z_dim is not None and shape[1] != z_dim:
        raise LatentsError(
            f"latents have {shape[1]} channels but this VAE expects vae.config.z_dim={z_dim}: "
            f"got shape {shape}, expected {expected}. Wan 2.1 VAEs take 16 channels, the Wan 2.2 "
            f"5B VAE takes 48; check that the latents come from the matching transformer"
        )
    if not z.is_floating_point():
        raise LatentsError(
            f"latents must be floating point, got dtype {z.dtype} (shape {shape}); "
            f"cast them with z.to(vae.dtype)"
        )
    if shape[2] == 0:
        raise LatentsError(
            f"latents have no frames: got shape {shape}, expected {expected} with T >= 1"
        )
    if 0 in shape:
        raise LatentsError(
            f"latents have an empty dimension: got shape {shape}, expected {expected}"
        )


def vae_placement(vae: AutoencoderKLWan) -> tuple[torch.device | None, torch.dtype | None]:
    """The device and dtype latents must have to be decoded by ``vae``.

    Taken from the weight that first reads the latents (``post_quant_conv``). A VAE
    offloaded with accelerate (``enable_model_cpu_offload``) reports the device its
    hook runs it on. ``None`` where it cannot be told: weights on the meta device
    without a hook, or stored in a dtype that is only a storage format (float8 with
    diffusers' layerwise casting computes in another dtype).

    Example (a tiny Wan 2.1 VAE on the CPU; ``vae.to("cuda", torch.bfloat16)`` gives
    ``(device(type='cuda', index=0), torch.bfloat16)``)::

        >>> from diffusers import AutoencoderKLWan
        >>> vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()
        >>> vae_placement(vae)
        (device(type='cpu'), torch.float32)
    """
    weight, hooked = _first_weight(_as_wan(vae))
    if weight is None:
        return None, None
    device: torch.device | None = weight.device
    if hooked is not None:
        device = torch.device("cuda", hooked) if isinstance(hooked, int) else torch.device(hooked)
    elif weight.device.type == "meta":
        device = None
    dtype: torch.dtype | None = weight.dtype
    if not weight.is_floating_point() or weight.element_size() < 2:
        dtype = None
    return device, dtype


def _check_placement(vae: AutoencoderKLWan, z: torch.Tensor) -> None:
    device, dtype = vae_placement(vae)
    wrong_device = device is not None and not _same_device(z.device, device)
    wrong_dtype = dtype is not None and z.dtype != dtype
    if not (wrong_device or wrong_dtype):
        return
    want_device = device if device is not None else z.device
    want_dtype = dtype if dtype is not None else z.dtype
    raise LatentsError(
        f"latents are {z.dtype} on {z.device}, but this VAE's weights are {want_dtype} on "
        f"{want_device}; vae.decode would fail on them. Move them first: "
        f"z = z.to(device={str(want_device)!r}, dtype={want_dtype})"
    )


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    # torch.device("cuda") means the current GPU; tensors always carry an index.
    if a.type == "cuda" and (a.index is None or b.index is None):
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (
            b.index if b.index is not None else current
        )
    return a.index == b.index


def _check_finite(z: torch.Tensor) -> None:
    # One elementwise pass and one reduction; .item() waits for the latents to exist.
    bad = z.numel() - int(torch.isfinite(z).sum().item())
    if bad == 0:
        return
    nan = int(torch.isnan(z).sum().item())  # failure path only
    raise LatentsError(
        f"latents hold {bad} non-finite values ({nan} NaN, {bad - nan} inf) out of "
        f"{z.numel()} (shape {tuple(z.shape)}, {z.dtype}); they would decode to a black or "
        f"garbage video. Look at the run that produced them: NaN usually comes from fp16 "
        f"overflow in the transformer (run it in bf16 or fp32), inf from casting large "
        f"values to fp16"
    )


def denormalize(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """Undo the per-channel latent normalisation: ``latents * std + mean``.

    ``mean``/``std`` come from ``vae.config.latents_mean`` / ``latents_std``, broadcast as
    ``(1, C, 1, 1, 1)`` in the latents' dtype and device; the result is what
    ``vae.decode`` expects. Only the shape is checked here; the decode that follows
    checks dtype, device and values.

    The arithmetic is spelled exactly as in diffusers' ``WanPipeline``
    (``latents / (1 / std) + mean``, rounded in the latents' dtype) rather than
    ``latents * std + mean``, so pipeline output and nostall output stay bit-identical.

    Example (a tiny Wan 2.1 VAE: 3 latent frames of 4×4 decode to 9 frames of 32×32)::

        >>> from diffusers import AutoencoderKLWan
        >>> vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()
        >>> latents = torch.randn(1, 16, 3, 4, 4)   # as a pipeline with output_type="latent" saves them
        >>> z = denormalize(vae, latents)
        >>> vae.decode(z).sample.shape
        torch.Size([1, 3, 9, 32, 32])
    """
    vae = _as_wan(vae)
    c = int(vae.config.z_dim)
    _check_shape(latents, c)
    mean, std = latents_stats(vae)
    mean_t = torch.tensor(mean).view(1, c, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(std).view(1, c, 1, 1, 1).to(latents.device, latents.dtype)
    return latents / inv_std + mean_t


def latents_stats(vae: AutoencoderKLWan) -> tuple[list[float], list[float]]:
    """``vae.config.latents_mean`` and ``latents_std``, checked against ``z_dim``."""
    c = int(vae.config.z_dim)
    mean = getattr(vae.config, "latents_mean", None)
    std = getattr(vae.config, "latents_std", None)
    if mean is None or std is None or len(mean) != c or len(std) != c:
        raise LatentsError(
            f"vae.config.latents_mean / latents_std must each hold z_dim={c} values, got "
            f"{None if mean is None else len(mean)} and {None if std is None else len(std)}; "
            f"load the VAE config that matches the checkpoint"
        )
    return [float(m) for m in mean], [float(s) for s in std]


def decode_chunks(
    vae: AutoencoderKLWan,
    z: torch.Tensor,
    *,
    mode: str = "eager",
    devices: Sequence[str | torch.device] | None = None,
    strict: bool = False,
) -> Iterator[torch.Tensor]:
    """Decode Wan latents one latent frame at a time, yielding video chunks.

    Yields ``(B, 3, t, H, W)`` tensors in ``[-1, 1]`` (already unpatchified and clamped
    like ``vae.decode``), with ``t = 1`` for the first latent frame and ``t = 4`` for
    each later one; ``torch.cat(list(decode_chunks(vae, z)), dim=2)`` equals
    ``vae.decode(z).sample`` bit for bit. ``z`` is the *denormalized* latent (see
    :func:`denormalize`). Runs without autograd; the caller's grad mode is untouched.

    ``vae`` is diffusers' ``AutoencoderKLWan``; anything else raises
    :class:`~nostall.UnsupportedError`. ``torch.compile(vae)`` is accepted: it compiles
    ``vae.forward`` only, so ``vae.decode`` runs the plain decoder, and so does this.
    A compiled decoder (``vae.decoder = torch.compile(vae.decoder)``) is called exactly
    as ``vae.decode`` calls it.

    ``mode``: ``"eager"`` calls ``vae.decoder`` as ``vae.decode`` does; ``"exact"`` runs
    the same modules and weights through nostall's forward (see :mod:`nostall.video.exact`):
    the same arithmetic, bit-identical frames, fewer passes over memory. A decoder that
    ``exact`` cannot run (a changed diffusers) decodes eagerly, said once in the log.
    ``"fast"`` (:class:`~nostall.video.exact.FastDecoder`): exact's forward with
    channels-last activations and weights, the norm fused further, and the steady chunk
    replayed as a CUDA graph; frames close to eager's but not bit-identical (the bench
    reports PSNR). It needs a CUDA GPU and Triton; elsewhere it runs ``exact``, said once.
    ``strict=True`` raises :class:`~nostall.DegradedError` instead of either fallback
    (:func:`~nostall.video.decode_to_file` also records them in its result).

    ``devices`` (``mode="exact"`` only): two or more CUDA GPUs, the first the one the VAE
    and the latents are on. The decoder runs as a pipeline of stages, one per GPU (see
    :class:`~nostall.video.exact.ExactDecoder`): frames bit-identical to one GPU, the
    chunks on the last GPU.

    The latents are checked now (:class:`LatentsError`), not at the first ``next()``.
    Spatial tiling (``vae.enable_tiling()``) that would actually split these latents is
    not supported and raises ``NotImplementedError``: disable tiling for the streaming
    path (memory is already bounded by one chunk) or call ``vae.decode``.

    The decoder's feature cache lives in this generator, not in the VAE, so generators
    over the same VAE do not interfere; it is released when the generator finishes, is
    closed early, or fails. Only one chunk is held by the generator at a time: drop or
    move each chunk before asking for the next to keep device memory flat.

    Example (a tiny Wan 2.1 VAE; Wan 2.1's real one turns ``(1, 16, 21, 60, 104)``
    latents into chunks of ``(1, 3, 1, 480, 832)``, then ``(1, 3, 4, 480, 832)``)::

        >>> from diffusers import AutoencoderKLWan
        >>> vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()
        >>> z = torch.randn(1, 16, 3, 4, 4)
        >>> with torch.inference_mode():
        ...     for chunk in decode_chunks(vae, z):
        ...         print(tuple(chunk.shape))
        (1, 3, 1, 32, 32)
        (1, 3, 4, 32, 32)
        (1, 3, 4, 32, 32)
    """
    return open_chunks(vae, z, mode=mode, devices=devices, strict=strict)[0]


def open_chunks(
    vae: AutoencoderKLWan,
    z: torch.Tensor,
    *,
    mode: str,
    devices: Sequence[str | torch.device] | None,
    strict: bool,
) -> tuple[Iterator[torch.Tensor], tuple[str, ...]]:
    """:func:`decode_chunks`, also returning a sentence per fallback from the mode asked."""
    internals = _WanInternals(vae, mode=mode, devices=devices, strict=strict)
    check_latents(vae, z)
    if internals.would_tile(z):
        h, w = z.shape[-2:]
        raise NotImplementedError(
            f"decode_chunks does not support spatial tiling, and vae.use_tiling is on with "
            f"latents of {h}x{w} (larger than the {internals.tile_latent_size()} tile), so "
            f"vae.decode would tile them. Call vae.disable_tiling() before streaming (one "
            f"chunk at a time already bounds memory), or decode with vae.decode(z)"
        )
    return _decode_chunks(internals, z), tuple(internals.degraded)


def _decode_chunks(internals: _WanInternals, z: torch.Tensor) -> Iterator[torch.Tensor]:
    internals.run_offload_hook()
    # vae.decode with use_slicing decodes each batch element separately; mirror that so
    # the kernels (and therefore the bits) match.
    groups = z.split(1) if internals.slicing(z) else (z,)
    caches = [internals.new_cache() for _ in groups]
    try:
        with torch.no_grad():
            # post_quant_conv is pointwise and runs on the whole latent in vae.decode; doing
            # the same keeps bit-equality and costs only latent-sized memory.
            xs = [internals.post_quant(g) for g in groups]  # (b, C, T, h, w) each
        for i in range(z.shape[2]):
            with torch.no_grad():
                parts = [
                    internals.decode_frame(x[:, :, i : i + 1], cache, first=(i == 0))
                    for x, cache in zip(xs, caches, strict=True)
                ]
                chunk = parts[0] if len(parts) == 1 else torch.cat(parts)  # (B, 3, t, H, W)
                del parts
            yield chunk
            # Release our reference before decoding the next chunk, so a consumer that has
            # already moved this one off the device does not pay for two chunks.
            del chunk
    finally:
        # In-place, because a traceback holding this frame would otherwise keep every
        # cached activation alive.
        for cache in caches:
            cache.clear()


# ---------------------------------------------------------------------------------------
# diffusers internals. Everything this module needs from AutoencoderKLWan's private
# implementation (written against diffusers 0.42.1) lives below; nothing above touches it.
#
#   vae.post_quant_conv(z)                         pointwise conv run before the decoder
#   vae.decoder(x, feat_cache=, feat_idx=, first_chunk=)
#                                                  one latent frame, causal feature cache
#   WanCausalConv3d                                one cache slot per instance in decoder
#   unpatchify(x, patch_size) + config.patch_size  Wan 2.2 5B: 12 -> 3 channels, 2x space
#   use_tiling / use_slicing / tile_sample_min_*   decide which path vae.decode takes
#   _hf_hook.pre_forward(vae)                      accelerate CPU offload, as decode does
#   _hf_hook.execution_device                      where an offloaded VAE runs
#   torch.compile's OptimizedModule._orig_mod      the module inside the wrapper
#
# If diffusers changes _decode, the bit-equality tests in tests/video/test_wan.py fail.
# ---------------------------------------------------------------------------------------

_TESTED_DIFFUSERS = "0.42.1"


_WARNED: set[str] = set()


def check_devices(
    devices: Sequence[str | torch.device], first: torch.device | None
) -> list[torch.device]:
    """``devices`` as distinct, existing CUDA devices, the first being ``first`` (where the
    VAE is); :class:`DeviceError` / :class:`ArgumentError` naming the one at fault."""
    if isinstance(devices, (str, torch.device)) or len(devices) < 2:
        raise ArgumentError(
            f"devices={devices!r}: give two or more GPUs, e.g. ['cuda:0', 'cuda:1'] (for one "
            "GPU, leave devices out)"
        )
    out: list[torch.device] = []
    for d in devices:
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as e:
            raise DeviceError(f"devices: {d!r} is not a device; use 'cuda:N'") from e
        if dev.type != "cuda" or dev.index is None:
            raise DeviceError(
                f"devices: {d!r} is not a CUDA GPU with an index; the decoder's stages run on "
                "'cuda:N' devices"
            )
        if dev in out:
            raise ArgumentError(f"devices: {dev} is given twice; give each GPU once")
        out.append(dev)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for dev in out:
        if dev.index >= count:
            raise DeviceError(f"devices: {dev} does not exist; {count} GPU(s) visible")
    if first is not None and out[0] != first:
        raise ArgumentError(
            f"devices[0] is {out[0]}, but the VAE is on {first}: the first stage runs where "
            f"the VAE and the latents are; put {first} first"
        )
    return out


def _warn_once(message: str) -> None:
    if message not in _WARNED:  # once per reason, not once per video
        _WARNED.add(message)
        log.warning("%s", message)


def _fast_missing(device: torch.device | None) -> str | None:
    """What ``fast`` mode lacks on ``device`` (``None``: nothing)."""
    if device is None or device.type != "cuda":
        return f"a CUDA GPU (the VAE is on {device})"
    if not triton_available(device):
        return "Triton (pip install triton)"
    if not torch.backends.cudnn.enabled:
        return "cuDNN (torch.backends.cudnn.enabled is False)"
    return None


def _exact_decoder(
    decoder: Any,
    wan_module: ModuleType,
    devices: list[torch.device] | None = None,
    *,
    fast: bool = False,
    asked: str = "exact",
    strict: bool = False,
    degraded: list[str] | None = None,
) -> ExactDecoder | None:
    """The decoder for ``exact``/``fast``, or ``None`` (decode eagerly) where nostall's
    forward cannot run it; that fallback is appended to ``degraded`` as a sentence."""
    why = unsupported_reason(decoder, wan_module)
    if why is not None and devices:
        raise UnsupportedError(
            f"mode='exact' cannot run this decoder ({why}), and only exact splits it over "
            f"devices={[str(d) for d in devices]}; decode on one GPU"
        )
    if why is not None:
        if strict:
            raise DegradedError(
                f"mode={asked!r} was asked for with strict=True, but nostall's forward "
                f"cannot run this decoder ({why}); decode with mode='eager', or pass "
                "strict=False to decode eagerly and have the result say so",
                requested=f"mode={asked!r}",
                fallback="mode='eager'",
                reason=why,
            )
        if why not in _WARNED:  # once per reason, not once per video
            _WARNED.add(why)
            log.warning("mode='exact' cannot run this decoder (%s); decoding eagerly", why)
        if degraded is not None:
            degraded.append(
                f"mode={asked!r} was asked for, but nostall's forward cannot run this decoder "
                f"({why}); it was decoded with mode='eager' (vae.decoder as is) instead"
            )
        return None
    if fast:
        return FastDecoder(decoder, wan_module)
    return ExactDecoder(decoder, wan_module, devices=devices)


def _wan_module() -> ModuleType:
    try:
        from diffusers.models.autoencoders import autoencoder_kl_wan as wan_module
    except ImportError as e:
        raise _incompatible("diffusers.models.autoencoders.autoencoder_kl_wan") from e
    missing = [n for n in ("AutoencoderKLWan", "WanCausalConv3d") if not hasattr(wan_module, n)]
    if missing:
        raise _incompatible(", ".join(missing))
    return wan_module


def _first_weight(vae: AutoencoderKLWan) -> tuple[torch.Tensor | None, Any]:
    """The weight that first reads the latents, and an accelerate hook's execution device."""
    conv = getattr(vae, "post_quant_conv", None)
    weight = getattr(conv, "weight", None)
    if not isinstance(weight, torch.Tensor):
        weight = next(vae.parameters(), None)
    # enable_model_cpu_offload hooks the VAE; sequential offload hooks each leaf module.
    for module in (vae, conv):
        hooked = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if hooked is not None:
            return weight, hooked
    return weight, None


def _compiled_original(module: Any) -> Any:
    """The module inside ``torch.compile(module)``'s wrapper, or ``None`` if not wrapped."""
    # An OptimizedModule can only exist once torch._dynamo is imported; importing it
    # here just to find out would cost a second.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is not None and isinstance(module, wrapper):
        return module._orig_mod
    return None


def _as_wan(vae: Any) -> AutoencoderKLWan:
    """``vae`` itself, or the module inside ``torch.compile(vae)``; UnsupportedError otherwise."""
    wan_module = _wan_module()
    inner = vae
    # torch.compile(vae) compiles vae.forward (encode + decode) only; vae.decode, through
    # the wrapper, runs the original module. Unwrapping therefore decodes exactly as
    # vae.decode does, bit for bit.
    while (orig := _compiled_original(inner)) is not None:
        inner = orig
    if not isinstance(inner, wan_module.AutoencoderKLWan):
        found = f"{type(inner).__module__}.{type(inner).__qualname__}"
        if inner is not vae:
            found = f"torch.compile of {found}"
        raise UnsupportedError(
            f"nostall.video decodes diffusers' AutoencoderKLWan (the Wan 2.1 / 2.2 VAE, or "
            f"torch.compile of one) and nothing else; got {found}. Load the Wan VAE with "
            f"AutoencoderKLWan.from_pretrained(..., subfolder='vae') or "
            f"nostall.load_model(folder), or decode other VAEs with vae.decode(z)"
        )
    return inner


def _incompatible(what: str) -> UnsupportedError:
    try:
        from diffusers import __version__ as version
    except ImportError:
        version = "(unknown version)"
    return UnsupportedError(
        f"nostall.video.wan relies on diffusers' AutoencoderKLWan internals, and the "
        f"installed diffusers {version} lacks {what} (tested with "
        f"{_TESTED_DIFFUSERS}). Install a tested diffusers version, or decode with "
        f"vae.decode(z) instead of decode_chunks"
    )


class _WanInternals:
    """Checked access to the private parts of ``AutoencoderKLWan`` that chunking needs."""

    def __init__(
        self,
        vae: AutoencoderKLWan,
        *,
        mode: str = "eager",
        devices: Sequence[str | torch.device] | None = None,
        strict: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ArgumentError(
                f"mode={mode!r}; choose one of {', '.join(map(repr, MODES))} (exact: "
                "bit-identical frames, faster; eager: vae.decoder as is)"
            )
        if devices is not None and mode != "exact":
            raise ArgumentError(
                f"devices={list(devices)!r} needs mode='exact' (the mode that splits the "
                f"decoder over GPUs); got mode={mode!r}"
            )
        wan_module = _wan_module()
        vae = _as_wan(vae)
        missing = [n for n in ("decoder", "post_quant_conv", "config") if not hasattr(vae, n)]
        if missing:
            raise _incompatible(", ".join(f"vae.{n}" for n in missing))

        # A compiled decoder's forward takes (*args, **kwargs); read the signature of the
        # module it wraps, and still call the compiled one, as vae.decode does.
        decoder = _compiled_original(vae.decoder) or vae.decoder
        params = inspect.signature(decoder.forward).parameters
        if "feat_cache" not in params or "feat_idx" not in params:
            raise _incompatible("decoder.forward(feat_cache=, feat_idx=)")
        self._pass_first_chunk = "first_chunk" in params
        config = vae.config
        # Only residual (Wan 2.2) decoders use first_chunk: it trims the duplicated frames
        # of the first chunk's DupUp3D shortcut. Older diffusers lacked both.
        if getattr(config, "is_residual", False) and not self._pass_first_chunk:
            raise _incompatible("decoder.forward(first_chunk=) for is_residual VAEs")
        self._patch_size: int | None = getattr(config, "patch_size", None)
        self._unpatchify = None
        if self._patch_size is not None:
            self._unpatchify = getattr(wan_module, "unpatchify", None)
            if self._unpatchify is None:
                raise _incompatible("unpatchify (needed for patch_size VAEs)")

        self._vae = vae
        # One slot per causal conv, exactly as AutoencoderKLWan.clear_cache sizes _feat_map.
        conv = wan_module.WanCausalConv3d
        self._cache_slots = sum(isinstance(m, conv) for m in decoder.modules())
        self.mode = mode
        # The fallbacks from the mode asked for, one sentence each (DecodeResult.degraded).
        self.degraded: list[str] = []
        self._exact: ExactDecoder | None = None
        asked = mode
        if mode == "fast":
            missing = _fast_missing(vae_placement(vae)[0])
            if missing is not None:
                if strict:
                    raise DegradedError(
                        f"mode='fast' was asked for with strict=True, but it needs {missing}; "
                        "decode with mode='exact' (same frames as eager), or pass "
                        "strict=False to run exact and have the result say so",
                        requested="mode='fast'",
                        fallback="mode='exact'",
                        reason=f"needs {missing}",
                    )
                _warn_once(f"mode='fast' needs {missing}; decoding with mode='exact'")
                self.degraded.append(
                    f"mode='fast' was asked for, but it needs {missing}; it was decoded with "
                    "mode='exact' instead"
                )
                mode = self.mode = "exact"
        if mode in ("exact", "fast"):
            devs = None
            if devices is not None:
                devs = check_devices(devices, vae_placement(vae)[0])
            self._exact = _exact_decoder(
                decoder,
                wan_module,
                devs,
                fast=mode == "fast",
                asked=asked,
                strict=strict,
                degraded=self.degraded,
            )
            if self._exact is None:
                self.mode = "eager"

    def tile_latent_size(self) -> str:
        ratio = self._vae.spatial_compression_ratio
        return (
            f"{self._vae.tile_sample_min_height // ratio}x"
            f"{self._vae.tile_sample_min_width // ratio}"
        )

    def would_tile(self, z: torch.Tensor) -> bool:
        vae = self._vae
        if not getattr(vae, "use_tiling", False):
            return False
        # Same condition as AutoencoderKLWan._decode.
        ratio = vae.spatial_compression_ratio
        h, w = z.shape[-2:]
        return w > vae.tile_sample_min_width // ratio or h > vae.tile_sample_min_height // ratio

    def slicing(self, z: torch.Tensor) -> bool:
        return bool(getattr(self._vae, "use_slicing", False)) and z.shape[0] > 1

    def run_offload_hook(self) -> None:
        # vae.decode is wrapped in diffusers' apply_forward_hook, which moves a CPU-offloaded
        # VAE to the GPU; calling the decoder directly would skip that.
        hook = getattr(self._vae, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):
            hook.pre_forward(self._vae)

    def new_cache(self) -> list[Any] | ExactState:
        if self._exact is not None:
            return ExactState()
        return [None] * self._cache_slots

    def post_quant(self, z: torch.Tensor) -> torch.Tensor:
        return self._vae.post_quant_conv(z)

    def decode_frame(self, x: torch.Tensor, cache: list[Any], *, first: bool) -> torch.Tensor:
        """One latent frame ``(b, C, 1, h, w)`` -> ``(b, 3, t, H, W)``, unpatchified, clamped."""
        if self._exact is not None:
            out = self._exact.forward(x, cache, first=first)
        else:
            kwargs: dict[str, Any] = {"feat_cache": cache, "feat_idx": [0]}
            if self._pass_first_chunk:
                kwargs["first_chunk"] = first
            out = self._vae.decoder(x, **kwargs)  # (b, 3 * p * p, t, H / p, W / p)
        if self._unpatchify is not None:
            out = self._unpatchify(out, patch_size=self._patch_size)  # (b, 3, t, H, W)
        return torch.clamp(out, min=-1.0, max=1.0)
