"""``decode_files``: latents files on disk → video files, every input checked before any decode.

What ``nostall decode`` does, as a library call: read each latents file, check all of
them (and every output path) before the first decode, move each to the VAE's device
and dtype, optionally de-normalise it, and decode the files back to back through one
pipeline, each finished on the writer thread while the next one decodes.
:func:`read_latents_files` checks the files before a VAE is even loaded, against the
channels its ``config.json`` names (:func:`vae_latent_channels`).

Example::

    vae = nostall.load_model("wan/vae", device="cuda", dtype=torch.bfloat16)
    outputs = output_paths(["a.pt", "b.pt"], "videos/", suffix=".mp4")
    results = decode_files(["a.pt", "b.pt"], vae, outputs, denormalize=True)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from nostall.errors import ArgumentError, LatentsError, UnsupportedError
from nostall.video.decode import DecodeResult, check_one_video, decode_to_file, submit_decode
from nostall.video.latents import load_latents
from nostall.video.pipeline import AsyncFramePipeline, SyncFramePipeline
from nostall.video.sinks import check_sink_path
from nostall.video.wan import (
    MODES,
    check_devices,
    check_latents,
    check_latents_data,
    frame_count,
    latents_stats,
    vae_placement,
)
from nostall.video.wan import (
    denormalize as denormalize_latents,
)

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan

__all__ = ["decode_files", "output_paths", "read_latents_files", "vae_latent_channels"]

log = logging.getLogger(__name__)

_MULTI_SUFFIXES = (".mp4", ".npy", ".y4m")

FilesProgress = Callable[[int, int], None]


def output_paths(
    latents: Sequence[str | os.PathLike], out: str | os.PathLike, *, suffix: str = ".mp4"
) -> list[str]:
    """Where :func:`decode_files` should write each of ``latents``.

    One latents file: ``[out]`` as given (a ``.mp4``, ``.npy``, ``.y4m`` or a PNG folder).
    Several: ``out`` must be an existing folder, and each output is named after its
    latents file with ``suffix`` (``.mp4``, ``.npy`` or ``.y4m``). Raises
    :class:`~nostall.ArgumentError` otherwise, or when two outputs would collide.

    Example::

        >>> import tempfile
        >>> videos = tempfile.TemporaryDirectory()   # several inputs: an existing folder
        >>> paths = output_paths(["runs/a.pt", "runs/b.pt"], videos.name, suffix=".npy")
        >>> [os.path.relpath(p, videos.name) for p in paths]
        ['a.npy', 'b.npy']
        >>> videos.cleanup()
    """
    paths = [os.fspath(p) for p in latents]
    out = os.fspath(out)
    if not paths:
        raise ArgumentError("no latents files were given; pass at least one")
    if len(paths) == 1:
        return [out]
    if not os.path.isdir(out):
        raise ArgumentError(
            f"with {len(paths)} latents files, the output must be an existing folder that "
            f"receives one file per input; {out!r} is not one (create it first)"
        )
    if suffix not in _MULTI_SUFFIXES:
        raise ArgumentError(
            f"the output suffix for several latents files must be one of "
            f"{', '.join(_MULTI_SUFFIXES)}, not {suffix!r}"
        )
    targets = [os.path.join(out, os.path.splitext(os.path.basename(p))[0] + suffix) for p in paths]
    _check_distinct(targets, paths)
    return targets


def decode_files(
    latents: Sequence[str | os.PathLike],
    vae: AutoencoderKLWan,
    outputs: Sequence[str | os.PathLike],
    *,
    denormalize: bool,
    sync: bool = False,
    fps: float = 16,
    preset: str = "veryfast",
    crf: int = 23,
    threads: int = 0,
    progress: FilesProgress | None = None,
    mode: str = "eager",
    devices: Sequence[str | torch.device] | None = None,
    strict: bool = False,
) -> list[DecodeResult]:
    """Decode each latents file to its output, back to back through one pipeline.

    ``latents`` are ``.safetensors``, ``.pt`` or ``.npy`` files of ``(1, C, T, h, w)``
    (see :func:`nostall.video.latents.load_latents`); ``outputs`` has one path per file
    (:func:`output_paths` makes them). Before anything is decoded, every output is
    checked (:func:`~nostall.video.sinks.check_sink_path`), then every latents file is
    read and checked against ``vae`` (one video, channels, shape, NaN/inf), so a bad third file
    costs no decode of the first two.

    ``denormalize`` has no default on purpose: latents saved by a pipeline with
    ``output_type="latent"`` are normalised and need ``denormalize=True``
    (``z * std + mean``), while latents taken where ``vae.decode`` is called already are
    not. The wrong choice silently gives wrong colours, so a warning is logged when a
    file's per-channel spread clearly says otherwise.

    Each file is moved to the VAE's device and dtype (:func:`vae_placement`) just
    before its decode. ``sync=True`` uses the one-thread baseline; ``mode`` is the
    decoder's forward (``"eager"``, ``"exact"`` or ``"fast"``, see
    :func:`~nostall.video.wan.decode_chunks`); a fallback from it is recorded in each
    result's ``degraded``, or with ``strict=True`` raises :class:`~nostall.DegradedError`
    before the first decode. ``devices`` splits an exact decoder over
    two or more GPUs (checked before any file is read). ``progress(done,
    total)`` is called with frame counts once all inputs are checked (``done == 0``)
    and as chunks are launched. Returns one :class:`DecodeResult` per file, in order;
    the first failure is raised after the files already submitted are finished.

    Example (a tiny Wan 2.1 VAE with random weights, one latents file to ``.npy``)::

        >>> import tempfile
        >>> from diffusers import AutoencoderKLWan
        >>> vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()
        >>> tmp = tempfile.TemporaryDirectory()
        >>> latents = os.path.join(tmp.name, "a.pt")
        >>> torch.save(torch.randn(1, 16, 3, 4, 4), latents)
        >>> [r.frames for r in decode_files([latents], vae, [os.path.join(tmp.name, "a.npy")], denormalize=True)]
        [9]
        >>> tmp.cleanup()

    With a real VAE on the GPU (not run here: it needs the model and CUDA)::

        >>> import nostall
        >>> vae = nostall.load_model("wan/vae", device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> [r.frames for r in decode_files(["a.pt"], vae, ["a.mp4"], denormalize=True)]  # doctest: +SKIP
        [81]
    """
    paths = [os.fspath(p) for p in latents]
    targets = [os.fspath(p) for p in outputs]
    if not isinstance(denormalize, bool):
        raise ArgumentError(
            f"denormalize must be True (latents saved by a pipeline with output_type="
            f"'latent') or False (latents as vae.decode takes them), got {denormalize!r}"
        )
    if not paths:
        raise ArgumentError("no latents files were given; pass at least one")
    if len(paths) != len(targets):
        raise ArgumentError(
            f"got {len(paths)} latents files but {len(targets)} outputs; give one output "
            f"per latents file (output_paths makes them)"
        )
    _check_distinct(targets, paths)
    if mode not in MODES:
        raise ArgumentError(f"mode={mode!r}; choose one of {', '.join(map(repr, MODES))}")
    if devices is not None:
        if mode != "exact":
            raise ArgumentError(f"devices={list(devices)!r} needs mode='exact', got {mode!r}")
        devices = check_devices(devices, vae_placement(vae)[0])
    options = {"fps": fps, "preset": preset, "crf": crf, "threads": threads}
    for target in targets:
        check_sink_path(target, **options)

    # Read and check every input before decoding any. Latents are small (38 MB for 161
    # frames of 720p in fp32) and stay on the host until their turn.
    host = [_load_checked(vae, p) for p in paths]
    for path, z in zip(paths, host, strict=True):
        _warn_if_normalisation_looks_wrong(vae, z, path, denormalize)
    total = sum(frame_count(int(z.shape[2])) for z in host)
    device, dtype = vae_placement(vae)
    done = 0

    def advance(frames: int) -> None:
        nonlocal done
        done += frames
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    kind = SyncFramePipeline if sync else AsyncFramePipeline
    results: list[DecodeResult] = []
    pending: list[Future[DecodeResult]] = []
    out_device = devices[-1] if devices else device
    with kind(device=out_device) as pipe, torch.inference_mode():
        for i, target in enumerate(targets):
            z = host[i].to(device=device, dtype=dtype)
            if denormalize:
                z = denormalize_latents(vae, z)
            if sync:
                results.append(
                    decode_to_file(
                        vae,
                        z,
                        target,
                        pipeline=pipe,
                        progress=advance,
                        mode=mode,
                        devices=devices,
                        strict=strict,
                        **options,
                    )
                )
            else:
                pending.append(
                    submit_decode(
                        vae,
                        z,
                        target,
                        pipeline=pipe,
                        progress=advance,
                        mode=mode,
                        devices=devices,
                        strict=strict,
                        **options,
                    )
                )
        # Leaving the with block would wait for them too; result() also raises failures.
        results += [f.result() for f in pending]
    return results


def _check_distinct(targets: list[str], sources: list[str]) -> None:
    seen: dict[str, str] = {}
    for target, source in zip(targets, sources, strict=True):
        key = os.path.normcase(os.path.abspath(target))
        if key in seen:
            raise ArgumentError(
                f"{seen[key]!r} and {source!r} would both be written to {target!r}; rename "
                f"one of the latents files or give distinct outputs"
            )
        seen[key] = source


def read_latents_files(
    latents: Sequence[str | os.PathLike], *, z_dim: int | None
) -> list[torch.Tensor]:
    """Read each latents file and check that it holds one video a VAE of ``z_dim``
    latent channels decodes: ``(1, z_dim, T, h, w)``, floating point, finite (``z_dim``
    ``None``: any channel count). Raises :class:`~nostall.LatentsError` naming the first
    file that does not, its shape and the fix; the tensors stay on the host.

    What ``nostall decode`` runs before it loads the VAE (``z_dim`` from
    :func:`vae_latent_channels`), so that a bad file costs no VAE load::

        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = os.path.join(tmp.name, "batch.pt")
        >>> torch.save(torch.zeros(2, 16, 3, 4, 4), path)
        >>> read_latents_files([path], z_dim=16)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        nostall.errors.LatentsError: .../batch.pt: latents hold a batch of 2 videos ...
        >>> tmp.cleanup()
    """
    out = []
    for path in map(os.fspath, latents):
        z = load_latents(path)
        try:
            check_latents_data(z, z_dim=z_dim)
            check_one_video(z)
        except LatentsError as e:
            raise LatentsError(f"{path}: {e}") from e
        out.append(z)
    return out


def vae_latent_channels(vae: str | os.PathLike) -> int | None:
    """The latent channels (``z_dim``) of the Wan VAE in folder ``vae`` (or beside the
    weights file ``vae``), read from its ``config.json`` without loading it; ``None``
    where there is no readable config (loading the VAE then says what is wrong).
    Raises :class:`~nostall.UnsupportedError` for a config of another VAE class.

    >>> vae_latent_channels("wan/vae")  # doctest: +SKIP
    16
    """
    vae = os.fspath(vae)
    folder = vae if os.path.isdir(vae) else os.path.dirname(os.path.abspath(vae))
    path = os.path.join(folder, "config.json")
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    cls = config.get("_class_name")
    if cls is not None and cls != "AutoencoderKLWan":
        raise UnsupportedError(
            f"{path}: names the VAE class {cls}; nostall decodes diffusers' AutoencoderKLWan "
            "(the Wan 2.1 / 2.2 VAE): give the Wan pipeline's vae folder"
        )
    z_dim = config.get("z_dim", 16)  # (AutoencoderKLWan's default)
    return z_dim if isinstance(z_dim, int) and not isinstance(z_dim, bool) else None


def _load_checked(vae: AutoencoderKLWan, path: str) -> torch.Tensor:
    z = load_latents(path)
    try:
        # Host-side: dtype and device are fixed by z.to(...) just before the decode.
        check_latents(vae, z, placement=False)
        check_one_video(z)
    except LatentsError as e:
        raise LatentsError(f"{path}: {e}") from e
    return z


def _warn_if_normalisation_looks_wrong(
    vae: AutoencoderKLWan, z: torch.Tensor, path: str, denormalize: bool
) -> None:
    looks = _looks_normalized(vae, z)
    if looks is None or looks == denormalize:
        return
    if denormalize:
        log.warning(
            "%s: these latents look already de-normalised (their per-channel spread matches "
            "vae.config.latents_std, not 1), yet denormalize was asked for; if the colours "
            "come out wrong, decode them without it (--no-denormalize)",
            path,
        )
    else:
        log.warning(
            "%s: these latents look normalised (per-channel std near 1, as a pipeline "
            "saves them with output_type='latent'), yet denormalize was not asked for; if "
            "the colours come out wrong, decode them with it (--denormalize)",
            path,
        )


def _looks_normalized(vae: AutoencoderKLWan, z: torch.Tensor) -> bool | None:
    """Whether ``z``'s per-channel spread says normalised (``True``) or not (``False``).

    Normalised latents have a per-channel standard deviation near 1; de-normalised ones
    near ``vae.config.latents_std`` (1.1-3.3 for Wan 2.1). The answer is the hypothesis
    whose mean absolute log-ratio is within a third of the distance between the two;
    ``None`` when neither is that close (flat videos, unusual content) or when the
    config cannot tell them apart. A hint for a warning, never a decision.

    Example (a tiny Wan 2.1 VAE; its config carries Wan 2.1's ``latents_std``)::

        >>> from diffusers import AutoencoderKLWan
        >>> vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
        >>> z = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        >>> _looks_normalized(vae, z), _looks_normalized(vae, denormalize_latents(vae, z))
        (True, False)
    """
    try:
        _, std = latents_stats(vae)
    except LatentsError:
        return None
    c = len(std)
    expected = torch.tensor(std, dtype=torch.float64).log()  # (C,)
    apart = float(expected.abs().mean())
    # Below ~0.3 (std within ~35% of 1 on average) the two overlap with real content.
    if apart < 0.3 or z.dim() != 5 or z.shape[1] != c or z[0, 0].numel() < 2:
        return None
    spread = z.detach().to("cpu", torch.float64).transpose(0, 1).reshape(c, -1).std(dim=1)
    if not bool((spread > 0).all()):
        return None
    log_spread = spread.log()
    # Both distances cannot be under apart / 3 at once: they sum to at least `apart`.
    if float(log_spread.abs().mean()) < apart / 3:
        return True
    if float((log_spread - expected).abs().mean()) < apart / 3:
        return False
    return None
