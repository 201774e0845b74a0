"""Checkpoints in a model's original key names (the community's Wan single files, ComfyUI's
scaled FP8) are read under the diffusers class's names: renamed by diffusers' own
converter, nothing copied; what only a conversion could read is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")

from nostall.errors import CheckpointError
from nostall.store import FileIndex, TensorEntry, resolve
from nostall.store.names import diffusers_names
from nostall.synthetic.comfy import original_wan_name

# Wan 2.1 T2V-14B's transformer (Wan-AI/Wan2.1-T2V-14B-Diffusers) and I2V's image embedder.
WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
    cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip


def _meta_names(**config) -> dict[str, tuple[int, ...]]:
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _index(names: dict[str, tuple[int, ...]], dtype="BF16", path="/x.safetensors") -> FileIndex:
    entries, at = [], 8
    for name, shape in names.items():
        entries.append(TensorEntry(name, dtype, shape, at, at + 2))
        at += 2
    return FileIndex(path, at, 8, at, tuple(entries))


def _folder(tmp_path, cls="WanTransformer3DModel"):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": cls}))
    return str(tmp_path)


@pytest.mark.parametrize(
    "config",
    [WAN_14B, {**WAN_14B, "num_layers": 2, "image_dim": 1280, "added_kv_proj_dim": 5120}],
    ids=["t2v-14b", "i2v"],
)
def test_the_original_wan_names_of_a_real_size_transformer_come_back_as_diffusers(tmp_path, config):
    ours = _meta_names(**config)
    theirs = {original_wan_name(k): v for k, v in ours.items()}
    assert len(theirs) == len(ours)
    assert "blocks.0.self_attn.q.weight" in theirs and "head.head.weight" in theirs
    assert "blocks.0.norm3.weight" in theirs  # Wan's cross-attention norm is its norm3
    (files,), layout = diffusers_names((_index(theirs),), _folder(tmp_path))
    assert layout == "the original WanTransformer3DModel layout"
    assert {e.name: e.shape for e in files.tensors} == ours
    back = {e.name: e.key for e in files.tensors}
    assert all(back[k] == original_wan_name(k) for k in ours)
    assert [e.begin for e in files.tensors] == [e.begin for e in _index(theirs).tensors]


def test_diffusers_names_are_left_as_they_are(tmp_path):
    ours = _meta_names(**{**WAN_14B, "num_layers": 2})
    index = _index(ours)
    (files,), layout = diffusers_names((index,), _folder(tmp_path))
    assert layout == "diffusers" and files is index


def test_original_names_without_a_wan_config_are_not_renamed(tmp_path):
    theirs = {
        original_wan_name(k): v for k, v in _meta_names(**{**WAN_14B, "num_layers": 1}).items()
    }
    index = _index(theirs)
    assert diffusers_names((index,), str(tmp_path))[1] == "diffusers"  # no config.json
    other = _folder(tmp_path, "FluxTransformer2DModel")
    assert diffusers_names((index,), other)[1] == "diffusers"


def test_comfy_scale_names_become_nostalls_where_the_file_holds_fp8(tmp_path):
    names = {
        "scaled_fp8": (0,),
        "blocks.0.self_attn.q.weight": (16, 16),
        "blocks.0.self_attn.q.scale_weight": (),
        "blocks.0.self_attn.q.scale_input": (),
    }
    entries, at = [], 8
    for name, shape in names.items():
        dtype = "F8_E4M3" if name.endswith(".weight") or name == "scaled_fp8" else "F32"
        entries.append(TensorEntry(name, dtype, shape, at, at + 4))
        at += 4
    index = FileIndex("/x", at, 8, at, tuple(entries))
    (files,), layout = diffusers_names((index,), _folder(tmp_path))
    assert layout == "the original WanTransformer3DModel layout and ComfyUI's scaled FP8"
    assert [e.name for e in files.tensors] == [
        "scaled_fp8",
        "blocks.0.attn1.to_q.weight",
        "blocks.0.attn1.to_q.weight_scale",
        "blocks.0.attn1.to_q.input_scale",
    ]
    # Without FP8 in the file a tensor named scale_weight is nobody's business.
    plain = FileIndex("/y", 12, 8, 12, (TensorEntry("a.scale_weight", "F32", (), 8, 12),))
    assert diffusers_names((plain,), str(tmp_path / "nowhere"))[1] == "diffusers"


def test_a_converter_that_changes_tensors_is_refused_by_name(tmp_path, monkeypatch):
    import diffusers.loaders.single_file_utils as utils

    theirs = {
        original_wan_name(k): v for k, v in _meta_names(**{**WAN_14B, "num_layers": 1}).items()
    }
    folder = _folder(tmp_path)

    def slices(sd, **kw):
        return {k: v[0] for k, v in sd.items()}

    monkeypatch.setattr(utils, "convert_wan_transformer_to_diffusers", slices)
    with pytest.raises(CheckpointError, match="changes this WanTransformer3DModel checkpoint"):
        diffusers_names((_index(theirs),), folder)

    def drops(sd, **kw):
        sd.pop(next(iter(sd)))
        return sd

    monkeypatch.setattr(utils, "convert_wan_transformer_to_diffusers", drops)
    with pytest.raises(CheckpointError, match=r"makes \d+ tensors of this checkpoint's") as e:
        diffusers_names((_index(theirs),), folder)
    assert "save_pretrained" in str(e.value) and str(tmp_path) in str(e.value)


def test_a_file_mixing_both_layouts_is_refused_naming_the_tensor(tmp_path):
    names = {"blocks.0.self_attn.q.weight": (8, 8), "blocks.0.attn1.to_q.weight": (8, 8)}
    with pytest.raises(CheckpointError, match=r"two tensors are read as 'blocks\.0\.attn1\.to_q"):
        diffusers_names((_index(names),), _folder(tmp_path))


def test_resolve_reads_a_component_folder_and_a_file_beside_its_config(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "transformer"
    folder.mkdir()
    _folder(folder)
    save_file({"blocks.0.self_attn.q.weight": torch.ones(4, 4)}, folder / "wan.safetensors")
    for source in (folder, folder / "wan.safetensors"):
        ckpt = resolve(source)
        assert ckpt.layout == "the original WanTransformer3DModel layout"
        (e,) = ckpt.files[0].tensors
        assert (e.name, e.key) == ("blocks.0.attn1.to_q.weight", "blocks.0.self_attn.q.weight")
