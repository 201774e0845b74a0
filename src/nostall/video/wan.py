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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from nostall.errors import LatentsError

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan

__all__ = ["check_latents", "decode_chunks", "denormalize", "frame_count"]

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
        raise ValueError(
            f"latent_frames must be >= 1 (a Wan video has at least one latent frame), "
            f"got {latent_frames}"
        )
    return 1 + _TEMPORAL_FACTOR * (latent_frames - 1)


def check_latents(vae: AutoencoderKLWan, z: torch.Tensor) -> None:
    """Raise :class:`LatentsError` unless ``z`` can be decoded by ``vae``.

    ``z`` must be a floating-point 5-D tensor ``(B, C, T, h, w)`` with ``C ==
    vae.config.z_dim`` (16 for Wan 2.1, 48 for the Wan 2.2 5B VAE) and no empty dimension.

    Example::

        >>> check_latents(vae, torch.zeros(1, 16, 21, 60, 104))   # fine: returns None
        >>> check_latents(vae, torch.zeros(16, 21, 60, 104))
        Traceback (most recent call last):
        nostall.errors.LatentsError: latents must be 5-D (B, C, T, h, w) = (B, 16, T, h, w); ...
    """
    z_dim = int(vae.config.z_dim)
    expected = f"(B, {z_dim}, T, h, w)"
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
    if shape[1] != z_dim:
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


def denormalize(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """Undo the per-channel latent normalisation: ``latents * std + mean``.

    ``mean``/``std`` come from ``vae.config.latents_mean`` / ``latents_std``, broadcast as
    ``(1, C, 1, 1, 1)`` in the latents' dtype and device; the result is what
    ``vae.decode`` expects.

    The arithmetic is spelled exactly as in diffusers' ``WanPipeline``
    (``latents / (1 / std) + mean``, rounded in the latents' dtype) rather than
    ``latents * std + mean``, so pipeline output and nostall output stay bit-identical.

    Example::

        >>> z = denormalize(vae, latents)           # latents: (1, 16, 21, 60, 104)
        >>> video = vae.decode(z).sample
    """
    check_latents(vae, latents)
    c = int(vae.config.z_dim)
    mean = getattr(vae.config, "latents_mean", None)
    std = getattr(vae.config, "latents_std", None)
    if mean is None or std is None or len(mean) != c or len(std) != c:
        raise LatentsError(
            f"vae.config.latents_mean / latents_std must each hold z_dim={c} values, got "
            f"{None if mean is None else len(mean)} and {None if std is None else len(std)}; "
            f"load the VAE config that matches the checkpoint"
        )
    mean_t = torch.tensor(mean).view(1, c, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(std).view(1, c, 1, 1, 1).to(latents.device, latents.dtype)
    return latents / inv_std + mean_t


def decode_chunks(vae: AutoencoderKLWan, z: torch.Tensor) -> Iterator[torch.Tensor]:
    """Decode Wan latents one latent frame at a time, yielding video chunks.

    Yields ``(B, 3, t, H, W)`` tensors in ``[-1, 1]`` (already unpatchified and clamped
    like ``vae.decode``), with ``t = 1`` for the first latent frame and ``t = 4`` for
    each later one; ``torch.cat(list(decode_chunks(vae, z)), dim=2)`` equals
    ``vae.decode(z).sample`` bit for bit. ``z`` is the *denormalized* latent (see
    :func:`denormalize`). Runs without autograd; the caller's grad mode is untouched.

    The latents are checked now (:class:`LatentsError`), not at the first ``next()``.
    Spatial tiling (``vae.enable_tiling()``) that would actually split these latents is
    not supported and raises ``NotImplementedError``: disable tiling for the streaming
    path (memory is already bounded by one chunk) or call ``vae.decode``.

    The decoder's feature cache lives in this generator, not in the VAE, so generators
    over the same VAE do not interfere; it is released when the generator finishes, is
    closed early, or fails. Only one chunk is held by the generator at a time: drop or
    move each chunk before asking for the next to keep device memory flat.

    Example::

        >>> for chunk in decode_chunks(vae, z):   # z: (1, 16, 21, 60, 104)
        ...     print(tuple(chunk.shape))
        (1, 3, 1, 480, 832)
        (1, 3, 4, 480, 832)
        ...
    """
    internals = _WanInternals(vae)
    check_latents(vae, z)
    if internals.would_tile(z):
        h, w = z.shape[-2:]
        raise NotImplementedError(
            f"decode_chunks does not support spatial tiling, and vae.use_tiling is on with "
            f"latents of {h}x{w} (larger than the {internals.tile_latent_size()} tile), so "
            f"vae.decode would tile them. Call vae.disable_tiling() before streaming (one "
            f"chunk at a time already bounds memory), or decode with vae.decode(z)"
        )
    return _decode_chunks(internals, z)


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
#
# If diffusers changes _decode, the bit-equality tests in tests/video/test_wan.py fail.
# ---------------------------------------------------------------------------------------

_TESTED_DIFFUSERS = "0.42.1"


class _WanInternals:
    """Checked access to the private parts of ``AutoencoderKLWan`` that chunking needs."""

    def __init__(self, vae: AutoencoderKLWan) -> None:
        try:
            from diffusers.models.autoencoders import autoencoder_kl_wan as wan_module
        except ImportError as e:
            raise self._incompatible("diffusers.models.autoencoders.autoencoder_kl_wan") from e
        missing = [n for n in ("AutoencoderKLWan", "WanCausalConv3d") if not hasattr(wan_module, n)]
        if missing:
            raise self._incompatible(", ".join(missing))
        if not isinstance(vae, wan_module.AutoencoderKLWan):
            raise TypeError(
                f"decode_chunks needs a diffusers AutoencoderKLWan (the Wan 2.1 / 2.2 VAE), "
                f"got {type(vae).__module__}.{type(vae).__name__}"
            )
        missing = [n for n in ("decoder", "post_quant_conv", "config") if not hasattr(vae, n)]
        if missing:
            raise self._incompatible(", ".join(f"vae.{n}" for n in missing))

        params = inspect.signature(vae.decoder.forward).parameters
        if "feat_cache" not in params or "feat_idx" not in params:
            raise self._incompatible("decoder.forward(feat_cache=, feat_idx=)")
        self._pass_first_chunk = "first_chunk" in params
        config = vae.config
        # Only residual (Wan 2.2) decoders use first_chunk: it trims the duplicated frames
        # of the first chunk's DupUp3D shortcut. Older diffusers lacked both.
        if getattr(config, "is_residual", False) and not self._pass_first_chunk:
            raise self._incompatible("decoder.forward(first_chunk=) for is_residual VAEs")
        self._patch_size: int | None = getattr(config, "patch_size", None)
        self._unpatchify = None
        if self._patch_size is not None:
            self._unpatchify = getattr(wan_module, "unpatchify", None)
            if self._unpatchify is None:
                raise self._incompatible("unpatchify (needed for patch_size VAEs)")

        self._vae = vae
        # One slot per causal conv, exactly as AutoencoderKLWan.clear_cache sizes _feat_map.
        conv = wan_module.WanCausalConv3d
        self._cache_slots = sum(isinstance(m, conv) for m in vae.decoder.modules())

    @staticmethod
    def _incompatible(what: str) -> RuntimeError:
        try:
            from diffusers import __version__ as version
        except ImportError:
            version = "(unknown version)"
        return RuntimeError(
            f"nostall.video.wan relies on diffusers' AutoencoderKLWan internals, and the "
            f"installed diffusers {version} lacks {what} (tested with "
            f"{_TESTED_DIFFUSERS}). Install a tested diffusers version, or decode with "
            f"vae.decode(z) instead of decode_chunks"
        )

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

    def new_cache(self) -> list[Any]:
        return [None] * self._cache_slots

    def post_quant(self, z: torch.Tensor) -> torch.Tensor:
        return self._vae.post_quant_conv(z)

    def decode_frame(self, x: torch.Tensor, cache: list[Any], *, first: bool) -> torch.Tensor:
        """One latent frame ``(b, C, 1, h, w)`` -> ``(b, 3, t, H, W)``, unpatchified, clamped."""
        kwargs: dict[str, Any] = {"feat_cache": cache, "feat_idx": [0]}
        if self._pass_first_chunk:
            kwargs["first_chunk"] = first
        out = self._vae.decoder(x, **kwargs)  # (b, 3 * p * p, t, H / p, W / p)
        if self._unpatchify is not None:
            out = self._unpatchify(out, patch_size=self._patch_size)  # (b, 3, t, H, W)
        return torch.clamp(out, min=-1.0, max=1.0)
