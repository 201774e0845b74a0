"""decode_to_file end to end on CPU with a tiny random Wan VAE, every sink, every fault."""

from __future__ import annotations

import os

import av
import numpy as np
import pytest
import torch

from nostall.errors import DegradedError, LatentsError, SinkError
from nostall.video import decode_to_file, frame_count, to_uint8_frames
from nostall.video import pipeline as pipeline_mod


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()


@pytest.fixture(scope="module")
def latents():
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 16, 4, 6, 8, generator=g)  # 13 frames of 48 x 64


@pytest.fixture(scope="module")
def reference(vae, latents):
    with torch.no_grad():
        video = vae.decode(latents).sample  # (1, 3, 13, 48, 64)
    return to_uint8_frames(video).numpy()  # uint8 (13, 48, 64, 3)


def leftovers(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("."))


@pytest.mark.parametrize("sync", [False, True])
def test_npy_is_exactly_vae_decode(tmp_path, vae, latents, reference, sync):
    out = tmp_path / "v.npy"
    result = decode_to_file(vae, latents, out, sync=sync)
    assert result.frames == frame_count(4) == 13
    got = np.load(out)
    assert got.dtype == np.uint8 and got.shape == (13, 48, 64, 3)
    assert np.array_equal(got, reference)
    assert leftovers(tmp_path) == []


def test_mp4_has_every_frame_at_the_right_rate(tmp_path, vae, latents, reference):
    out = tmp_path / "v.mp4"
    decode_to_file(vae, latents, out, fps=16, preset="ultrafast", crf=0)
    with av.open(str(out)) as c:
        stream = c.streams.video[0]
        assert stream.average_rate == 16
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
    assert len(frames) == 13
    assert (frames[0].shape[0], frames[0].shape[1]) == (48, 64)
    # lossy (yuv420p) but close, and in order: each frame is nearest to its own reference
    for i, f in enumerate(frames):
        errs = [np.abs(f.astype(int) - r.astype(int)).mean() for r in reference]
        assert int(np.argmin(errs)) == i
        assert errs[i] < 12


def test_png_folder_and_y4m(tmp_path, vae, latents, reference):
    from PIL import Image

    folder = tmp_path / "frames"
    decode_to_file(vae, latents, folder)
    names = sorted(os.listdir(folder))
    assert len(names) == 13
    assert np.array_equal(np.asarray(Image.open(folder / names[5])), reference[5])
    y4m = tmp_path / "v.y4m"
    decode_to_file(vae, latents, y4m)
    with av.open(str(y4m)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 13


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.zeros(16, 4, 6, 8), "5-D"),
        (torch.zeros(1, 12, 4, 6, 8), "channels"),
        (torch.zeros(1, 16, 4, 6, 8, dtype=torch.int64), "floating"),
        (torch.zeros(1, 16, 0, 6, 8), "T"),
        (torch.zeros(1, 16, 4, 6, 8, dtype=torch.float16), r"z\.to\(device='cpu'"),
        (torch.full((1, 16, 4, 6, 8), float("nan")), "3072 non-finite"),
        (torch.zeros(2, 16, 4, 6, 8), "a batch of 2 videos"),  # a file holds one
    ],
)
def test_bad_latents_are_refused_before_anything_is_written(tmp_path, vae, bad, match):
    with pytest.raises(LatentsError, match=match):
        decode_to_file(vae, bad, tmp_path / "v.mp4")
    assert os.listdir(tmp_path) == []


def test_missing_folder_is_refused_before_decoding(tmp_path, vae, latents, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("decoded although the output folder is missing")

    monkeypatch.setattr("nostall.video.decode.open_chunks", boom)
    with pytest.raises(SinkError, match="folder"):
        decode_to_file(vae, latents, tmp_path / "missing" / "v.mp4")


@pytest.mark.parametrize("sync", [False, True])
def test_sink_failure_leaves_nothing(tmp_path, vae, latents, monkeypatch, sync):
    from nostall.video.sinks import NpySink

    calls = [0]
    real = NpySink._write

    def disk_full(self, frames):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(28, "No space left on device")
        return real(self, frames)

    monkeypatch.setattr(NpySink, "_write", disk_full)
    with pytest.raises(SinkError, match="No space left"):
        decode_to_file(vae, latents, tmp_path / "v.npy", sync=sync)
    assert os.listdir(tmp_path) == []


def test_interrupted_decode_leaves_nothing(tmp_path, vae, latents, monkeypatch):
    real = pipeline_mod.AsyncFramePipeline._frames
    calls = [0]

    def interrupt(self, chunk):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(self, chunk)

    monkeypatch.setattr(pipeline_mod.AsyncFramePipeline, "_frames", interrupt)
    with pytest.raises(KeyboardInterrupt):
        decode_to_file(vae, latents, tmp_path / "v.mp4")
    assert os.listdir(tmp_path) == []


def test_existing_output_is_replaced_only_on_success(tmp_path, vae, latents, monkeypatch):
    out = tmp_path / "v.npy"
    out.write_bytes(b"old")
    with pytest.raises(LatentsError):
        decode_to_file(vae, latents[:, :3], out)
    assert out.read_bytes() == b"old"
    decode_to_file(vae, latents, out)
    assert np.load(out).shape[0] == 13


# ---- submit_decode: back to back, the file finished on the writer thread --------------


def test_back_to_back_videos_are_exact_and_complete(tmp_path, vae, latents, reference):
    from nostall.video import AsyncFramePipeline, submit_decode

    with AsyncFramePipeline(device="cpu") as pipe:
        futures = [
            submit_decode(vae, latents, tmp_path / f"v{i}.npy", pipeline=pipe) for i in range(3)
        ]
        results = [f.result(timeout=60) for f in futures]
    for i, r in enumerate(results):
        assert r.path == str(tmp_path / f"v{i}.npy") and r.frames == 13 and r.close_s >= 0
        assert np.array_equal(np.load(r.path), reference)
    assert leftovers(tmp_path) == []


def test_submit_decode_refuses_bad_input_before_anything_runs(tmp_path, vae, latents):
    from nostall.video import AsyncFramePipeline, SyncFramePipeline, submit_decode

    with AsyncFramePipeline(device="cpu") as pipe:
        with pytest.raises(LatentsError, match="channels"):
            submit_decode(vae, torch.zeros(1, 12, 4, 6, 8), tmp_path / "v.mp4", pipeline=pipe)
        with pytest.raises(SinkError, match="folder"):
            submit_decode(vae, latents, tmp_path / "missing" / "v.mp4", pipeline=pipe)
    with SyncFramePipeline(device="cpu") as sync, pytest.raises(TypeError, match="Async"):
        submit_decode(vae, latents, tmp_path / "v.mp4", pipeline=sync)
    assert os.listdir(tmp_path) == []


def test_submit_decode_failure_after_return_leaves_nothing(tmp_path, vae, latents, monkeypatch):
    from nostall.video import AsyncFramePipeline, submit_decode
    from nostall.video.sinks import NpySink

    def disk_full_on_close(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(NpySink, "_finish_temp", disk_full_on_close)
    with AsyncFramePipeline(device="cpu") as pipe:
        future = submit_decode(vae, latents, tmp_path / "v.npy", pipeline=pipe)
        with pytest.raises(SinkError, match="No space left"):
            future.result(timeout=60)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("armed", "events"), [("temporary made", 40), ("_open returned", 25)])
def test_an_interrupt_at_any_point_of_the_hand_off_to_the_pipeline_leaves_nothing(
    tmp_path, vae, monkeypatch, armed, events
):
    """SIGTERM as ``nostall``'s CLI raises it (a BaseException at whatever bytecode the
    main thread is at; the flaky CLI test's ``.partial``): a KeyboardInterrupt at each of
    the first trace events (call, line, return) once the sink's temporary exists (its
    constructor, ``sink_for_path``, ``_open``), then once ``_open`` returned (the hand-off
    to ``AsyncFramePipeline.submit``). Each time nothing is left; the pipeline goes on."""
    import sys

    from nostall.video import AsyncFramePipeline, submit_decode
    from nostall.video import decode as decode_mod
    from nostall.video.sinks import AtomicSink

    z = torch.randn(1, 16, 1, 2, 2, generator=torch.Generator().manual_seed(2))  # 1 frame
    state = {"armed": False, "left": 0, "fired": False}
    real = AtomicSink._create_temp

    def create(self, tmp):
        real(self, tmp)
        state["armed"] = state["armed"] or armed == "temporary made"

    def tracer(frame, event, arg):
        if state["armed"]:
            state["left"] -= 1
            if state["left"] == 0:
                state.update(armed=False, fired=True)
                raise KeyboardInterrupt
        elif event == "return" and frame.f_code is decode_mod._open.__code__:
            state["armed"] = armed == "_open returned"
        return tracer

    monkeypatch.setattr(AtomicSink, "_create_temp", create)
    previous = sys.gettrace()  # (a coverage tool's)
    with AsyncFramePipeline(device="cpu") as pipe:
        for n in range(1, events + 1):
            out = tmp_path / str(n)
            out.mkdir()
            state.update(armed=False, left=n, fired=False)
            sys.settrace(tracer)
            try:
                submit_decode(vae, z, out / "clip.mp4", pipeline=pipe).result(timeout=60)
            except KeyboardInterrupt:
                pass  # (as the CLI's main() does: past the handler, its frames are freed)
            finally:
                sys.settrace(previous)
            assert state["fired"], f"event {n}: the decode ended before the interrupt"
            assert os.listdir(out) == [], f"interrupted at event {n} after the {armed}"
        # the pipeline outlived every interrupt
        submit_decode(vae, z, tmp_path / "after.mp4", pipeline=pipe).result(timeout=60)
    assert (tmp_path / "after.mp4").stat().st_size > 0


def test_submit_to_a_closed_pipeline_aborts_the_sink_it_was_given(tmp_path):
    from nostall.errors import ClosedError
    from nostall.video import AsyncFramePipeline
    from nostall.video.sinks import Mp4Sink

    pipe = AsyncFramePipeline(device="cpu")
    pipe.close()
    sink = Mp4Sink(tmp_path / "v.mp4")
    with pytest.raises(ClosedError):
        pipe.submit(iter(()), sink)
    assert sink.closed and os.listdir(tmp_path) == []


# ---- an explicit decoder mode that cannot run: recorded, or refused with strict ----------


def test_exact_that_runs_is_not_degraded(tmp_path, vae, latents, reference):
    result = decode_to_file(vae, latents, tmp_path / "v.npy", mode="exact", strict=True)
    assert result.degraded == ()
    assert np.array_equal(np.load(result.path), reference)


@pytest.fixture
def gelu_head(vae):
    """The decoder head's activation made one that eager calls and exact cannot run.
    (monkeypatch's undo deletes a submodule attribute instead of restoring it.)"""
    silu = vae.decoder.nonlinearity
    vae.decoder.nonlinearity = torch.nn.GELU()
    yield
    vae.decoder.nonlinearity = silu


@pytest.mark.parametrize("submit", [False, True])
def test_exact_that_cannot_run_decodes_eagerly_and_the_result_says_so(
    tmp_path, vae, latents, gelu_head, submit
):
    from nostall.video import AsyncFramePipeline, submit_decode

    with torch.no_grad():
        expected = to_uint8_frames(vae.decode(latents).sample).numpy()
    out = tmp_path / "v.npy"
    if submit:
        with AsyncFramePipeline(device="cpu") as pipe:
            result = submit_decode(vae, latents, out, pipeline=pipe, mode="exact").result(60)
    else:
        result = decode_to_file(vae, latents, out, mode="exact")
    assert np.array_equal(np.load(out), expected)  # eager's frames
    (said,) = result.degraded
    assert "mode='exact' was asked for" in said and "GELU" in said and "mode='eager'" in said


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_strict_refuses_a_degraded_mode_before_anything_is_written(
    tmp_path, vae, latents, request, mode
):
    if mode == "exact":
        request.getfixturevalue("gelu_head")
    # fast needs a CUDA GPU and Triton; on the CPU it would run exact.
    with pytest.raises(DegradedError, match="strict=True") as info:
        decode_to_file(vae, latents, tmp_path / "v.npy", mode=mode, strict=True)
    assert info.value.requested == f"mode={mode!r}"
    assert info.value.fallback == ("mode='eager'" if mode == "exact" else "mode='exact'")
    assert os.listdir(tmp_path) == []


def test_fast_without_a_gpu_records_that_exact_ran(tmp_path, vae, latents, reference):
    result = decode_to_file(vae, latents, tmp_path / "v.npy", mode="fast")
    (said,) = result.degraded
    assert "mode='fast' was asked for" in said and "CUDA GPU" in said and "'exact'" in said
    assert np.array_equal(np.load(result.path), reference)  # exact's frames are eager's


# ---- the frame count is checked before the file gets its final name ----------------


def _one_chunk_short(monkeypatch):
    from nostall.video import decode as decode_mod

    real = decode_mod.open_chunks

    def short(vae, z, **kw):
        chunks, degraded = real(vae, z, **kw)
        return iter(list(chunks)[:-1]), degraded  # 9 of 13 frames

    monkeypatch.setattr(decode_mod, "open_chunks", short)


@pytest.mark.parametrize("sync", [False, True])
def test_wrong_frame_count_is_a_sink_error_and_leaves_nothing(
    tmp_path, vae, latents, monkeypatch, sync
):
    _one_chunk_short(monkeypatch)
    out = tmp_path / "v.npy"
    with pytest.raises(SinkError, match=r"v\.npy.*produced 9 frames .* make 13"):
        decode_to_file(vae, latents, out, sync=sync)
    assert os.listdir(tmp_path) == []


def test_submit_decode_checks_the_frame_count_before_the_rename(
    tmp_path, vae, latents, monkeypatch
):
    from nostall.video import AsyncFramePipeline, submit_decode

    _one_chunk_short(monkeypatch)
    with AsyncFramePipeline(device="cpu") as pipe:
        future = submit_decode(vae, latents, tmp_path / "v.npy", pipeline=pipe)
        with pytest.raises(SinkError, match=r"v\.npy.*9 frames .* 13 were expected"):
            future.result(timeout=60)
    assert os.listdir(tmp_path) == []


# ---- a script that exits without waiting for its submitted videos -------------------

_SCRIPT = """
import os, sys, threading
import torch
from diffusers import AutoencoderKLWan
from nostall.video import AsyncFramePipeline, submit_decode
from nostall.video.sinks import NpySink

names = ("fail.npy", "ok.npy")
closing = {name: threading.Event() for name in names}  # the pipeline writing it closes
video_of = {}  # id(pipeline) -> the name of its video
real_close, real_finish = AsyncFramePipeline.close, NpySink._finish_temp

def close(self):
    closing[video_of[id(self)]].set()
    real_close(self)

def finish_once_its_pipeline_closes(self):
    # The file is still being finished when the script has ended and the pipeline's exit
    # hook closes it: without that hook, nothing would set the event.
    name = os.path.basename(self.path)
    if not closing[name].wait(60):
        raise RuntimeError("nothing closed the pipeline")
    if name == "fail.npy":
        raise OSError(28, "No space left on device")
    real_finish(self)

AsyncFramePipeline.close = close
NpySink._finish_temp = finish_once_its_pipeline_closes
torch.manual_seed(0)
vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()
z = torch.randn(1, 16, 4, 6, 8)
# One pipeline per outcome (a failed video may stop its pipeline's writer), one process
# for both: starting Python with torch and diffusers is most of this test's time.
pipes = [AsyncFramePipeline(device="cpu") for _ in names]
for name, pipe in zip(names, pipes):
    video_of[id(pipe)] = name
    submit_decode(vae, z, os.path.join(sys.argv[1], name), pipeline=pipe)
# no close(), no result(): the script just ends
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_videos_submitted_by_a_script_that_exits_are_finished(tmp_path, fork_python):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # A process of its own, forked from one that has imported diffusers (the conftest's).
    proc = fork_python(_SCRIPT, str(out_dir), stderr=True)
    _, stderr = proc.communicate(timeout=100)
    assert proc.returncode == 0, stderr
    assert leftovers(out_dir) == []  # no hidden .*.npy.*.partial
    assert np.load(out_dir / "ok.npy").shape == (13, 48, 64, 3)
    assert not (out_dir / "fail.npy").exists()
    assert "fail.npy" in stderr and "was not written" in stderr
    assert "No space left" in stderr
