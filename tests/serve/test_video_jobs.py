"""Video generation served: OpenAI's Videos API over real HTTP (uvicorn on loopback), a
tiny random Wan 2.1 T2V store; the frames the worker writes equal diffusers' own for the
seed, jobs are polled, fetched (ranges too), listed, cancelled and kept across a restart."""

from __future__ import annotations

import io
import time

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
av = pytest.importorskip("av")


def _wait(url, vid, until=("completed", "failed", "cancelled"), timeout=60.0):
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        job = httpx.get(f"{url}/v1/videos/{vid}").json()
        seen.append(job["progress"])
        if job["status"] in until:
            return job, seen
        assert time.monotonic() < deadline, f"video {vid} still {job['status']} after {timeout} s"
        time.sleep(0.02)


def _body(**kw):
    body = {"model": "wan", "prompt": "a cat walking", "size": "32x32", "frames": 5,
            "steps": 2, "seed": 3, "max_sequence_length": 16, "mode": "exact"}  # fmt: skip
    body.update(kw)
    return body


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    folder = tmp_path_factory.mktemp("videos")
    worker = Worker(store, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20,
                    prepare=False, video_dir=str(folder))  # fmt: skip
    with BackgroundServer(create_app(worker)) as s:
        s.folder = folder
        s.worker = worker
        yield s


def _diffusers_frames(store, **kw):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(store / "wan"))
    pipe.set_progress_bar_config(disable=True)
    b = _body(**kw)
    w, h = (int(v) for v in b["size"].split("x"))
    out = pipe(prompt=b["prompt"], height=h, width=w, num_frames=b["frames"],
               num_inference_steps=b["steps"], max_sequence_length=16,
               generator=torch.Generator("cpu").manual_seed(b["seed"]), output_type="pil")  # fmt: skip
    return np.stack([np.asarray(f) for f in out.frames[0]])


def test_the_workers_frames_equal_diffusers_for_the_seed(server, store, tmp_path):
    """Before encoding: the same job written as .npy (uint8 frames) by the worker's path
    (model cache, latents out, exact chunked decode, asynchronous frame pipeline)."""
    from nostall.serve.jobs import GenerateJob

    worker = server.worker
    path = str(tmp_path / "frames.npy")
    job = GenerateJob(id="t", model="wan", prompt="a cat walking", width=32, height=32,
                      frames=5, fps=16, steps=2, seed=3, max_sequence_length=16, path=path)  # fmt: skip
    future, _ = worker.submit(job)
    result = future.result(60)
    written = result.info["written"].result(60)
    assert written.frames == 5
    ours = np.load(path)
    ref = _diffusers_frames(store)
    assert ours.shape == ref.shape == (5, 32, 32, 3)
    assert np.array_equal(ours, ref)
    # and another seed makes another video (the check can fail)
    assert not np.array_equal(ref, _diffusers_frames(store, seed=4))


def test_a_video_is_queued_polled_fetched_listed_and_deleted(server):
    url = server.url
    r = httpx.post(f"{url}/v1/videos", json=_body())
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress")
    assert job["model"] == "wan" and job["size"] == "32x32" and job["id"].startswith("video_")
    done, seen = _wait(url, job["id"])
    assert done["status"] == "completed", done
    assert done["progress"] == 100 and done["completed_at"] >= done["created_at"]
    assert seen == sorted(seen)  # progress never goes back
    assert done["nostall"]["info"]["frames"] == 5

    content = httpx.get(f"{url}/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(content.content)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    part = httpx.get(f"{url}/v1/videos/{job['id']}/content", headers={"Range": "bytes=0-99"})
    assert part.status_code == 206 and part.content == content.content[:100]

    counts = httpx.get(f"{url}/status.json").json()["videos"]
    assert counts["completed"] >= 1 and counts["bytes"] >= len(content.content)
    listed = httpx.get(f"{url}/v1/videos", params={"limit": 100}).json()
    assert listed["object"] == "list" and job["id"] in [v["id"] for v in listed["data"]]

    gone = httpx.delete(f"{url}/v1/videos/{job['id']}").json()
    assert gone == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert httpx.get(f"{url}/v1/videos/{job['id']}").status_code == 404
    assert httpx.get(f"{url}/v1/videos/{job['id']}/content").status_code == 404
    assert not (server.folder / f"{job['id']}.mp4").exists()


def test_a_multipart_body_as_openais_sdk_sends_it(server):
    fields = {k: str(v) for k, v in _body(seed=5).items() if k != "frames"}
    fields["seconds"] = "0.25"  # 0.25 s at 16 fps: 4k+1 frames round to 5
    # multipart/form-data, as the SDK sends it (a part of no file name is a field)
    parts = {k: (None, v) for k, v in fields.items()}
    r = httpx.post(f"{server.url}/v1/videos", files=parts)
    assert r.status_code == 200, r.text
    done, _ = _wait(server.url, r.json()["id"])
    assert done["status"] == "completed" and done["seconds"] == "0.25"
    assert done["nostall"]["params"]["frames"] == 5
    # a file where a field belongs, and a number that is not one
    bad = httpx.post(f"{server.url}/v1/videos", files={**parts, "prompt": ("p.txt", b"x")})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "prompt"
    bad = httpx.post(f"{server.url}/v1/videos", files={**parts, "steps": (None, "two")})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "steps"


def test_cancelling_a_running_job_stops_it_and_leaves_no_file(server):
    url = server.url
    r = httpx.post(f"{url}/v1/videos", json=_body(steps=150, seed=7))
    vid = r.json()["id"]
    _wait(url, vid, until=("in_progress",))
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/v1/videos/{vid}").json()["progress"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert httpx.get(f"{url}/v1/videos/{vid}/content").status_code == 409
    cancelled = httpx.delete(f"{url}/v1/videos/{vid}").json()
    assert cancelled["status"] == "cancelled"
    # the worker is free again: the next job completes, the cancelled one stays so
    nxt = httpx.post(f"{url}/v1/videos", json=_body(seed=8)).json()
    assert _wait(url, nxt["id"])[0]["status"] == "completed"
    job = httpx.get(f"{url}/v1/videos/{vid}").json()
    assert job["status"] == "cancelled" and job["progress"] < 90
    assert not (server.folder / f"{vid}.mp4").exists()
    assert not [p for p in server.folder.iterdir() if vid in p.name]


@pytest.mark.parametrize(
    ("change", "status", "field"),
    [
        ({"frames": 32}, 422, "frames"),
        ({"frames": 5, "seconds": "2"}, 422, "frames"),
        ({"size": "40x32"}, 422, "size"),
        ({"size": "8000x8000"}, 422, "size"),
        ({"steps": 0}, 422, "steps"),
        ({"steps": "2"}, 422, "steps"),
        ({"mode": "turbo"}, 422, "mode"),
        ({"input_reference": "data:image/png;base64,AAAA"}, 422, "input_reference"),
        ({"guidance_2": 3.0}, 422, "guidance_2"),
        ({"model": "flux"}, 422, "model"),
        ({"model": "nope"}, 404, None),
        ({"colour": "red"}, 422, "colour"),
    ],
)
def test_bad_requests_are_refused_naming_the_field_before_queueing(server, change, status, field):
    before = len(httpx.get(f"{server.url}/v1/videos", params={"limit": 100}).json()["data"])
    r = httpx.post(f"{server.url}/v1/videos", json=_body(**change))
    assert r.status_code == status, r.text
    if field is not None:
        assert r.json()["error"].get("field") == field, r.json()
    after = len(httpx.get(f"{server.url}/v1/videos", params={"limit": 100}).json()["data"])
    assert after == before  # nothing queued, nothing kept


def test_unknown_ids_and_bad_list_arguments(server):
    assert httpx.get(f"{server.url}/v1/videos/video_nope").status_code == 404
    assert httpx.delete(f"{server.url}/v1/videos/video_nope").status_code == 404
    r = httpx.get(f"{server.url}/v1/videos", params={"limit": 0})
    assert r.status_code == 422 and r.json()["error"]["field"] == "limit"
    r = httpx.get(f"{server.url}/v1/videos", params={"order": "sideways"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "order"


def test_a_restarted_worker_lists_finished_videos_and_fails_interrupted_ones(store, tmp_path):
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    def start():
        w = Worker(store, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20,
                   prepare=False, video_dir=str(tmp_path))  # fmt: skip
        server = BackgroundServer(create_app(w))
        server.worker = w
        return server

    with start() as s:
        done = httpx.post(f"{s.url}/v1/videos", json=_body()).json()
        assert _wait(s.url, done["id"])[0]["status"] == "completed"
        # a job the process will not finish: the store still says in_progress as it dies
        s.worker.videos.store.start(s.worker.videos.store.create(
            "wan", "x", size="32x32", seconds="0.25", params={})["id"])  # fmt: skip
    with start() as s:
        data = httpx.get(f"{s.url}/v1/videos").json()["data"]
        by = {v["status"]: v for v in data}
        assert by["completed"]["id"] == done["id"]
        assert by["failed"]["error"]["code"] == "interrupted"
        ok = httpx.get(f"{s.url}/v1/videos/{done['id']}/content")
        assert ok.status_code == 200 and len(ok.content) > 0


def test_metrics_and_the_status_page_show_completed_failed_and_cancelled_jobs(store, tmp_path):
    """One job of each end on a fresh worker: cancelled while running, completed (its
    prompt markup, escaped on the page), failed (a folder where its MP4 belongs)."""
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    w = Worker(store, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20, prepare=False,
               video_dir=str(tmp_path))  # fmt: skip
    with BackgroundServer(create_app(w)) as s:
        url = s.url
        long = httpx.post(f"{url}/v1/videos", json=_body(steps=150, seed=7)).json()["id"]
        _wait(url, long, until=("in_progress",))
        ok = httpx.post(f"{url}/v1/videos", json=_body(prompt="<script>alert(1)</script>"))
        ok = ok.json()["id"]
        bad = httpx.post(f"{url}/v1/videos", json=_body(seed=9)).json()["id"]
        # queued behind the long one: a folder of files where its MP4 goes, which no sink
        # writes over
        (tmp_path / f"{bad}.mp4").mkdir()
        (tmp_path / f"{bad}.mp4" / "keep").write_bytes(b"")
        assert httpx.delete(f"{url}/v1/videos/{long}").json()["status"] == "cancelled"
        assert _wait(url, ok)[0]["status"] == "completed"
        failed = _wait(url, bad)[0]
        assert failed["status"] == "failed" and "folder" in failed["error"]["message"]
        size = len(httpx.get(f"{url}/v1/videos/{ok}/content").content)

        text = httpx.get(f"{url}/metrics").text
        for status in ("completed", "failed", "cancelled"):
            assert f'nostall_video_jobs{{status="{status}"}} 1.0' in text
            assert f'nostall_video_jobs_ended_total{{status="{status}"}} 1.0' in text
        assert 'nostall_video_jobs{status="queued"} 0.0' in text
        assert f"nostall_video_bytes {float(size)}" in text
        assert "nostall_video_job_seconds_count 1.0" in text
        assert 'nostall_video_phase_seconds_count{phase="denoise"} 1.0' in text
        assert 'nostall_video_phase_seconds_count{phase="decode_write"} 1.0' in text
        assert "nostall_video_frames_total 5.0" in text
        info = httpx.get(f"{url}/v1/videos/{ok}").json()["nostall"]["info"]
        assert info["phases"]["decode_write"] > 0

        page = httpx.get(f"{url}/").text
        assert "<h2>Video jobs</h2>" in page and all(v in page for v in (long, ok, bad))
        assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
        assert f'<a href="/v1/videos/{ok}/content">MP4</a>' in page
        assert page.count("/content") == 1  # only the completed one has a video
        assert f"<b>{failed['error']['code']}</b>" in page
        # deleting the completed video takes it off the gauges
        httpx.delete(f"{url}/v1/videos/{ok}")
        text = httpx.get(f"{url}/metrics").text
        assert 'nostall_video_jobs{status="completed"} 0.0' in text
        assert "nostall_video_bytes 0.0" in text
        assert 'nostall_video_jobs_ended_total{status="completed"} 1.0' in text


def test_a_worker_without_video_pipelines_says_so(tmp_path):
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker
    from nostall.synthetic import write_store

    write_store(tmp_path / "s", ("sdxl",))
    w = Worker(tmp_path / "s", device="cpu", prepare=False, video_dir=str(tmp_path / "v"))
    with BackgroundServer(create_app(w)) as s:
        r = httpx.post(f"{s.url}/v1/videos", json=_body())
        assert r.status_code == 404 and r.json()["error"]["type"] == "no_video_pipelines"
        assert "nostall_video" not in httpx.get(f"{s.url}/metrics").text
        assert "Video jobs" not in httpx.get(f"{s.url}/").text
    assert not (tmp_path / "v").exists()  # nothing made for a worker that makes no video


def test_a_second_worker_on_the_same_video_folder_serves_images_but_says_why_not_videos(
    server, store
):
    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    w = Worker(store, device="cpu", gpu_budget=64 << 20, host_budget=64 << 20, prepare=False,
               video_dir=str(server.folder))  # fmt: skip
    with BackgroundServer(create_app(w)) as s:
        r = httpx.post(f"{s.url}/v1/videos", json=_body())
        assert r.status_code == 503 and "another worker" in r.json()["error"]["message"]
        body = {"model": "sdxl", "prompt": "a cat", "size": "32x32", "steps": 1}
        assert httpx.post(f"{s.url}/v1/images/generations", json=body).status_code == 200
    # the first worker's jobs were left alone
    assert httpx.get(f"{server.url}/v1/videos").status_code == 200


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Every Wan layout: Wan 2.2 A14B (two experts), TI2V-5B, and both I2V pipelines."""
    from nostall.synthetic import VIDEO_PIPELINES, write_store

    folder = tmp_path_factory.mktemp("wan-layouts")
    write_store(folder, VIDEO_PIPELINES)
    return folder


def _png(seed: int, side: int = 32) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("model", "size", "image", "seq"),
    [
        ("wan22", "32x32", False, 16),
        ("wan22-ti2v", "32x32", False, 16),
        ("wan-i2v", "32x32", True, None),  # (512: its image tokens follow the text's)
        ("wan22-i2v", "32x32", True, 16),
    ],
)
def test_every_wan_layout_is_served_as_diffusers_makes_it(layouts, tmp_path, model, size,
                                                          image, seq):  # fmt: skip
    from diffusers import DiffusionPipeline
    from PIL import Image

    from nostall.serve.app import create_app
    from nostall.serve.local import BackgroundServer
    from nostall.serve.worker import Worker

    w = Worker(layouts, device="cpu", prepare=False, video_dir=str(tmp_path))
    body = {"model": model, "prompt": "a cat", "size": size, "frames": 5, "steps": 4,
            "seed": 2, "mode": "exact"}  # fmt: skip
    if seq is not None:
        body["max_sequence_length"] = seq
    files = {k: (None, str(v)) for k, v in body.items()}
    if image:
        files["input_reference"] = ("first.png", _png(1), "image/png")
    with BackgroundServer(create_app(w)) as s:
        vid = httpx.post(f"{s.url}/v1/videos", files=files).json()["id"]
        done, _ = _wait(s.url, vid)
        assert done["status"] == "completed", done
        if image:  # and without its image: refused before queueing
            r = httpx.post(f"{s.url}/v1/videos", json=body)
            assert r.status_code == 422 and r.json()["error"]["field"] == "input_reference"
        # the frames: the same job written as .npy, against diffusers' own call
        from nostall.serve.jobs import GenerateJob

        pic = Image.open(io.BytesIO(_png(1))).convert("RGB") if image else None
        job = GenerateJob(id="t", model=model, prompt="a cat", width=32, height=32, frames=5,
                          fps=16, steps=4, seed=2, max_sequence_length=seq, image=pic,
                          path=str(tmp_path / "f.npy"))  # fmt: skip
        fut, _ = w.submit(job)
        fut.result(120).info["written"].result(120)
    pipe = DiffusionPipeline.from_pretrained(str(layouts / model))
    pipe.set_progress_bar_config(disable=True)
    kw = {"image": pic} if image else {}
    if seq is not None:
        kw["max_sequence_length"] = seq
    ref = pipe(prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=4,
               generator=torch.Generator("cpu").manual_seed(2), output_type="pil", **kw)  # fmt: skip
    assert np.array_equal(
        np.load(tmp_path / "f.npy"), np.stack([np.asarray(f) for f in ref.frames[0]])
    )


def test_wan21_i2v_refuses_a_short_text_length_that_would_drop_its_image(layouts, tmp_path):
    from nostall.errors import ArgumentError
    from nostall.serve.bodies import VideoBody
    from nostall.serve.requests import Limits
    from nostall.serve.video_jobs import VideoJobs  # noqa: F401  (the rules it applies)
    from nostall.serve.video_requests import check_generate, generate_rules
    from nostall.store.catalog import Store

    rules = generate_rules(Store(layouts).entry("wan-i2v"))
    body = VideoBody(model="wan-i2v", prompt="a cat", size="32x32", frames=5,
                     max_sequence_length=16)  # fmt: skip
    with pytest.raises(ArgumentError, match="reads the image's tokens after 512") as e:
        check_generate(body, rules, Limits(), image=_png(1))
    assert e.value.field == "max_sequence_length"
    two = generate_rules(Store(layouts).entry("wan22"))
    assert two.experts == 2 and two.boundary_ratio == pytest.approx(0.875)


def test_the_rules_come_from_each_layouts_own_configs(layouts):
    from nostall.errors import ArgumentError
    from nostall.serve.bodies import VideoBody
    from nostall.serve.requests import Limits
    from nostall.serve.video_requests import check_generate, generate_rules
    from nostall.store.catalog import Store

    store = Store(layouts)
    ti2v = generate_rules(store.entry("wan22-ti2v"))  # the VAE 2.2: 16x spatial, patch 2
    assert (ti2v.multiple, ti2v.size, ti2v.fps) == (32, (1280, 704), 24)
    with pytest.raises(ArgumentError, match="multiples of 32") as e:
        check_generate(VideoBody(model="wan22-ti2v", prompt="a cat", size="48x48"), ti2v, Limits())
    assert e.value.field == "size"
    wan = generate_rules(store.entry("wan"))
    assert (wan.multiple, wan.size, wan.fps, wan.experts) == (16, (832, 480), 16, 1)
