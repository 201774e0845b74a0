from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from nostall.checkpoint import resolve
from nostall.errors import CheckpointError

from support import make_sharded


def test_single_file(ckpt_file, tensors):
    ckpt = resolve(ckpt_file)
    assert len(ckpt.files) == 1 and ckpt.folder is None
    assert ckpt.num_tensors == len(tensors)
    assert ckpt.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_sharded_index(tmp_path, tensors):
    index = make_sharded(tmp_path, tensors, shards=3)
    ckpt = resolve(index)
    assert len(ckpt.files) == 3
    assert {e.name for _, e in ckpt.entries()} == set(tensors)


def test_missing_shard(tmp_path, tensors):
    index = make_sharded(tmp_path, tensors)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing") as info:
        resolve(index)
    assert "model-00002-of-00002.safetensors" in str(info.value)
    assert info.value.path == str(index)


def test_index_points_at_wrong_shard(tmp_path, tensors):
    index = make_sharded(tmp_path, tensors)
    doc = json.loads(index.read_text())
    name = next(iter(doc["weight_map"]))
    other = {v for v in doc["weight_map"].values() if v != doc["weight_map"][name]}.pop()
    doc["weight_map"][name] = other
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="does not hold it") as info:
        resolve(index)
    assert info.value.tensor == name


def test_bad_index_json(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        resolve(index)
    index.write_text(json.dumps({"weight_map": [1]}))
    with pytest.raises(CheckpointError, match="weight_map"):
        resolve(index)


@pytest.mark.parametrize("stem", ["diffusion_pytorch_model", "model"])
def test_component_folder(tmp_path, tensors, stem):
    (tmp_path / "config.json").write_text("{}")
    save_file(tensors, str(tmp_path / f"{stem}.safetensors"))
    ckpt = resolve(tmp_path)
    assert ckpt.folder == str(tmp_path)
    assert ckpt.files[0].path.endswith(f"{stem}.safetensors")


def test_component_folder_sharded_and_variant(tmp_path, tensors):
    (tmp_path / "config.json").write_text("{}")
    make_sharded(tmp_path, tensors, stem="diffusion_pytorch_model")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "diffusion_pytorch_model.fp16.safetensors"))
    assert len(resolve(tmp_path).files) == 2
    assert resolve(tmp_path, variant="fp16").files[0].path.endswith(".fp16.safetensors")


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "a.safetensors").write_bytes(b"")
    (tmp_path / "b.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"a\.safetensors, b\.safetensors"):
        resolve(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        resolve(tmp_path / "nope.safetensors")
