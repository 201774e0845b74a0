"""What the CLI tests share: one tiny store and one tiny Wan VAE, written once."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    """Tiny random FLUX, FLUX-b (FLUX with its own transformer) and SDXL pipelines: the
    layout ``nostall bench switch --size tiny`` writes, so it reuses them."""
    from nostall.synthetic import write_store

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("cli-store")
    write_store(folder, ("flux", "flux-b", "sdxl"))
    return folder


@pytest.fixture(scope="session")
def wan_folder(tmp_path_factory):
    """A narrow random AutoencoderKLWan component folder (16 latent channels)."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    folder = tmp_path_factory.mktemp("wan") / "vae"
    vae.save_pretrained(folder)
    return folder
