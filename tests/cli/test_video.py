"""``nostall decode``: Wan latents files to video files; every option and output checked
before the VAE is read."""

from __future__ import annotations

import pytest
from cli_support import fork_cli, plain, runner, usage_error

from nostall.cli import app


def _latents(path, channels=16, seed=1):
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.save(torch.randn(1, channels, 4, 6, 8, generator=g), path)
    return str(path)


def test_decode_one_file_to_mp4(tmp_path, wan_folder):
    import av

    z = _latents(tmp_path / "z.pt")
    out = tmp_path / "v.mp4"
    args = ["decode", z, "--vae", str(wan_folder), "-o", str(out), "--no-denormalize"]
    result = runner.invoke(app, [*args, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "13 frames" in result.output
    with av.open(str(out)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 13


def test_an_existing_output_needs_overwrite(tmp_path, wan_folder):
    import numpy as np

    z = _latents(tmp_path / "z.pt")
    out = tmp_path / "v.npy"
    out.write_bytes(b"mine")
    args = ["decode", z, "--vae", str(wan_folder), "-o", str(out), "--no-denormalize"]
    refused = runner.invoke(app, [*args, "--device", "cpu"])
    usage_error(refused, "already exists; pass --overwrite")
    assert out.read_bytes() == b"mine"
    result = runner.invoke(app, [*args, "--device", "cpu", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert np.load(out).shape == (13, 48, 64, 3)


def test_decode_mode_exact_gives_the_eager_frames(tmp_path, wan_folder):
    import numpy as np

    z = _latents(tmp_path / "z.pt")
    frames = {}
    for mode in ("eager", "exact"):
        out = tmp_path / f"{mode}.npy"
        args = ["decode", z, "--vae", str(wan_folder), "-o", str(out), "--no-denormalize"]
        result = runner.invoke(app, [*args, "--device", "cpu", "--mode", mode])
        assert result.exit_code == 0, result.output
        frames[mode] = np.load(out)
    assert frames["exact"].shape[0] == 13
    assert np.array_equal(frames["exact"], frames["eager"])
    args = ["decode", z, "--vae", str(wan_folder), "-o", str(tmp_path / "x.npy")]
    result = runner.invoke(app, [*args, "--no-denormalize", "--mode", "turbo"])
    usage_error(result, "'turbo' is not one of eager, exact, fast")
    assert not (tmp_path / "x.npy").exists()


def test_decode_devices_are_checked_before_the_vae_is_read(tmp_path, wan_folder):
    z = _latents(tmp_path / "z.pt")
    base = ["decode", z, "--vae", str(wan_folder), "-o", str(tmp_path / "x.npy")]
    result = runner.invoke(app, [*base, "--no-denormalize", "--devices", "cuda:0,cuda:1"])
    usage_error(result, "--mode exact")
    args = [*base, "--no-denormalize", "--mode", "exact", "--devices", "cuda:0,cuda:0"]
    result = runner.invoke(app, args)
    usage_error(result, "twice")
    assert not (tmp_path / "x.npy").exists()


@pytest.mark.parametrize("sync", [False, True])
def test_decode_several_files_back_to_back(tmp_path, wan_folder, sync):
    import numpy as np

    zs = [_latents(tmp_path / f"clip{i}.pt", seed=i) for i in range(3)]
    out = tmp_path / "out"
    out.mkdir()
    args = ["decode", *zs, "--vae", str(wan_folder), "-o", str(out), "--suffix", ".npy"]
    args += ["--device", "cpu", "--no-denormalize"]
    result = runner.invoke(app, args + (["--sync"] if sync else []))
    assert result.exit_code == 0, result.output
    videos = [np.load(out / f"clip{i}.npy") for i in range(3)]
    assert all(v.shape == (13, 48, 64, 3) and v.dtype == np.uint8 for v in videos)
    assert not np.array_equal(videos[0], videos[1])  # each file got its own latents
    assert sorted(p.name for p in out.iterdir()) == ["clip0.npy", "clip1.npy", "clip2.npy"]


def test_decode_checks_every_input_before_decoding(tmp_path, wan_folder, fork_python):
    good = _latents(tmp_path / "a.pt")
    bad = _latents(tmp_path / "b.pt", channels=12)
    out = tmp_path / "out"
    out.mkdir()
    options = ["--vae", str(wan_folder), "-o", str(out), "--device", "cpu", "--no-denormalize"]
    proc = fork_cli(fork_python, "decode", good, bad, *options)
    assert proc.returncode == 2, proc.stderr
    assert "b.pt" in proc.stdout and "channels" in proc.stdout and "Traceback" not in proc.stderr
    assert list(out.iterdir()) == []  # not even the good one was started


def test_decode_refuses_a_batch_before_the_vae_is_loaded_in_one_line(
    tmp_path, wan_folder, fork_python
):
    """Latents files hold one video each: a batch of 2 is refused before the VAE is read
    (this VAE's weights are missing: loading it would fail first) and before the bar,
    one line naming the file, the shape and the fix, exit 2."""
    import shutil

    import torch

    vae = tmp_path / "vae"
    vae.mkdir()
    shutil.copy(wan_folder / "config.json", vae / "config.json")
    batch = tmp_path / "batch.pt"
    torch.save(torch.randn(2, 16, 4, 6, 8), batch)
    out = tmp_path / "out"
    out.mkdir()
    options = ["--vae", str(vae), "-o", str(out), "--device", "cpu", "--no-denormalize"]
    proc = fork_cli(fork_python, "decode", str(batch), *options)  # as a user sees it: one line
    said = plain(proc.stdout)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "decoding" not in said
    assert "batch.pt: latents hold a batch of 2 videos (shape (2, 16, 4, 6, 8))" in said
    assert "split the batch" in said and "to_uint8_frames" not in said
    assert proc.stdout.count("error:") == 1 and list(out.iterdir()) == []
    # a good file first does not start the decode either; nor do channels the VAE's
    # config does not take (in this process: the error the console script prints)
    from nostall.errors import LatentsError

    wide = _latents(tmp_path / "wide.pt", channels=48)
    for args, says in (
        ([_latents(tmp_path / "a.pt"), str(batch)], "batch.pt: latents hold a batch of 2"),
        ([wide], "wide.pt: latents have 48 channels"),
    ):
        result = runner.invoke(app, ["decode", *args, *options])
        assert isinstance(result.exception, LatentsError), result.output
        assert says in plain(str(result.exception)) and "decoding" not in result.output
        assert list(out.iterdir()) == []


def test_decode_several_files_needs_an_output_folder(tmp_path, wan_folder):
    zs = [_latents(tmp_path / f"c{i}.pt") for i in range(2)]
    result = runner.invoke(
        app,
        ["decode", *zs, "--vae", str(wan_folder), "-o", str(tmp_path / "v.mp4"), "--denormalize"],
    )
    usage_error(result, "must be an existing folder")


def test_decode_with_denormalize_decodes_the_denormalised_latents(tmp_path, wan_folder):
    import numpy as np
    import torch
    from diffusers import AutoencoderKLWan

    from nostall.video import decode_to_file, denormalize

    z = _latents(tmp_path / "z.pt")
    out = tmp_path / "v.npy"
    args = ["decode", z, "--vae", str(wan_folder), "-o", str(out), "--device", "cpu"]
    result = runner.invoke(app, [*args, "--denormalize"])
    assert result.exit_code == 0, result.output
    vae = AutoencoderKLWan.from_pretrained(wan_folder).eval()
    with torch.inference_mode():
        decode_to_file(vae, denormalize(vae, torch.load(z)), tmp_path / "ref.npy")
    assert np.array_equal(np.load(out), np.load(tmp_path / "ref.npy"))


def test_decode_requires_the_normalisation_choice(tmp_path, wan_folder):
    z = _latents(tmp_path / "z.pt")
    args = ["decode", z, "--vae", str(wan_folder), "-o", str(tmp_path / "v.mp4")]
    result = runner.invoke(app, args)
    usage_error(
        result,
        "--denormalize for latents a pipeline saved with output_type='latent'",
        "--no-denormalize",
    )
    assert not (tmp_path / "v.mp4").exists()


@pytest.mark.parametrize(
    ("output", "extra", "says"),
    [
        ("v.avi", [], "unsupported output suffix '.avi'"),
        ("missing/v.mp4", [], "does not exist"),
        ("v.mp4", ["--crf", "60"], "crf must be a number in 0..51"),
        ("v.mp4", ["--fps", "0"], "fps must be positive"),
        ("v.mp4", ["--preset", "warp"], "unknown x264 preset 'warp'"),
        ("v.mp4", ["--dtype", "int8"], "not a cast target"),
        ("v.mp4", ["--device", "tpu"], "'tpu' is not a device"),
    ],
)
def test_decode_checks_the_output_before_reading_the_vae(tmp_path, output, extra, says):
    z = _latents(tmp_path / "z.pt")
    no_vae = tmp_path / "no-such-vae"  # loading it would fail with a CheckpointError
    cmd = ["decode", z, "--vae", str(no_vae), "-o", str(tmp_path / output), "--denormalize"]
    result = runner.invoke(app, [*cmd, *extra])
    usage_error(result, says)
    assert "no-such-vae" not in plain(result.output)
