"""``decode_to_file``: Wan latents → a video file, with the GPU never waiting on the writer."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nostall.errors import ArgumentError, LatentsError, SinkError
from nostall.memory.pool import PinnedPool
from nostall.video.pipeline import (
    AsyncFramePipeline,
    FrameStats,
    Progress,
    SyncFramePipeline,
    close_iter,
)
from nostall.video.sinks import FrameSink, sink_for_path
from nostall.video.wan import frame_count, open_chunks

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan

__all__ = ["DecodeResult", "check_one_video", "decode_to_file", "submit_decode"]


@dataclass(frozen=True)
class DecodeResult:
    """Where the video went, how many frames, and the pipeline's timings.

    ``close_s`` is the time spent closing the sink after the last frame was handed to
    it: for MP4, the encoder's delayed frames (x264 look-ahead), the container trailer
    and the rename into place. ``degraded`` has one sentence per fallback from the
    decoder ``mode`` asked for (``"fast"`` without a GPU ran ``"exact"``; a decoder
    ``"exact"`` cannot run ran ``"eager"``): what was asked, what ran, and why. Empty
    when the mode asked for ran.
    """

    path: str
    frames: int
    fps: float
    stats: FrameStats
    degraded: tuple[str, ...] = ()

    @property
    def close_s(self) -> float:
        return self.stats.close_s


def decode_to_file(
    vae: AutoencoderKLWan,
    latents: torch.Tensor,
    path: str | os.PathLike,
    *,
    fps: float = 16,
    sync: bool = False,
    preset: str = "veryfast",
    crf: int = 23,
    threads: int = 0,
    pool: PinnedPool | None = None,
    progress: Progress | None = None,
    pipeline: Any = None,
    mode: str = "eager",
    devices: Sequence[str | torch.device] | None = None,
    strict: bool = False,
) -> DecodeResult:
    """Decode Wan ``latents`` chunk by chunk and write the frames to ``path``.

    ``latents`` are what ``vae.decode`` takes: ``(1, C, T, h, w)``, already
    de-normalised (see :func:`nostall.video.wan.denormalize`). The sink follows the
    suffix: ``.mp4`` (H.264 through PyAV, ``preset``/``crf``/``threads``), ``.npy``
    (uint8 ``(frames, H, W, 3)``), ``.y4m``, or a folder for PNG frames. The file is
    written under a temporary name and renamed when complete; on any error (bad
    latents, a sink failure, an interrupt, fewer frames than the latents make) nothing
    is left under either name. Everything is checked before the first decode: the
    output path and options, then the VAE and the latents
    (:func:`~nostall.video.wan.check_latents`: shape, the VAE's dtype and device, no
    NaN/inf).

    ``mode`` picks the decoder's forward (see :func:`~nostall.video.wan.decode_chunks`):
    ``"eager"`` (``vae.decoder`` as is) or ``"exact"`` (bit-identical frames, fewer
    passes over memory). ``devices`` (exact only) splits the decoder over two or more
    GPUs, the VAE's first; the frames leave from the last one (an own pipeline is made
    there; a given ``pipeline`` must be on it). Where the mode asked for cannot run, the
    decode falls back and :attr:`DecodeResult.degraded` says so; ``strict=True`` raises
    :class:`~nostall.DegradedError` instead, before anything is written.

    ``sync=True`` runs the one-thread baseline (decode, blocking copy, write) instead
    of the asynchronous pipeline. ``pipeline`` reuses an open pipeline (its streams,
    buffers and thread) across calls.

    >>> from nostall.video import decode_to_file
    >>> decode_to_file(vae, z, "out.mp4", fps=16)  # doctest: +SKIP
    DecodeResult(path='out.mp4', frames=81, ...)
    """
    _check_pipeline_device(pipeline, devices)
    own = pipeline is None
    sink, chunks, degraded, total = _open(
        vae, latents, path, mode, devices, strict, fps=fps, preset=preset, crf=crf, threads=threads
    )
    try:  # (at once: an interrupt before it leaves the sink to its finalizer)
        with sink:  # an exception aborts the sink: nothing under either name
            if own:
                kind = SyncFramePipeline if sync else AsyncFramePipeline
                out_device = torch.device(devices[-1]) if devices else latents.device
                pipeline = kind(device=out_device, pool=pool)
            stats = pipeline.run(chunks, sink, progress=progress)
            # Before close(): a short video must never be renamed into place.
            if stats.frames != total:
                raise _frame_count_error(sink.path, stats.frames, total, latents)
            t = time.perf_counter()
            sink.close()
            stats.close_s = time.perf_counter() - t
    finally:
        close_iter(chunks)  # a no-op once run() consumed it
        if own and pipeline is not None:
            pipeline.close()
    return DecodeResult(os.fspath(path), stats.frames, fps, stats, degraded)


def submit_decode(
    vae: AutoencoderKLWan,
    latents: torch.Tensor,
    path: str | os.PathLike,
    *,
    pipeline: AsyncFramePipeline,
    fps: float = 16,
    preset: str = "veryfast",
    crf: int = 23,
    threads: int = 0,
    progress: Progress | None = None,
    mode: str = "eager",
    devices: Sequence[str | torch.device] | None = None,
    strict: bool = False,
) -> Future[DecodeResult]:
    """Like :func:`decode_to_file`, but return once the GPU work is launched.

    The last chunks are written and the file is finished (for MP4, x264's look-ahead
    frames encoded, ~0.16 s at 720p) by ``pipeline``'s worker thread while the caller
    goes on, typically to decode the next video: back to back, the GPU never waits
    for an encoder to flush. The returned future resolves to the :class:`DecodeResult`
    once the file is complete under its final name, or raises
    :class:`~nostall.SinkError` with nothing left behind. Bad latents or a bad path
    raise here, before any GPU work. Keep ``pipeline`` open until the futures are
    done (its ``close()`` waits for them).

    >>> with AsyncFramePipeline() as pipe:  # doctest: +SKIP
    ...     futures = [submit_decode(vae, z, f"{i}.mp4", pipeline=pipe) for i, z in enumerate(zs)]
    ...     results = [f.result() for f in futures]
    """
    if not isinstance(pipeline, AsyncFramePipeline):
        raise TypeError(
            f"submit_decode needs an open AsyncFramePipeline (it finishes the file on the "
            f"pipeline's writer thread), got {type(pipeline).__name__}; use decode_to_file "
            f"for the synchronous baseline"
        )
    _check_pipeline_device(pipeline, devices)
    sink, chunks, degraded, total = _open(
        vae, latents, path, mode, devices, strict, fps=fps, preset=preset, crf=crf, threads=threads
    )
    # The pipeline owns the sink from the call on (it aborts it on any failure); the worker
    # checks the count before it closes the sink (see AsyncFramePipeline.submit).
    done = pipeline.submit(chunks, sink, progress=progress, frames=total)
    result: Future[DecodeResult] = Future()
    result.set_running_or_notify_cancel()
    where = os.fspath(path)

    def settle(f: Future[FrameStats]) -> None:
        err = f.exception()
        if err is not None:
            result.set_exception(err)
            return
        stats = f.result()
        result.set_result(DecodeResult(where, stats.frames, fps, stats, degraded))

    done.add_done_callback(settle)
    return result


def _check_pipeline_device(pipeline: Any, devices: Sequence | None) -> None:
    if pipeline is None or not devices:
        return
    out = torch.device(devices[-1])
    got = getattr(pipeline, "device", None)
    if got is not None and torch.device(got) != out:
        raise ArgumentError(
            f"the frames of devices={[str(d) for d in devices]} leave from {out}, but the "
            f"pipeline given is on {got}; open it with device={str(out)!r}"
        )


def _open(
    vae: AutoencoderKLWan,
    latents: torch.Tensor,
    path: str | os.PathLike,
    mode: str,
    devices: Sequence[str | torch.device] | None,
    strict: bool,
    **options: Any,
) -> tuple[FrameSink, Iterator[torch.Tensor], tuple[str, ...], int]:
    """The sink, the (not yet started) chunk generator, the mode's fallbacks and the frames
    the latents make, everything checked first. The sink is the caller's once this returns
    (an interrupt before its ``try`` leaves the sink to its finalizer)."""
    sink = None
    try:
        sink = sink_for_path(path, **options)  # checks path and options before creating a file
        # Checks the VAE and latents now and decodes lazily. The NaN check waits for the
        # GPU; the sink is opened before it so that, back to back, little host work sits
        # between the previous video's last kernel and this one's first.
        check_one_video(latents)
        chunks, degraded = open_chunks(vae, latents, mode=mode, devices=devices, strict=strict)
        return sink, chunks, degraded, frame_count(int(latents.shape[2]))
    except BaseException:
        if sink is not None:
            sink.abort()
        raise


def check_one_video(latents: torch.Tensor) -> None:
    """Raise :class:`~nostall.LatentsError` unless ``latents`` are one video
    (``(1, C, T, h, w)``): a file holds one, and the frames of a batch would interleave."""
    shape = tuple(getattr(latents, "shape", ()))
    if len(shape) == 5 and shape[0] != 1:
        raise LatentsError(
            f"latents hold a batch of {shape[0]} videos (shape {shape}), and a video file "
            "holds one, (1, C, T, h, w): split the batch, one video per file (z.split(1); "
            "for nostall decode, one latents file per video: for i, one in "
            "enumerate(z.split(1)): torch.save(one, f'clip{i}.pt'))"
        )


def _frame_count_error(
    path: str | None, got: int, expected: int, latents: torch.Tensor
) -> SinkError:
    return SinkError(
        f"the decoder produced {got} frames but latents of shape {tuple(latents.shape)} make "
        f"{expected}; the output was discarded, not finished. This is a bug in nostall or an "
        f"unexpected VAE: please report it with the VAE's config",
        path=path,
    )
