"""The worker's HTML status page (nostall/serve/pages.py): its video jobs section, every
string a client gave escaped."""

from __future__ import annotations


def _status(videos=None):
    return {"device": "cpu", "ready": True, "draining": False, "uptime_s": 12.0,
            "running": None, "queue": [], "gpu": {"bytes": 0, "budget": 1 << 30},
            "host": {"bytes": 0, "budget": 1 << 30}, "models": {"wan": ["disk"]},
            "recent": [], "unavailable": {}, "videos": videos}  # fmt: skip


def _counts(**kw):
    out = dict.fromkeys(("queued", "in_progress", "completed", "failed", "cancelled"), 0)
    return {**out, "bytes": 0, **kw}


def _job(vid, status, **kw):
    job = {"id": vid, "object": "video", "model": "wan", "status": status, "progress": 0,
           "created_at": 1_700_000_000, "completed_at": None, "prompt": "a cat",
           "size": "832x480", "seconds": "4", "error": None,
           "nostall": {"params": {}, "info": {}}}  # fmt: skip
    job.update(kw)
    return job


def test_a_worker_without_video_jobs_has_no_video_section():
    from nostall.serve.pages import worker_page

    assert "Video jobs" not in worker_page(_status())


def test_a_worker_that_cannot_serve_them_says_why():
    from nostall.serve.pages import worker_page

    page = worker_page(_status(), videos_down="another worker (pid <7>) keeps its videos here")
    assert "Video jobs" in page and "not served" in page
    assert "pid &lt;7&gt;" in page and "<7>" not in page


def test_the_video_jobs_section_counts_lists_and_escapes():
    from nostall.serve.pages import worker_page

    done = "video_" + "a" * 32
    info = {"frames": 81, "phases": {"denoise": 31.3, "decode_write": 4.5}}
    jobs = [
        _job("video_" + "b" * 32, "in_progress", progress=42, prompt="<script>alert(1)</script>"),
        _job(
            done,
            "completed",
            progress=100,
            completed_at=1_700_000_060,
            nostall={"params": {}, "info": info},
        ),
        _job(
            "video_" + "c" * 32,
            "failed",
            model="<b>wan</b>",
            error={"code": "sink_error", "message": "disk <full> & gone"},
        ),
        _job("video_" + "d" * 32, "queued", prompt="x" * 500),
    ]
    page = worker_page(_status(_counts(completed=1, failed=1, queued=1, in_progress=1,
                                       bytes=2_500_000_000)), videos=jobs)  # fmt: skip
    assert "<h2>Video jobs</h2>" in page
    assert "<td>2.50 GB</td>" in page
    # what clients gave (prompt, model) and what errors say: escaped, never markup
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>wan</b>" not in page and "&lt;b&gt;wan&lt;/b&gt;" in page
    assert "disk &lt;full&gt; &amp; gone" in page and "<b>sink_error</b>" in page
    assert '<progress value="42" max="100"></progress> 42%' in page
    # a completed job links its MP4; the others do not
    assert f'<a href="/v1/videos/{done}/content">MP4</a>' in page
    assert page.count("/content") == 1
    assert "denoise 31.3" in page and "decode_write 4.5" in page
    # a long prompt is cut to 80 characters
    assert "x" * 79 + "…" in page and "x" * 80 not in page
    # every job's row, with its size and seconds
    assert all(j["id"] in page for j in jobs) and "832x480" in page
