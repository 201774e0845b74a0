"""The worker's Prometheus metrics (nostall/serve/metrics.py): the video jobs' series appear
once a worker serves them, their gauges read the job store at each scrape, and a scrape
after the store closed still answers."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")


def _counts(**kw):
    return {**dict.fromkeys(STATUSES, 0), "bytes": 0, **kw}


def test_a_worker_that_serves_no_video_jobs_exposes_no_video_series():
    from nostall.serve.metrics import WorkerMetrics

    m = WorkerMetrics()
    assert m.videos is None
    assert b"nostall_video" not in m.render()


def test_the_gauges_are_read_from_the_store_at_each_scrape():
    from nostall.serve.metrics import WorkerMetrics

    counts = _counts(completed=2, queued=1, bytes=4096)
    m = WorkerMetrics()
    m.watch_videos(lambda: counts)
    text = m.render().decode()
    assert 'nostall_video_jobs{status="completed"} 2.0' in text
    assert 'nostall_video_jobs{status="queued"} 1.0' in text
    assert 'nostall_video_jobs{status="failed"} 0.0' in text
    assert "nostall_video_bytes 4096.0" in text
    counts["completed"] = 3  # (a scrape later: no update call needed)
    assert 'nostall_video_jobs{status="completed"} 3.0' in m.render().decode()


def test_counters_and_histograms_of_ended_jobs():
    from nostall.serve.metrics import WorkerMetrics

    m = WorkerMetrics()
    v = m.watch_videos(_counts)
    text = m.render().decode()
    for status in ("completed", "failed", "cancelled"):  # every series at 0 from the start
        assert f'nostall_video_jobs_ended_total{{status="{status}"}} 0.0' in text
    v.completed(seconds=42.0, denoise=30.0, decode_write=11.5, frames=81)
    v.completed(seconds=None, denoise=None, decode_write=1.0, frames=17)
    v.ended.labels("failed").inc()
    text = m.render().decode()
    assert 'nostall_video_jobs_ended_total{status="completed"} 2.0' in text
    assert 'nostall_video_jobs_ended_total{status="failed"} 1.0' in text
    assert "nostall_video_job_seconds_count 1.0" in text  # the unmeasured one left out
    assert "nostall_video_job_seconds_sum 42.0" in text
    assert 'nostall_video_job_seconds_bucket{le="60.0"} 1.0' in text
    assert 'nostall_video_job_seconds_bucket{le="30.0"} 0.0' in text
    assert 'nostall_video_phase_seconds_count{phase="denoise"} 1.0' in text
    assert 'nostall_video_phase_seconds_sum{phase="decode_write"} 12.5' in text
    assert "nostall_video_frames_total 98.0" in text


def test_a_scrape_after_the_store_closed_answers_without_the_gauges_samples():
    from nostall.errors import ClosedError
    from nostall.serve.metrics import WorkerMetrics

    def closed():
        raise ClosedError("video store was used after close()")

    m = WorkerMetrics()
    m.watch_videos(closed)
    text = m.render().decode()
    assert "# TYPE nostall_video_jobs gauge" in text
    assert "nostall_video_jobs{" not in text and "\nnostall_video_bytes " not in text


def test_watching_again_points_the_gauges_at_the_new_counts():
    from nostall.serve.metrics import WorkerMetrics

    m = WorkerMetrics()
    first = m.watch_videos(lambda: _counts(completed=1))
    second = m.watch_videos(lambda: _counts(completed=5))  # no duplicate-series error
    assert first is second
    assert 'nostall_video_jobs{status="completed"} 5.0' in m.render().decode()


def test_what_a_router_places_by_is_read_from_the_workers_status_at_each_scrape():
    from nostall.errors import ClosedError
    from nostall.serve.metrics import WorkerMetrics

    status = {
        "queue_by_model": {"flux": 2, "sdxl": 1},
        "estimated_wait_s": 3.5,
        "switch_s": {"flux": 0.0, "sdxl": 0.12},
        "models": {"flux": ["gpu"], "sdxl": ["gpu", "host"]},
    }
    m = WorkerMetrics()
    m.watch_placement(lambda: status)
    text = m.render().decode()
    assert 'nostall_queue_model{model="flux"} 2.0' in text
    assert "nostall_estimated_wait_seconds 3.5" in text
    assert 'nostall_switch_price_seconds{model="sdxl"} 0.12' in text
    assert 'nostall_pipeline_tier{model="sdxl",tier="host"} 1.0' in text
    status["estimated_wait_s"] = 0.5
    assert "nostall_estimated_wait_seconds 0.5" in m.render().decode()

    def closed():
        raise ClosedError("the worker is closed")

    m = WorkerMetrics()
    m.watch_placement(closed)
    assert "nostall_estimated_wait_seconds" in m.render().decode()  # the family, no samples
