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

import atexit
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import record_function

from nostall.errors import ArgumentError, ClosedError, InternalError, SinkError
from nostall.memory.events import wait_event
from nostall.memory.pool import Block, PinnedPool
from nostall.video.frames import to_uint8_frames
from nostall.video.sinks import FrameSink

__all__ = ["AsyncFramePipeline", "FrameStats", "SyncFramePipeline", "drain"]

log = logging.getLogger(__name__)

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

    __slots__ = ("cancel", "error", "expected", "future", "sink", "stats", "t0")

    def __init__(self, sink: FrameSink, stats: FrameStats, expected: int | None = None):
        self.sink, self.stats, self.expected = sink, stats, expected
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
        # Registered through this pipeline's GPU: no context appears on GPU 0.
        self._pool = pool or PinnedPool(
            host_bytes,
            slab_bytes=host_bytes,
            pin=self.device.type == "cuda",
            device=self.device if self.device.type == "cuda" else None,
        )
        self._buffers = _Buffers(self._pool)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed; create a new one")

    def _frames(self, chunk: torch.Tensor) -> torch.Tensor:
        frames = self.convert(chunk)
        if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
            raise ArgumentError(
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
            close_iter(it)
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
    A pipeline still open when the interpreter exits is closed then, so videos
    submitted by a script that never waited for them are still finished.

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
        # The worker sets _worker_error (why it stopped) under _lock and drains the queue
        # in the same critical section; _put checks it under _lock, so nothing is queued
        # after the drain and left unsettled.
        self._lock = threading.Lock()
        self._worker_error: BaseException | None = None
        self._exiting = False
        self._worker = threading.Thread(target=self._work, name="nostall-frame-writer", daemon=True)
        self._worker.start()
        # The worker is a daemon (a forgotten pipeline must not keep a process alive), and
        # daemon threads are frozen at interpreter exit, which would leave a submitted
        # video as a hidden .partial file. atexit runs before that; the hook holds only a
        # weak reference. Registered after our pool, so it runs before the pool's teardown
        # (atexit is last in, first out).
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

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
            self._put(finish)
            self._wait(finish.done, run)
            self._raise_if_failed(run)
        except BaseException:
            self._abandon(run)
            raise
        run.stats.wall_s = time.perf_counter() - run.t0
        return run.stats

    def submit(
        self,
        chunks: Iterable[torch.Tensor],
        sink: FrameSink,
        *,
        progress: Progress | None = None,
        frames: int | None = None,
    ) -> Future[FrameStats]:
        """Launch every chunk, then return while the worker finishes and closes ``sink``.

        The pipeline owns ``sink`` from here on: do not write to, close or abort it.
        Returns once the last chunk is launched and queued for copying, so the caller
        can start the next video's GPU work at once; the returned future resolves to
        the run's :class:`FrameStats` when the file is complete under its final name,
        or raises :class:`~nostall.SinkError` (the partial output removed). An error
        seen while chunks are still being launched is raised here instead, with the
        sink aborted. Videos are written in submission order.

        ``frames``, when given, is the number of frames the chunks must add up to: the
        worker checks it before closing the sink, and on a mismatch aborts it (nothing
        appears under the final name) and fails the future with :class:`~nostall.SinkError`.

        >>> with AsyncFramePipeline() as pipe:  # doctest: +SKIP
        ...     done = [pipe.submit(decode_chunks(vae, z), sink_for_path(f"{i}.mp4"))
        ...             for i, z in enumerate(latents)]
        ...     stats = [f.result() for f in done]
        """
        run = None
        try:  # first: the sink is ours from the call on, whatever is raised (Ctrl-C too)
            self._check_open()
            if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int)):
                raise ArgumentError(f"frames must be an int or None, got {frames!r}")
            run = _Run(sink, FrameStats(mode="async"), frames)
            run.future = Future()
            run.future.set_running_or_notify_cancel()
            self._produce(run, chunks, progress)
            self._put(_Close(run))
        except BaseException:
            if run is not None:
                # (the worker is done with the sink once this returns: a _Close queued
                # runs before _abandon's _Finish, so two threads never use the sink)
                self._abandon(run)
            sink.abort()
            raise
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
            close_iter(it)

    def _submit(self, n: int, frames: torch.Tensor, run: _Run) -> None:
        stats = run.stats
        i = n % _BUFFERS
        nbytes = frames.numel()
        t = time.perf_counter()
        # Back-pressure: the host buffer must be back from the sink before it is refilled.
        self._wait(self._host_free[i], run)
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
            # The device first: alone, the stream context restores the caller's stream on
            # exit with a cudaSetDevice that wakes GPU 0 in a process on another GPU.
            with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
                # The copy may only start once chunk n's kernels have written device buffer i.
                self._copy_stream.wait_event(self._computed[i])
                host.copy_(dev, non_blocking=True)
                self._copied[i].record(self._copy_stream)
            event = self._copied[i]
            self._in_use[i] = True
        self._host_free[i].clear()
        self._put(_Job(run, i, frames_host, event))

    def _put(self, item: Any) -> None:
        with self._lock:
            if self._worker_error is not None or not self._worker.is_alive():
                raise self._gone()
            self._jobs.put(item)

    def _wait(self, event: threading.Event, run: _Run | None) -> None:
        """Wait for the worker to set ``event``; raise if ``run`` failed or the worker is gone."""
        while not event.wait(0.05):
            if run is not None:
                self._raise_if_failed(run)
            # A dead worker never sets the event: raise instead of waiting forever.
            if not self._worker.is_alive() and not event.is_set():
                raise self._gone()

    def _gone(self) -> SinkError:
        cause = self._worker_error
        why = f" on {type(cause).__name__}: {cause}" if cause is not None else ""
        err = SinkError(
            f"the pipeline's writer thread {self._worker.name!r} has stopped{why}, so no "
            f"video can be written through this pipeline; close it and create a new "
            f"AsyncFramePipeline"
        )
        err.__cause__ = cause
        return err

    @staticmethod
    def _raise_if_failed(run: _Run) -> None:
        err = run.error
        if err is not None:
            raise _sink_error(err)

    def _abandon(self, run: _Run) -> None:
        """Stop the run's remaining jobs and wait until the worker no longer touches buffers."""
        run.cancel.set()
        finish = _Finish()
        try:
            self._put(finish)
            self._wait(finish.done, None)
        except SinkError:
            pass  # the worker is gone: it touches no buffer any more
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    # ---- worker thread -----------------------------------------------------------

    def _work(self) -> None:
        item: Any = None
        try:
            while True:
                item = self._jobs.get()
                if item is _STOP:
                    return
                if isinstance(item, _Finish):
                    item.done.set()
                elif isinstance(item, _Close):
                    self._close_sink(item.run)
                else:
                    self._write(item)
                item = None
        except BaseException as e:
            # Sink failures belong to their run and never get here; this is a bug in
            # nostall. Settle everything queued, so that nobody waits for this thread.
            log.exception("the frame writer thread stopped on an unexpected error")
            with self._lock:
                self._worker_error = e
                pending = [] if item is None else [item]
                while True:
                    try:
                        pending.append(self._jobs.get_nowait())
                    except queue.Empty:
                        break
            for p in pending:
                self._fail(p, e)

    def _write(self, job: _Job) -> None:
        run = job.run
        try:
            if run.cancel.is_set() or run.error is not None:
                return
            stats = run.stats
            t = time.perf_counter()
            if job.event is not None:
                wait_event(job.event)  # chunk's bytes are in host buffer `slot`
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

    def _close_sink(self, run: _Run) -> None:
        future = run.future
        if future is None:  # submit() sets it before it queues the _Close
            raise InternalError("a frame pipeline run reached its close without a future")
        got, expected = run.stats.frames, run.expected
        if run.error is None and run.cancel.is_set():  # submit() raised after queueing this
            run.error = SinkError(
                "the caller abandoned this video (submit() was interrupted); the output "
                "was discarded, not finished",
                path=run.sink.path,
            )
        if run.error is None and expected is not None and got != expected:
            # Checked before close(): a short video must never appear under its final name.
            run.error = SinkError(
                f"{got} frames reached the sink but {expected} were expected; the output "
                f"was discarded, not finished",
                path=run.sink.path,
            )
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
        err = _sink_error(run.error)
        self._abort(run, err)
        if self._exiting:  # nobody is left to read the future
            log.error("a video submitted before exit was not written: %s", err)
        future.set_exception(err)

    @staticmethod
    def _abort(run: _Run, err: BaseException) -> None:
        try:
            run.sink.abort()
        except BaseException as e:  # the worker must outlive a sink that cannot clean up
            log.error(
                "aborting %r after %s failed too: %s: %s; its temporary output may remain",
                run.sink,
                type(err).__name__,
                type(e).__name__,
                e,
            )
            err.add_note(f"aborting the sink failed too: {type(e).__name__}: {e}")

    def _fail(self, item: Any, err: BaseException) -> None:
        """Settle a queued item the worker will never handle (it stopped on ``err``)."""
        if isinstance(item, _Finish):
            item.done.set()
        elif isinstance(item, _Job):
            item.run.error = item.run.error or err
            item.host = None
            self._host_free[item.slot].set()
        elif isinstance(item, _Close):
            run = item.run
            run.error = run.error or err
            failure = _sink_error(run.error)
            self._abort(run, failure)
            if run.future is not None and not run.future.done():
                run.future.set_exception(failure)

    def close(self) -> None:
        """Finish the submitted videos, join the worker thread and release the buffers.

        Idempotent. Runs by itself at interpreter exit for a pipeline still open then.
        """
        if self._closed:
            return
        atexit.unregister(self._at_exit)
        self._jobs.put(_STOP)  # after every queued job: submitted videos are finished first
        self._worker.join()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        super().close()


def _close_at_exit(ref: weakref.ref[AsyncFramePipeline]) -> None:
    pipe = ref()
    if pipe is not None and not pipe._closed:
        pipe._exiting = True
        pipe.close()


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


def close_iter(it: Any) -> None:
    """Close a generator (or any iterator with ``close``) so its ``finally`` runs now."""
    close = getattr(it, "close", None)
    if close is not None:
        close()
