"""The frame pipelines on CPU: overlap, back-pressure, order, error propagation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from nostall.errors import ArgumentError, ClosedError, SinkError
from nostall.video import AsyncFramePipeline, NullSink, SyncFramePipeline, drain
from nostall.video.sinks import FrameSink

H, W = 16, 24


def identity(chunk: torch.Tensor) -> torch.Tensor:
    return chunk


def producer(n: int, *, delay: float = 0.0, log: list | None = None, closed: list | None = None):
    """Chunks of uint8 (t, H, W, 3) frames whose value is the frame index."""
    frame = 0
    try:
        for i in range(n):
            t = 1 if i == 0 else 4
            if delay:
                time.sleep(delay)
            chunk = torch.empty(t, H, W, 3, dtype=torch.uint8)
            for k in range(t):
                chunk[k] = frame + k
            frame += t
            if log is not None:
                log.append(("made", i, time.perf_counter()))
            yield chunk
    finally:
        if closed is not None:
            closed.append(True)


class RecordingSink(FrameSink):
    """Keeps a copy of every frame; optionally slow, optionally failing on the n-th write."""

    _requires_frames = False

    def __init__(
        self,
        *,
        delay: float = 0.0,
        fail_at: int | None = None,
        log: list | None = None,
        close_delay: float = 0.0,
        fail_close: bool = False,
    ):
        super().__init__()
        self.delay, self.fail_at, self.log = delay, fail_at, log
        self.close_delay, self.fail_close = close_delay, fail_close
        self.frames: list[np.ndarray] = []
        self.writes = 0
        self.finished = self.discarded = False
        self.closed_by: str | None = None

    def _start(self, height: int, width: int) -> None:
        pass

    def _write(self, frames: np.ndarray) -> None:
        self.writes += 1
        if self.fail_at is not None and self.writes == self.fail_at:
            raise OSError(28, "No space left on device")
        if self.delay:
            time.sleep(self.delay)
        self.frames.extend(f.copy() for f in frames)
        if self.log is not None:
            self.log.append(("written", self.writes - 1, time.perf_counter()))

    def _finish(self) -> None:
        self.closed_by = threading.current_thread().name
        if self.close_delay:
            time.sleep(self.close_delay)
        if self.fail_close:
            raise OSError(5, "Input/output error")
        self.finished = True
        if self.log is not None:
            self.log.append(("closed", 0, time.perf_counter()))

    def _discard(self) -> None:
        self.discarded = True


@pytest.mark.parametrize("kind", [SyncFramePipeline, AsyncFramePipeline])
def test_frames_arrive_complete_and_in_order(kind):
    sink = RecordingSink()
    with kind(device="cpu", convert=identity) as pipe:
        stats = pipe.run(producer(7), sink)
    assert stats.frames == 1 + 4 * 6 == len(sink.frames)
    assert [int(f[0, 0, 0]) for f in sink.frames] == list(range(25))
    assert stats.chunks == 7 and stats.bytes == 25 * H * W * 3


def test_async_overlaps_a_slow_sink_with_production():
    n, d = 8, 0.06
    with SyncFramePipeline(device="cpu", convert=identity) as pipe:
        t = time.perf_counter()
        pipe.run(producer(n, delay=d), RecordingSink(delay=d))
        sync_s = time.perf_counter() - t
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        t = time.perf_counter()
        pipe.run(producer(n, delay=d), RecordingSink(delay=d))
        async_s = time.perf_counter() - t
    # sync ≈ n·(produce + write) = 0.96 s; async ≈ max + one stage ≈ 0.54 s
    assert sync_s >= 2 * n * d * 0.95
    assert async_s < 0.75 * sync_s, (async_s, sync_s)


@pytest.mark.parametrize("kind", [SyncFramePipeline, AsyncFramePipeline])
def test_stats_are_times_within_the_run(kind):
    with kind(device="cpu", convert=identity) as pipe:
        stats = pipe.run(producer(5, delay=0.01), RecordingSink(delay=0.02))
    for name in ("producer_s", "backpressure_s", "write_s", "copy_wait_s"):
        assert 0.0 <= getattr(stats, name) <= stats.wall_s, (name, stats)
    assert stats.write_s >= 5 * 0.02 * 0.9
    assert [f for f, _, _ in stats.chunk_log] == [1, 4, 4, 4, 4]
    for _, a, b in stats.chunk_log:
        assert 0.0 <= a <= b <= stats.wall_s


def test_backpressure_bounds_chunks_in_flight():
    log: list = []
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        pipe.run(producer(12, log=log), RecordingSink(delay=0.03, log=log))
    made = written = worst = 0
    for kind, _, _ in sorted(log, key=lambda e: e[2]):
        if kind == "made":
            made += 1
        else:
            written += 1
        worst = max(worst, made - written)
    # two buffers + the chunk the producer holds while waiting for one
    assert worst <= 3, worst


def test_sink_error_reaches_the_caller_promptly_and_stops_production():
    closed: list = []
    log: list = []
    sink = RecordingSink(fail_at=3)
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        t = time.perf_counter()
        with pytest.raises(SinkError, match="No space left") as info:
            pipe.run(producer(50, delay=0.01, log=log, closed=closed), sink)
        assert time.perf_counter() - t < 2.0
        assert isinstance(info.value.__cause__, OSError)
        assert closed == [True]  # the chunk generator was closed: no more GPU work launched
        assert len([e for e in log if e[0] == "made"]) <= 3 + 3
        # the pipeline is reusable after a failed run
        ok = RecordingSink()
        pipe.run(producer(3), ok)
        assert len(ok.frames) == 9


def test_producer_error_and_interrupt_stop_the_worker():
    def bad():
        yield torch.zeros(1, H, W, 3, dtype=torch.uint8)
        raise KeyboardInterrupt

    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        with pytest.raises(KeyboardInterrupt):
            pipe.run(bad(), RecordingSink(delay=0.05))
        assert pipe._worker.is_alive()
        assert all(e.is_set() for e in pipe._host_free)  # no buffer left lent out


def test_convert_must_return_uint8_frames():
    with AsyncFramePipeline(device="cpu") as pipe, pytest.raises(ArgumentError, match="uint8"):
        pipe.run(iter([torch.zeros(1, 3, 1, 4, 4, dtype=torch.uint8)]), NullSink())


def test_default_convert_maps_decoder_output():
    chunk = torch.linspace(-1, 1, 3 * 2 * 4 * 4).reshape(1, 3, 2, 4, 4)
    sink = RecordingSink()
    with AsyncFramePipeline(device="cpu") as pipe:
        pipe.run(iter([chunk]), sink)
    got = np.stack(sink.frames)
    assert got.shape == (2, 4, 4, 3) and got.dtype == np.uint8
    assert got.min() == 0 and got.max() == 255


def test_closed_pipeline():
    pipe = AsyncFramePipeline(device="cpu", convert=identity)
    pipe.close()
    pipe.close()
    assert not pipe._worker.is_alive()
    with pytest.raises(ClosedError):
        pipe.run(producer(1), NullSink())


def test_drain_counts_frames():
    assert drain(producer(5)).frames == 17


def test_worker_thread_is_the_one_writing():
    seen = set()

    class ThreadSink(RecordingSink):
        def _write(self, frames):
            seen.add(threading.current_thread().name)

    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        pipe.run(producer(3), ThreadSink())
    assert seen == {"nostall-frame-writer"}


# ---- submit: the worker finishes and closes the sink --------------------------------


def test_submit_returns_before_the_sink_is_closed_and_resolves_to_stats():
    sink = RecordingSink(close_delay=1.0)
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        t = time.perf_counter()
        future = pipe.submit(producer(4), sink)
        assert time.perf_counter() - t < 0.8  # did not wait for the close (1 s)
        stats = future.result(timeout=5)
    assert sink.finished and sink.closed_by == "nostall-frame-writer"
    assert sink.closed and not sink.discarded
    assert stats.frames == 13 == len(sink.frames)
    assert [int(f[0, 0, 0]) for f in sink.frames] == list(range(13))
    assert 1.0 <= stats.close_s <= stats.wall_s


def test_next_video_is_produced_while_the_previous_one_closes():
    log: list = []
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        first = pipe.submit(producer(2), RecordingSink(close_delay=0.4, log=log))
        second_log: list = []
        second = pipe.submit(producer(3, delay=0.02, log=second_log), RecordingSink())
        first.result(timeout=5)
        second.result(timeout=5)
    closed_at = next(t for kind, _, t in log if kind == "closed")
    made = [t for kind, _, t in second_log if kind == "made"]
    assert len(made) == 3 and max(made) < closed_at  # chunks came while video 1 closed


def test_write_failure_after_submit_reaches_the_future_and_removes_the_output():
    sink = RecordingSink(fail_at=2)
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        future = pipe.submit(producer(2), sink)  # the second (last) chunk fails, later
        with pytest.raises(SinkError, match="No space left"):
            future.result(timeout=5)
        assert isinstance(future.exception().__cause__, OSError)
        assert sink.discarded and not sink.finished
        ok = RecordingSink()
        assert pipe.submit(producer(2), ok).result(timeout=5).frames == 5  # still usable
        assert all(e.is_set() for e in pipe._host_free)


def test_close_failure_reaches_the_future():
    sink = RecordingSink(fail_close=True)
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        future = pipe.submit(producer(2), sink)
        with pytest.raises(SinkError, match="Input/output error"):
            future.result(timeout=5)
    assert sink.discarded and not sink.finished


def test_failure_while_launching_is_raised_by_submit_and_aborts_the_sink():
    def bad():
        yield torch.zeros(1, H, W, 3, dtype=torch.uint8)
        raise RuntimeError("CUDA error: out of memory")

    sink = RecordingSink()
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        with pytest.raises(RuntimeError, match="out of memory"):
            pipe.submit(bad(), sink)
        assert sink.discarded and all(e.is_set() for e in pipe._host_free)


def test_close_waits_for_submitted_videos():
    sink = RecordingSink(delay=0.05, close_delay=0.1)
    pipe = AsyncFramePipeline(device="cpu", convert=identity)
    future = pipe.submit(producer(3), sink)
    pipe.close()
    assert future.done() and future.result().frames == 9 and sink.finished


# ---- a sink that cannot clean up, a writer thread that is gone ----------------------


class AbortFailsSink(RecordingSink):
    def _discard(self) -> None:
        raise OSError(13, "Permission denied")


@pytest.mark.timeout(20)
def test_a_raising_abort_does_not_kill_the_writer(caplog):
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        future = pipe.submit(producer(2), AbortFailsSink(fail_at=2))
        with pytest.raises(SinkError, match="No space left") as info:
            future.result(timeout=5)
        assert any("Permission denied" in note for note in info.value.__notes__)
        assert pipe._worker.is_alive()
        # the next video goes through the same thread
        ok = RecordingSink()
        assert pipe.submit(producer(3), ok).result(timeout=5).frames == 9
        assert pipe.run(producer(2), RecordingSink()).frames == 5
    assert "Permission denied" in caplog.text and "may remain" in caplog.text


class DiesAfterOneJob(AsyncFramePipeline):
    """A writer thread that takes one job and stops without settling anything."""

    def _work(self) -> None:
        self._jobs.get()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("how", ["run", "submit"])
def test_a_dead_writer_raises_instead_of_hanging(how):
    sink = RecordingSink()
    with DiesAfterOneJob(device="cpu", convert=identity) as pipe:
        t = time.perf_counter()
        with pytest.raises(SinkError, match=r"writer thread .* has stopped"):
            getattr(pipe, how)(producer(6), sink)
        assert time.perf_counter() - t < 5
        with pytest.raises(SinkError, match="has stopped"):
            pipe.run(producer(1), RecordingSink())
    assert not sink.finished


@pytest.mark.timeout(20)
def test_an_unexpected_worker_error_fails_every_queued_video(monkeypatch):
    def bug(self, run):
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(AsyncFramePipeline, "_close_sink", bug)
    first, second = RecordingSink(close_delay=0.2), RecordingSink()
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        f1 = pipe.submit(producer(2), first)
        try:
            f2 = pipe.submit(producer(2), second)
        except SinkError:
            f2 = None  # the worker died before this one was queued: refused at once
        with pytest.raises(SinkError, match="a bug in the writer"):
            f1.result(timeout=5)
        if f2 is not None:
            with pytest.raises(SinkError):
                f2.result(timeout=5)
        with pytest.raises(SinkError, match="has stopped on RuntimeError: a bug"):
            pipe.submit(producer(1), RecordingSink())
    assert first.discarded and second.discarded and not first.finished


def test_submit_checks_the_frame_count_before_closing():
    sink = RecordingSink()
    with AsyncFramePipeline(device="cpu", convert=identity) as pipe:
        future = pipe.submit(producer(3), sink, frames=13)  # the chunks make 9
        with pytest.raises(SinkError, match="9 frames reached the sink but 13 were expected"):
            future.result(timeout=5)
        assert pipe.submit(producer(3), RecordingSink(), frames=9).result(timeout=5).frames == 9
    assert sink.discarded and not sink.finished
