"""load_model: the collector is paused while Python objects are made, never left paused."""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import save_file

import nostall
import nostall.assemble
from nostall.errors import ModelMismatchError
from nostall.transfer.loader import Loader

diffusers = pytest.importorskip("diffusers")

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture
def flux_folder(tmp_path):
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )
    model.save_pretrained(tmp_path)
    return tmp_path, model.state_dict()


def test_the_collector_is_paused_while_building_and_adopting_not_while_reading(
    flux_folder, monkeypatch
):
    folder, state = flux_folder
    seen: dict[str, bool] = {}
    build, adopt, load = nostall.assemble.build_empty, nostall.assemble.adopt, Loader.load

    def record(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] = gc.isenabled()
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(nostall.assemble, "build_empty", record("build", build))
    monkeypatch.setattr(nostall.assemble, "adopt", record("adopt", adopt))
    monkeypatch.setattr(Loader, "load", record("load", load))
    module = nostall.load_model(folder)
    assert seen == {"build": False, "load": True, "adopt": False}
    assert gc.isenabled()
    for name, value in state.items():
        assert torch.equal(module.state_dict()[name], value), name


def test_a_failed_load_leaves_the_collector_running(flux_folder):
    folder, state = flux_folder
    save_file({**state, "extra.weight": torch.zeros(2)}, str(folder / WEIGHTS))
    with pytest.raises(ModelMismatchError, match=r"extra\.weight"):
        nostall.load_model(folder)
    assert gc.isenabled()
