"""The asynchronous frame pipeline: GPU chunks → host → sink, without stalling the GPU.

Done in one thread, every chunk costs the GPU a gap: it idles while the host copies
chunk N out and writes it, before chunk N+1 is launched. :class:`AsyncFramePipeline`
removes the gap with the design Synthesia/AWS measured at 99.9% kernel utilisation:

* the chunk's kernels run on the caller's (compute) stream; the chunk is converted to
  uint8 ``(t, H, W, 3)`` there, into one of **two device buffers**;
* its device→host copy runs on a dedicated **copy stream** into one of **two
  page-locked host buffers** (blocks of a :class:`~nostall.PinnedPool`);
* events order them: ``computed[i]`` (copy waits for it), ``copied[i]`` (the worker
  waits for it; the compute stream waits for it before reusing device buffer ``i``),
  and ``host_free[i]`` (set by the worker when the sink is done with host buffer ``i``);
* a **worker thread** hands host buffers to the sink, so the calling thread only
  launches kernels and schedules copies.

With two buffers the pipeline is bounded: a slow sink makes the caller wait for a host
buffer (back-pressure), so memory never grows with the video length. On a machine
without CUDA the same API runs with plain threads: the sink still writes chunk N while
chunk N+1 is computed.

:meth:`AsyncFramePipeline.run` returns when the last frame is written (the caller then
closes the sink). :meth:`AsyncFramePipeline.submit` returns as soon as the last chunk
is launched and hands the sink's close to the worker: an MP4's close encodes x264's
look-ahead frames (~0.16 s for 720p on 16 cores), which a service can overlap with
the next video's decode instead of leaving the GPU idle.

:class:`SyncFramePipeline` is the baseline with the same chunking, conversion and
sink: convert, blocking copy, write, next chunk.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import record_function

from nostall.errors import ClosedError, SinkError
from nostall.memory.pool import Block, PinnedPool
from nostall.video.frames import to_uint8_frames
from nostall.video.sinks import FrameSink

__all__ = ["AsyncFramePipeline", "FrameStats", "SyncFramePipeline", "drain"]

Convert = Callable[[torch.Tensor], torch.Tensor]
Progress = Callable[[int], None]

_BUFFERS = 2
# Room for two 4-frame 4K chunks (2 x 4 x 3840 x 2160 x 3 B = 199 MB); pinned once.
_DEFAULT_HOST_BYTES = 256 << 20
_STOP = object()


@dataclass
class FrameStats:
    """What one run moved and where the time went (seconds).

    Attributes:
        chunks, frames, bytes: what reached the sink.
        wall_s: the whole run, from the first chunk requested to the last frame written.
        producer_s: time the calling thread spent in the chunk iterator (launching work).
        backpressure_s: time the calling thread waited for a free host buffer.
        write_s: time spent inside ``sink.write`` (worker thread when asynchronous).
        copy_wait_s: time the writer waited for device→host copies to finish.
        close_s: time spent closing the sink (by the worker after
            :meth:`AsyncFramePipeline.submit`, or by ``decode_to_file``; ``run`` leaves
            closing to the caller and reports 0).
        chunk_log: ``(frames, write start, write end)`` per chunk, seconds from the start.
    """

    chunks: int = 0
    frames: int = 0
    bytes: int = 0
    wall_s: float = 0.0
    producer_s: float = 0.0
    backpressure_s: float = 0.0
    write_s: float = 0.0
    copy_wait_s: float = 0.0
    close_s: float = 0.0
    mode: str = ""
    chunk_log: list[tuple[int, float, float]] = field(
        default_factory=list
    )  # (frames, t_write0, t_write1)


class _Buffers:
    """Two host buffers (pool blocks, grown on demand) and two device buffers."""

    def __init__(self, pool: PinnedPool):
        self.pool = pool
        self.host: list[Block | None] = [None] * _BUFFERS
        self.device: list[torch.Tensor | None] = [None] * _BUFFERS

    def host_view(self, i: int, nbytes: int) -> torch.Tensor:
        block = self.host[i]
        if block is None or block.size < nbytes:
            # Slot i is free here (its host_free was set and its copy completed).
            if block is not None:
                block.release()
            self.host[i] = block = self.pool.allocate(nbytes)
        return block.tensor[:nbytes]

    def device_view(self, i: int, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self.device[i]
        if buf is None or buf.numel() < nbytes:
            # Reused across runs, maybe outside the caller's inference mode.
            with torch.inference_mode(False):
                buf = self.device[i] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def release(self) -> None:
        for i, block in enumerate(self.host):
            if block is not None:
                block.release()
                self.host[i] = None
        self.device = [None] * _BUFFERS


class _Run:
    """One video going through the pipeline: its sink, stats and failure state."""

    __slots__ = ("cancel", "error", "future", "sink", "stats", "t0")

    def __init__(self, sink: FrameSink, stats: FrameStats):
        self.sink, self.stats = sink, stats
        self.error: BaseException | None = None
        self.cancel = threading.Event()
        self.future: Future[FrameStats] | None = None
        self.t0 = time.perf_counter()


class _Job:
    __slots__ = ("event", "host", "run", "slot")

    def __init__(self, run: _Run, slot: int, host: torch.Tensor, event: Any):
        self.run, self.slot, self.host, self.event = run, slot, host, event


class _Close:
    """After a submitted run's last chunk: the worker closes the sink and settles the future."""

    __slots__ = ("run",)

    def __init__(self, run: _Run) -> None:
        self.run = run


class _Finish:
    """Marks the end of one run's jobs; the worker signals ``done`` when it gets here."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


class _PipelineBase:
    def __init__(
        self,
        *,
        device: str | torch.device | None = None,
        pool: PinnedPool | None = None,
        host_bytes: int = _DEFAULT_HOST_BYTES,
        convert: Convert = to_uint8_frames,
    ):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.convert = convert
        self._own_pool = pool is None
        self._pool = pool or PinnedPool(
            host_bytes, slab_bytes=host_bytes, pin=self.device.type == "cuda"
        )
        self._buffers = _Buffers(self._pool)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed; create a new one")

    def _frames(self, chunk: torch.Tensor) -> torch.Tensor:
        frames = self.convert(chunk)
        if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
            raise ValueError(
                f"convert() must return uint8 (t, H, W, 3) frames, got {frames.dtype} "
                f"{tuple(frames.shape)}"
            )
        return frames

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._buffers.release()
        if self._own_pool:
            self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncFramePipeline(_PipelineBase):
    """The baseline: convert chunk N, copy it to the host (blocking), write it, then ask
    for chunk N+1. The GPU idles during every copy and write. Options as for
    :class:`AsyncFramePipeline` (one host buffer is used).

    >>> with SyncFramePipeline(device="cpu") as pipe:  # doctest: +SKIP
    ...     stats = pipe.run(decode_chunks(vae, z), sink)
    """

    def run(
        self, chunks: Iterable[torch.Tensor], sink: FrameSink, *, progress: Progress | None = None
    ) -> FrameStats:
        """Write every chunk to ``sink`` in order; the caller closes the sink."""
        self._check_open()
        stats = FrameStats(mode="sync")
        t0 = time.perf_counter()
        it = iter(chunks)
        try:
            while True:
                with record_function(f"nostall.chunk.{stats.chunks}"):
                    t = time.perf_counter()
                    chunk = next(it, None)
                    stats.producer_s += time.perf_counter() - t
                    if chunk is None:
                        break
                    frames = self._frames(chunk)
                    host = self._buffers.host_view(0, frames.numel()).view(frames.shape)
                    host.copy_(frames)  # blocking: the GPU drains before the host goes on
                t = time.perf_counter()
                with record_function("nostall.write"):
                    sink.write(host.numpy())
                t1 = time.perf_counter()
                stats.write_s += t1 - t
                stats.chunk_log.append((frames.shape[0], t - t0, t1 - t0))
                stats.chunks += 1
                stats.frames += frames.shape[0]
                stats.bytes += frames.numel()
                if progress is not None:
                    progress(frames.shape[0])
        finally:
            _close_iter(it)
        stats.wall_s = time.perf_counter() - t0
        return stats


class AsyncFramePipeline(_PipelineBase):
    """Decode-side producer, copy stream, double buffers and a writer thread.

    The pipeline owns a copy stream, two device buffers, two host buffers (blocks of
    ``pool``, or of a private pool of ``host_bytes`` pinned once), the events between
    them and one worker thread; :meth:`close` joins the thread and returns the blocks.
    Host buffers are lent to the sink only for the duration of ``sink.write``.

    ``convert`` turns a produced chunk into uint8 ``(t, H, W, 3)`` on its device (the
    default maps ``(1, 3, t, H, W)`` in [-1, 1] like diffusers does).

    One thread drives a pipeline (calls to ``run``/``submit`` come from one thread).

    >>> with AsyncFramePipeline() as pipe, sink_for_path("out.mp4") as sink:  # doctest: +SKIP
    ...     stats = pipe.run(decode_chunks(vae, z), sink)
    """

    def __init__(
        self,
        *,
        device: str | torch.device | None = None,
        pool: PinnedPool | None = None,
        host_bytes: int = _DEFAULT_HOST_BYTES,
        convert: Convert = to_uint8_frames,
    ):
        super().__init__(device=device, pool=pool, host_bytes=host_bytes, convert=convert)
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device=self.device) if cuda else None
        # blocking=True: the worker sleeps in synchronize() instead of spinning on a CPU
        # that the encoder threads need.
        make = (lambda: torch.cuda.Event(blocking=True)) if cuda else (lambda: None)
        self._computed = [make() for _ in range(_BUFFERS)]
        self._copied = [make() for _ in range(_BUFFERS)]
        self._in_use = [False] * _BUFFERS  # slot i has a copy in flight or queued
        self._host_free = [threading.Event() for _ in range(_BUFFERS)]
        for e in self._host_free:
            e.set()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._work, name="nostall-frame-writer", daemon=True)
        self._worker.start()

    # ---- calling thread ----------------------------------------------------------

    def run(
        self, chunks: Iterable[torch.Tensor], sink: FrameSink, *, progress: Progress | None = None
    ) -> FrameStats:
        """Write every chunk to ``sink`` in order and wait until the last one is written.

        Raises the sink's error (as :class:`~nostall.SinkError`) promptly: the chunk
        iterator is closed (no further GPU work is launched) and the worker stops.
        The caller closes or aborts the sink.
        """
        self._check_open()
        run = _Run(sink, FrameStats(mode="async"))
        try:
            self._produce(run, chunks, progress)
            finish = _Finish()
            self._jobs.put(finish)
            while not finish.done.wait(0.05):
                self._raise_if_failed(run)
            self._raise_if_failed(run)
        except BaseException:
            self._abandon(run)
            raise
        run.stats.wall_s = time.perf_counter() - run.t0
        return run.stats

    def submit(
        self, chunks: Iterable[torch.Tensor], sink: FrameSink, *, progress: Progress | None = None
    ) -> Future[FrameStats]:
        """Launch every chunk, then return while the worker finishes and closes ``sink``.

        The pipeline owns ``sink`` from here on: do not write to, close or abort it.
        Returns once the last chunk is launched and queued for copying, so the caller
        can start the next video's GPU work at once; the returned future resolves to
        the run's :class:`FrameStats` when the file is complete under its final name,
        or raises :class:`~nostall.SinkError` (the partial output removed). An error
        seen while chunks are still being launched is raised here instead, with the
        sink aborted. Videos are written in submission order.

        >>> with AsyncFramePipeline() as pipe:  # doctest: +SKIP
        ...     done = [pipe.submit(decode_chunks(vae, z), sink_for_path(f"{i}.mp4"))
        ...             for i, z in enumerate(latents)]
        ...     stats = [f.result() for f in done]
        """
        self._check_open()
        run = _Run(sink, FrameStats(mode="async"))
        run.future = Future()
        run.future.set_running_or_notify_cancel()
        try:
            self._produce(run, chunks, progress)
        except BaseException:
            self._abandon(run)
            sink.abort()
            raise
        self._jobs.put(_Close(run))
        return run.future

    def _produce(self, run: _Run, chunks: Iterable[torch.Tensor], progress: Progress | None):
        stats = run.stats
        it = iter(chunks)
        n = 0
        try:
            while True:
                # The profiler shows each chunk's GPU work under this name (bench decode).
                with record_function(f"nostall.chunk.{n}"):
                    t = time.perf_counter()
                    chunk = next(it, None)
                    stats.producer_s += time.perf_counter() - t
                    if chunk is None:
                        break
                    self._raise_if_failed(run)
                    self._submit(n, self._frames(chunk), run)
                n += 1
                if progress is not None:
                    progress(int(chunk.shape[2]) if chunk.dim() == 5 else int(chunk.shape[0]))
        finally:
            _close_iter(it)

    def _submit(self, n: int, frames: torch.Tensor, run: _Run) -> None:
        stats = run.stats
        i = n % _BUFFERS
        nbytes = frames.numel()
        t = time.perf_counter()
        # Back-pressure: the host buffer must be back from the sink before it is refilled.
        while not self._host_free[i].wait(0.05):
            self._raise_if_failed(run)
        stats.backpressure_s += time.perf_counter() - t
        self._raise_if_failed(run)
        host = self._buffers.host_view(i, nbytes)
        frames_host = host.view(frames.shape)
        if self._copy_stream is None:
            host.view(frames.shape).copy_(frames)
            event = None
        else:
            compute = torch.cuda.current_stream(self.device)
            if self._in_use[i]:
                # Device buffer i may still be read by the copy of chunk n-2 (GPU-side wait,
                # the calling thread does not block).
                compute.wait_event(self._copied[i])
            dev = self._buffers.device_view(i, nbytes, self.device)
            dev.view(frames.shape).copy_(frames)
            self._computed[i].record(compute)
            with torch.cuda.stream(self._copy_stream):
                # The copy may only start once chunk n's kernels have written device buffer i.
                self._copy_stream.wait_event(self._computed[i])
                host.copy_(dev, non_blocking=True)
                self._copied[i].record(self._copy_stream)
            event = self._copied[i]
            self._in_use[i] = True
        self._host_free[i].clear()
        self._jobs.put(_Job(run, i, frames_host, event))

    @staticmethod
    def _raise_if_failed(run: _Run) -> None:
        err = run.error
        if err is not None:
            raise _sink_error(err)

    def _abandon(self, run: _Run) -> None:
        """Stop the run's remaining jobs and wait until the worker no longer touches buffers."""
        run.cancel.set()
        finish = _Finish()
        self._jobs.put(finish)
        finish.done.wait()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    # ---- worker thread -----------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            if isinstance(job, _Finish):
                job.done.set()
                continue
            if isinstance(job, _Close):
                self._close_sink(job.run)
                continue
            run = job.run
            try:
                if run.cancel.is_set() or run.error is not None:
                    continue
                stats = run.stats
                t = time.perf_counter()
                if job.event is not None:
                    job.event.synchronize()  # chunk's bytes are in host buffer `slot`
                t1 = time.perf_counter()
                with record_function("nostall.write"):
                    run.sink.write(job.host.numpy())
                t2 = time.perf_counter()
                frames = job.host.shape[0]
                stats.copy_wait_s += t1 - t
                stats.write_s += t2 - t1
                stats.chunk_log.append((frames, t1 - run.t0, t2 - run.t0))
                stats.chunks += 1
                stats.frames += frames
                stats.bytes += job.host.numel()
            except BaseException as e:
                run.error = e
            finally:
                job.host = None  # the sink is done with it; never keep the view around
                self._host_free[job.slot].set()

    @staticmethod
    def _close_sink(run: _Run) -> None:
        future = run.future
        assert future is not None
        if run.error is None:
            t = time.perf_counter()
            try:
                run.sink.close()
            except BaseException as e:
                run.error = e
            else:
                run.stats.close_s = time.perf_counter() - t
                run.stats.wall_s = time.perf_counter() - run.t0
                future.set_result(run.stats)
                return
        try:
            run.sink.abort()
        finally:
            future.set_exception(_sink_error(run.error))

    def close(self) -> None:
        """Join the worker thread and release the buffers. Idempotent."""
        if self._closed:
            return
        self._jobs.put(_STOP)
        self._worker.join()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        super().close()


def drain(
    chunks: Iterable[torch.Tensor], *, device: str | torch.device | None = None
) -> FrameStats:
    """Consume the chunks and produce nothing: the decode-only reference time."""
    stats = FrameStats(mode="decode-only")
    t0 = time.perf_counter()
    it = iter(chunks)
    while True:
        with record_function(f"nostall.chunk.{stats.chunks}"):
            chunk = next(it, None)
        if chunk is None:
            break
        stats.chunks += 1
        stats.frames += int(chunk.shape[2]) if chunk.dim() == 5 else int(chunk.shape[0])
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    stats.wall_s = time.perf_counter() - t0
    return stats


def _sink_error(err: BaseException) -> SinkError:
    if isinstance(err, SinkError):
        return err
    new = SinkError(f"the frame sink failed: {type(err).__name__}: {err}")
    new.__cause__ = err
    return new


def _close_iter(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()
