"""``nostall demo``: run once for the module, every part's report checked; its options
are checked before anything runs."""

from __future__ import annotations

import pytest
from cli_support import runner, usage_error

from nostall.cli import app


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo on the CPU with an 8 MB checkpoint: its result and its video's path."""
    video = tmp_path_factory.mktemp("demo") / "demo.mp4"
    args = ["demo", "--device", "cpu", "--size-mb", "8", "--video", str(video)]
    return runner.invoke(app, args), video


@pytest.mark.slow
def test_demo_succeeds(demo):
    result, _ = demo
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_demo_loads_bit_equal_to_safetensors(demo):
    result, _ = demo
    assert "memory-cache hit" in result.output
    assert "nostall (s3://, rclone on loopback)" in result.output  # the test extra has both
    assert "All tensors equal" in result.output


@pytest.mark.slow
def test_demo_switches_and_quantizes(demo):
    result, _ = demo
    assert "Every image equal to the same pipeline from diffusers' from_pretrained" in (
        result.output.replace("\n", " ")
    )
    assert "FP8: nostall quantize converted" in result.output
    assert "0.50x" not in result.output  # a claim the demo did not measure


@pytest.mark.slow
def test_demo_serves_over_http(demo):
    result, _ = demo
    assert "Every served image equal to the same diffusers pipeline's" in result.output
    assert "no pipeline 'flux-pro'" in result.output


@pytest.mark.slow
def test_demo_decodes_a_video_and_each_decoder_mode(demo):
    import av

    result, video = demo
    assert "decoder mode exact" in result.output and "bit-identical" in result.output
    with av.open(str(video)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 17


def test_an_existing_video_needs_overwrite_and_a_folder_is_refused(tmp_path):
    video = tmp_path / "demo.mp4"
    video.write_bytes(b"mine")
    result = runner.invoke(app, ["demo", "--device", "cpu", "--video", str(video)])
    usage_error(result, "--video", "already exists; pass --overwrite")
    assert "nostall demo on" not in result.output  # refused before anything ran
    assert video.read_bytes() == b"mine"
    result = runner.invoke(app, ["demo", "--device", "cpu", "--video", str(tmp_path)])
    usage_error(result, "is a folder, but a file is written there")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--size-mb", "0"], "'--size-mb': 0 is out of range; give at least 1"),
        (["--video", "demo.avi"], "unsupported output suffix '.avi'"),
    ],
)
def test_bad_demo_options_are_usage_errors(tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    usage_error(runner.invoke(app, ["demo", "--device", "cpu", *args]), says)


def test_demo_on_cuda_without_a_gpu_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = runner.invoke(app, ["demo", "--device", "cuda"])
    usage_error(result, "Invalid value for '--device'", "no usable CUDA GPU")
    assert "nostall demo on" not in result.output
