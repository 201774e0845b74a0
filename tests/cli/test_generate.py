"""``nostall generate-video``: a tiny Wan store to an MP4 from the shell, the frames equal
to diffusers' (as .npy), every option checked before a weight is read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cli_support import runner, usage_error

from nostall.cli import app

av = pytest.importorskip("av")


def test_a_prompt_becomes_a_video_equal_to_diffusers(store, tmp_path):
    from diffusers import DiffusionPipeline

    out = tmp_path / "cat.npy"
    args = ["generate-video", "--models", str(store), "--model", "wan", "--prompt", "a cat",
            "--size", "32x32", "--frames", "5", "--steps", "2", "--seed", "4", "--device",
            "cpu", "-o", str(out)]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "5 frames" in r.output and "seed 4" in r.output
    pipe = DiffusionPipeline.from_pretrained(str(store / "wan"))
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=2,
               generator=torch.Generator("cpu").manual_seed(4), output_type="pil").frames[0]  # fmt: skip
    assert np.array_equal(np.load(out), np.stack([np.asarray(f) for f in ref]))
    mp4 = tmp_path / "cat.mp4"
    r = runner.invoke(app, [*args[:-1], str(mp4)])
    assert r.exit_code == 0, r.output
    with av.open(str(mp4)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cat.mp4", "cat.npy"]  # nothing else
    usage_error(runner.invoke(app, args), "-o/--out", "already exists; pass --overwrite")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--frames", "6"], "give 4k+1 frames"),
        (["--size", "33x32"], "multiples of 16"),
        (["--model", "sdxl"], "not a video pipeline"),
        (["--image", "/nope.png"], "cannot read"),
    ],
)
def test_bad_options_are_refused_before_a_weight_is_read(store, tmp_path, extra, says):
    args = ["generate-video", "--models", str(store), "--model", "wan", "--prompt", "a cat",
            "--device", "cpu", "-o", str(tmp_path / "x.mp4"), *extra]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and says in r.output.replace("\n", " "), r.output
    assert not (tmp_path / "x.mp4").exists()
