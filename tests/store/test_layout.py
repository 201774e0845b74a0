from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nostall.errors import ArgumentError, CheckpointError, ReadError
from nostall.store import layout, resolve

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


def test_unlistable_folder_is_a_read_error(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    # Tests run as root, whom chmod does not stop.
    monkeypatch.setattr(layout.os, "listdir", refuse)
    with pytest.raises(ReadError, match="cannot list the folder") as info:
        resolve(tmp_path)
    assert info.value.path == str(tmp_path)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        '{"weight_map": {"a": "x.safetensors"}, "metadata": {"total_size": ' + "9" * 5000 + "}}",
    ],
    ids=["deep", "long int"],
)
def test_hostile_index_json(tmp_path, text):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(CheckpointError, match="shard index") as info:
        resolve(index)
    assert info.value.path == str(index)
    assert "fetch the .index.json again" in str(info.value)


# ---- shards outside the index's folder


def _index_naming(folder, tensors, shard_for):
    """An index in ``folder`` whose tensors live in the files ``shard_for(i)`` names."""
    weight_map = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        rel = shard_for(i % 2)
        target = os.path.normpath(os.path.join(folder, rel))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        part = load_file(target) if os.path.exists(target) else {}
        save_file({**part, name: t}, target)
        weight_map[name] = rel
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    return index


@pytest.mark.parametrize("kind", ["parent", "absolute", "up through a subfolder"])
def test_shards_outside_the_folder_are_refused(tmp_path, tensors, kind):
    inner = tmp_path / "ckpt"
    (inner / "shards").mkdir(parents=True)
    outside = {
        "parent": "../stolen.safetensors",
        "absolute": str(tmp_path / "elsewhere" / "stolen.safetensors"),
        "up through a subfolder": "shards/../../stolen.safetensors",
    }[kind]
    index = _index_naming(inner, tensors, lambda i: outside if i else "own.safetensors")
    with pytest.raises(CheckpointError, match="outside its folder") as info:
        resolve(index)
    assert repr(outside) in str(info.value) and "allow_outside=True" in str(info.value)
    assert info.value.path == str(index)
    # The folder form goes through the same index.
    with pytest.raises(CheckpointError, match="outside its folder"):
        resolve(inner)
    # The caller who trusts the index may opt in.
    ckpt = resolve(index, allow_outside=True)
    assert {e.name for _, e in ckpt.entries()} == set(tensors)
    assert len(resolve(inner, allow_outside=True).files) == 2


def test_shards_in_a_subfolder_are_allowed(tmp_path, tensors):
    index = _index_naming(tmp_path, tensors, lambda i: f"shards/part-{i}.safetensors")
    ckpt = resolve(index)
    assert len(ckpt.files) == 2
    assert {e.name for _, e in ckpt.entries()} == set(tensors)


# ---- special files: refused before they are opened (a FIFO would block forever)


@pytest.mark.timeout(10)
def test_fifo_index_is_refused(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    with pytest.raises(CheckpointError, match="FIFO") as info:
        resolve(index)
    assert info.value.path == str(index)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="FIFO"):
        resolve(tmp_path)


@pytest.mark.timeout(10)
@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_dev_zero_as_index_or_weights_is_refused(tmp_path):
    # An index named like one but linked to /dev/zero would otherwise be read forever.
    index = tmp_path / "model.safetensors.index.json"
    index.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="character device") as info:
        resolve(index)
    assert info.value.path == str(index)
    with pytest.raises(CheckpointError, match="character device"):
        resolve("/dev/zero")
    index.unlink()
    (tmp_path / "diffusion_pytorch_model.safetensors").symlink_to("/dev/urandom")
    with pytest.raises(CheckpointError, match="character device"):
        resolve(tmp_path)


@pytest.mark.timeout(10)
def test_fifo_shard_is_refused_by_name(tmp_path, tensors):
    index = make_sharded(tmp_path, tensors)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(CheckpointError, match="FIFO") as info:
        resolve(index)
    assert info.value.path == str(shard)


# ---- variants, named the way save_pretrained names them


def _save_tiny(library: str, folder, **kwargs) -> set[str]:
    """Save a tiny diffusers or transformers model; return its state_dict keys."""
    if library == "diffusers":
        diffusers = pytest.importorskip("diffusers")
        model = diffusers.AutoencoderKL(
            block_out_channels=[8],
            down_block_types=["DownEncoderBlock2D"],
            up_block_types=["UpDecoderBlock2D"],
            norm_num_groups=4,
            latent_channels=4,
        )
    else:
        transformers = pytest.importorskip("transformers")
        config = transformers.BertConfig(
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=16,
            vocab_size=64,
        )
        model = transformers.BertModel(config)
    model.save_pretrained(folder, **kwargs)
    return set(model.state_dict())


@pytest.mark.parametrize(
    ("library", "stem"), [("diffusers", "diffusion_pytorch_model"), ("transformers", "model")]
)
def test_sharded_variant_written_by_save_pretrained(tmp_path, library, stem):
    plain = _save_tiny(library, tmp_path, max_shard_size="10KB")
    keys = _save_tiny(library, tmp_path, variant="fp16", max_shard_size="10KB")
    names = os.listdir(tmp_path)
    # The naming this test pins down (diffusers 0.42, transformers 5.24):
    assert f"{stem}.safetensors.index.fp16.json" in names
    assert any(n.startswith(f"{stem}.fp16-00001-of-") for n in names)

    ckpt = resolve(tmp_path, variant="fp16")
    assert len(ckpt.files) > 1
    assert all(".fp16-" in os.path.basename(f.path) for f in ckpt.files)
    assert {e.name for _, e in ckpt.entries()} == keys

    # Without a variant, the plain shards beside them are the checkpoint.
    default = resolve(tmp_path)
    assert not any(".fp16" in f.path for f in default.files)
    assert {e.name for _, e in default.entries()} == plain


@pytest.mark.parametrize(
    "old_name",
    [
        "diffusion_pytorch_model.fp16.safetensors.index.json",
        "diffusion_pytorch_model.safetensors.fp16.index.json",  # diffusers' legacy name
    ],
)
def test_older_variant_index_names(tmp_path, tensors, old_name):
    make_sharded(tmp_path, tensors, stem="diffusion_pytorch_model")
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").rename(tmp_path / old_name)
    ckpt = resolve(tmp_path, variant="fp16")
    assert ckpt.source == str(tmp_path) and len(ckpt.files) == 2


@pytest.mark.parametrize("variant", ["", "../fp16", "a/b"])
def test_unusable_variant(tmp_path, variant):
    with pytest.raises(ArgumentError, match="variant="):
        resolve(tmp_path, variant=variant)
