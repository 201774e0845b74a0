"""The tiny image stores of :mod:`nostall.synthetic.tiny`: what their fine-tunes share."""

from __future__ import annotations

import os

from safetensors.torch import load_file

from nostall.synthetic import write_store


def _weights(folder: str) -> dict:
    (name,) = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    return load_file(os.path.join(folder, name))


def test_the_sdxl_fine_tunes_share_all_but_the_unet_byte_for_byte(tmp_path):
    paths = write_store(tmp_path, ("sdxl", "sdxl-b", "sdxl-c"))
    for role in ("text_encoder", "text_encoder_2", "vae"):
        base = _weights(os.path.join(paths["sdxl"], role))
        for tune in ("sdxl-b", "sdxl-c"):
            other = _weights(os.path.join(paths[tune], role))
            assert base.keys() == other.keys()
            assert all(base[k].equal(other[k]) for k in base), (tune, role)
    unets = [_weights(os.path.join(paths[n], "unet")) for n in ("sdxl", "sdxl-b", "sdxl-c")]
    key = next(k for k in unets[0] if k.endswith("conv_in.weight"))
    assert not unets[0][key].equal(unets[1][key]) and not unets[1][key].equal(unets[2][key])
