"""decode_files / output_paths: latents files → videos, every input checked before any decode."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from nostall.errors import ArgumentError, LatentsError, SinkError
from nostall.video import decode_files, decode_to_file, denormalize, output_paths
from nostall.video.files import _looks_normalized


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()


def normalised(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, 4, 6, 8, generator=g)  # 13 frames of 48 x 64


def save(path, z) -> str:
    torch.save(z, path)
    return str(path)


def decoded(vae, z, path) -> np.ndarray:
    decode_to_file(vae, z, path)
    return np.load(path)


# ---- output_paths -----------------------------------------------------------------------


def test_output_paths(tmp_path):
    assert output_paths(["a.pt"], "clip.mp4") == ["clip.mp4"]
    got = output_paths(["x/a.pt", "y/b.safetensors"], tmp_path, suffix=".npy")
    assert got == [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]
    with pytest.raises(ArgumentError, match="must be an existing folder"):
        output_paths(["a.pt", "b.pt"], tmp_path / "v.mp4")
    with pytest.raises(ArgumentError, match=r"\.mp4, \.npy, \.y4m, not '\.avi'"):
        output_paths(["a.pt", "b.pt"], tmp_path, suffix=".avi")
    with pytest.raises(ArgumentError, match=r"'x/a\.pt' and 'y/a\.npy' would both be written"):
        output_paths(["x/a.pt", "y/a.npy"], tmp_path)
    with pytest.raises(ArgumentError, match="at least one"):
        output_paths([], tmp_path)


# ---- decode_files -----------------------------------------------------------------------


@pytest.mark.parametrize("sync", [False, True])
def test_each_file_is_decoded_exactly_to_its_output(tmp_path, vae, sync):
    zs = [normalised(i) for i in range(3)]
    paths = [save(tmp_path / f"z{i}.pt", z) for i, z in enumerate(zs)]
    out = tmp_path / "out"
    out.mkdir()
    seen = []
    results = decode_files(
        paths,
        vae,
        output_paths(paths, out, suffix=".npy"),
        denormalize=False,
        sync=sync,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert [r.path for r in results] == [str(out / f"z{i}.npy") for i in range(3)]
    assert [r.frames for r in results] == [13, 13, 13]
    for i, z in enumerate(zs):
        assert np.array_equal(np.load(out / f"z{i}.npy"), decoded(vae, z, tmp_path / "ref.npy"))
    assert seen[0] == (0, 39) and seen[-1] == (39, 39)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_denormalize_true_decodes_the_denormalised_latents(tmp_path, vae):
    z = normalised(5)
    (result,) = decode_files(
        [save(tmp_path / "z.pt", z)], vae, [tmp_path / "v.npy"], denormalize=True
    )
    expected = decoded(vae, denormalize(vae, z), tmp_path / "ref.npy")
    assert np.array_equal(np.load(result.path), expected)
    assert not np.array_equal(expected, decoded(vae, z, tmp_path / "plain.npy"))


def test_latents_are_moved_to_the_vae_dtype(tmp_path, vae):
    z = normalised(1)
    path = save(tmp_path / "z.pt", z.to(torch.float64))  # the VAE is fp32
    (result,) = decode_files([path], vae, [tmp_path / "v.npy"], denormalize=False)
    assert np.array_equal(np.load(result.path), decoded(vae, z, tmp_path / "ref.npy"))


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.zeros(1, 12, 4, 6, 8), r"b\.pt: latents have 12 channels"),
        (torch.full((1, 16, 4, 6, 8), float("inf")), r"b\.pt: latents hold 3072 non-finite"),
        (torch.zeros(2, 16, 4, 6, 8), r"b\.pt: latents hold a batch of 2 videos.*split the batch"),
    ],
)
def test_every_input_is_checked_before_any_decode(tmp_path, vae, monkeypatch, bad, match):
    def boom(*a, **k):
        raise AssertionError("decoded before every input was checked")

    monkeypatch.setattr("nostall.video.files.submit_decode", boom)
    monkeypatch.setattr("nostall.video.files.decode_to_file", boom)
    paths = [save(tmp_path / "a.pt", normalised(0)), save(tmp_path / "b.pt", bad)]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(LatentsError, match=match):
        decode_files(paths, vae, output_paths(paths, out), denormalize=False)
    assert os.listdir(out) == []


def test_latents_files_are_checked_before_a_vae_is_loaded(tmp_path, vae):
    """What nostall decode runs first: the files against the channels the VAE's
    config.json names, the VAE not loaded yet."""
    from nostall.errors import UnsupportedError
    from nostall.video.files import read_latents_files, vae_latent_channels

    folder = tmp_path / "vae"
    vae.save_pretrained(folder)
    (folder / "diffusion_pytorch_model.safetensors").unlink()  # never read here
    assert vae_latent_channels(folder) == 16
    assert vae_latent_channels(folder / "diffusion_pytorch_model.safetensors") == 16
    assert vae_latent_channels(tmp_path / "nowhere") is None  # loading it will say why
    good = save(tmp_path / "a.pt", normalised(0))
    (z,) = read_latents_files([good], z_dim=16)
    assert torch.equal(z, normalised(0))
    cases = [
        (torch.zeros(2, 16, 4, 6, 8), r"b\.pt: latents hold a batch of 2 videos \(shape \(2, 16"),
        (torch.zeros(1, 48, 4, 6, 8), r"b\.pt: latents have 48 channels.*z_dim=16"),
        (torch.zeros(1, 16, 4, 6, 8, dtype=torch.int32), r"b\.pt: .*floating point"),
        (torch.zeros(16, 4, 6, 8), r"b\.pt: latents must be 5-D"),
    ]
    for bad, match in cases:
        with pytest.raises(LatentsError, match=match):
            read_latents_files([good, save(tmp_path / "b.pt", bad)], z_dim=16)
    read_latents_files([save(tmp_path / "c.pt", torch.zeros(1, 48, 2, 2, 2))], z_dim=None)
    (folder / "config.json").write_text('{"_class_name": "AutoencoderKL", "latent_channels": 4}')
    with pytest.raises(UnsupportedError, match="AutoencoderKLWan"):
        vae_latent_channels(folder)


def test_outputs_are_checked_before_the_latents_are_read(tmp_path, vae):
    missing_latents = str(tmp_path / "nowhere.pt")
    with pytest.raises(SinkError, match=r"crf must be a number in 0\.\.51"):
        decode_files([missing_latents], vae, [tmp_path / "v.mp4"], denormalize=False, crf=60)
    with pytest.raises(SinkError, match="does not exist"):
        decode_files([missing_latents], vae, [tmp_path / "no" / "v.mp4"], denormalize=False)


def test_the_normalisation_choice_is_required(tmp_path, vae):
    path = save(tmp_path / "z.pt", normalised(0))
    with pytest.raises(ArgumentError, match="denormalize must be True"):
        decode_files([path], vae, [tmp_path / "v.npy"], denormalize=None)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="2 outputs"):
        decode_files([path], vae, [tmp_path / "a.npy", tmp_path / "b.npy"], denormalize=False)


# ---- the normalisation hint -------------------------------------------------------------


def test_normalisation_is_told_apart_only_when_clear(vae):
    z = normalised(3)
    assert _looks_normalized(vae, z) is True
    assert _looks_normalized(vae, denormalize(vae, z)) is False
    assert _looks_normalized(vae, 0.3 * z) is None  # a flat video: neither fits
    assert _looks_normalized(vae, torch.zeros(1, 16, 1, 2, 2)) is None


@pytest.mark.parametrize(
    ("denormalized_input", "choice", "warning"),
    [
        (False, False, "look normalised"),
        (True, True, "look already de-normalised"),
        (False, True, None),
        (True, False, None),
    ],
)
def test_a_contradicting_choice_is_warned_about(
    tmp_path, vae, caplog, denormalized_input, choice, warning
):
    z = normalised(4)
    if denormalized_input:
        z = denormalize(vae, z)
    path = save(tmp_path / "z.pt", z)
    with caplog.at_level(logging.WARNING, logger="nostall.video.files"):
        decode_files([path], vae, [tmp_path / "v.npy"], denormalize=choice)
    if warning is None:
        assert caplog.records == []
    else:
        assert len(caplog.records) == 1
        assert warning in caplog.text and "z.pt" in caplog.text
