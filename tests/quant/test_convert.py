"""``nostall.quantize``: FP8 conversion of files, shards, components and pipelines (CPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import nostall
from nostall.checkpoint import resolve
from nostall.errors import ArgumentError, CheckpointError
from nostall.quant import convert as convert_mod
from nostall.quant.fp8 import METADATA_KEY, dequantize


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    return {
        "blocks.0.attn.to_q.weight": rnd(64, 32),
        "blocks.0.attn.to_q.bias": rnd(64),
        "blocks.0.norm.weight": rnd(32),
        "blocks.0.ff.weight": rnd(48, 20),  # 20 is not a multiple of 16
        "blocks.0.ff2.weight": rnd(32, 48, dtype=torch.float32),
        "x_embedder.weight": rnd(32, 16),  # first projection: skip list
        "embed_tokens.weight": rnd(128, 32),  # embedding: skip list
        "conv.weight": rnd(8, 4, 3, 3),  # not 2-D
        "steps": torch.arange(4),  # integer
    }


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


@pytest.fixture
def src_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt", "origin": "test"})
    return path


def test_a_file_converts_linear_weights_and_keeps_the_rest(src_file, tmp_path):
    out = tmp_path / "fp8.safetensors"
    seen = []
    report = nostall.quantize(src_file, out, progress=lambda d, t: seen.append((d, t)))
    src, got = load_file(str(src_file)), load_file(str(out))
    q = {"blocks.0.attn.to_q.weight", "blocks.0.ff2.weight"}
    assert report.quantized == 2 and report.kept == len(src) - 2
    for name, t in src.items():
        if name in q:
            assert got[name].dtype == torch.float8_e4m3fn
            scale = got[name + "_scale"]
            assert scale.dtype == torch.float32 and scale.shape == (t.shape[0],)
            assert _sqnr(t, dequantize(got[name], scale, t.dtype)) > 25
        else:
            assert torch.equal(got[name], t), name
            assert name + "_scale" not in got
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["origin"] == "test"
    scheme = json.loads(meta[METADATA_KEY])
    assert scheme["weight_dtype"] == "float8_e4m3fn" and scheme["quantized"] == 2
    assert seen[0][0] == 0 and seen[-1][0] == seen[-1][1] == report.bytes_in
    assert report.kept_reasons["skip list"] == 2
    assert not os.path.exists(str(out) + ".partial")


def test_row_scales_map_each_rows_max_to_448(src_file, tmp_path):
    out = tmp_path / "fp8.safetensors"
    nostall.quantize(src_file, out)
    got = load_file(str(out))
    w = load_file(str(src_file))["blocks.0.attn.to_q.weight"].float()
    scale = got["blocks.0.attn.to_q.weight_scale"]
    assert torch.allclose(scale * 448, w.abs().amax(dim=1))
    assert got["blocks.0.attn.to_q.weight"].float().abs().amax(dim=1).eq(448).all()


def test_the_skip_list_can_grow_and_be_dropped(src_file, tmp_path):
    more = nostall.quantize(src_file, tmp_path / "a.safetensors", skip=[r"attn\."])
    assert more.quantized == 1
    none = nostall.quantize(src_file, tmp_path / "b.safetensors", default_skip=False)
    assert none.quantized == 4  # + x_embedder and embed_tokens


def test_tensors_are_read_and_written_one_at_a_time(src_file, tmp_path, monkeypatch):
    events = []
    real_write = convert_mod.StreamWriter.write

    def write(self, name, tensor):
        events.append(("write", name))
        return real_write(self, name, tensor)

    monkeypatch.setattr(convert_mod.StreamWriter, "write", write)
    real_quant = convert_mod.quantize_weight
    monkeypatch.setattr(
        convert_mod, "quantize_weight", lambda w: events.append(("quant", None)) or real_quant(w)
    )
    nostall.quantize(src_file, tmp_path / "fp8.safetensors")
    # never two tensors read ahead of the writer: a conversion is followed by its writes
    for i, (kind, _) in enumerate(events):
        if kind == "quant":
            assert events[i + 1][0] == "write" and events[i + 2][0] == "write"


def test_a_failure_leaves_nothing_behind(src_file, tmp_path, monkeypatch):
    calls = []

    def boom(w):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return convert_mod.fp8_quantize(w)

    monkeypatch.setattr(convert_mod, "fp8_quantize", convert_mod.quantize_weight, raising=False)
    monkeypatch.setattr(convert_mod, "quantize_weight", boom)
    out = tmp_path / "fp8.safetensors"
    with pytest.raises(RuntimeError, match="disk on fire"):
        nostall.quantize(src_file, out)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_sharded_checkpoints_keep_their_shards_and_index(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    t = _tensors()
    names = sorted(t)
    shards = {
        "model-00001-of-00002.safetensors": names[:5],
        "model-00002-of-00002.safetensors": names[5:],
    }
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(src / shard))
        weight_map.update({k: shard for k in keys})
    with open(src / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": 1}, "weight_map": weight_map}, f)
    (src / "config.json").write_text("{}")
    dst = tmp_path / "dst"
    nostall.quantize(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    q = "blocks.0.attn.to_q.weight"
    assert index["weight_map"][q + "_scale"] == index["weight_map"][q]
    assert index["metadata"]["total_size"] == sum(os.path.getsize(dst / s) for s in shards)
    assert (dst / "config.json").read_text() == "{}"
    ckpt = resolve(dst)  # loads where the input loaded
    assert len(ckpt.files) == 2
    assert load_file(str(dst / index["weight_map"][q]))[q].dtype == torch.float8_e4m3fn


def test_a_pipeline_folder_converts_every_component(tmp_path):
    from nostall.bench.stores import write_store

    store = write_store(tmp_path / "store", ("flux",))
    dst = tmp_path / "flux-fp8"
    report = nostall.quantize(store["flux"], dst)
    assert report.quantized > 0
    src_files = sorted(
        os.path.relpath(os.path.join(d, f), store["flux"])
        for d, _, fs in os.walk(store["flux"])
        for f in fs
    )
    dst_files = sorted(
        os.path.relpath(os.path.join(d, f), dst) for d, _, fs in os.walk(dst) for f in fs
    )
    assert dst_files == src_files  # same layout, same names
    tr = resolve(dst / "transformer").files[0].path
    with safe_open(tr, framework="pt") as f:
        assert METADATA_KEY in f.metadata()
    tok = "tokenizer/tokenizer_config.json"
    if os.path.exists(os.path.join(store["flux"], tok)):
        with open(os.path.join(store["flux"], tok), "rb") as f:
            assert (dst / tok).read_bytes() == f.read()
    assert not os.path.exists(str(dst) + ".partial")


# fmt: off
@pytest.mark.parametrize(
    "make, error, says",
    [
        (
            lambda p: save_file({"w": torch.zeros(16, 16, dtype=torch.float8_e4m3fn)}, p),
            CheckpointError,
            "already holds FP8",
        ),
        (lambda p: save_file({"ids": torch.arange(16)}, p), CheckpointError, "integer"),
        (
            lambda p: save_file({"norm.weight": torch.ones(16)}, p),
            CheckpointError,
            "no linear weight",
        ),
        (
            lambda p: save_file(
                {"a.weight": torch.ones(16, 16), "a.weight_scale": torch.ones(16)}, p
            ),
            CheckpointError,
            "does not know",
        ),
    ],
)
def test_inputs_it_cannot_convert_are_typed_errors(tmp_path, make, error, says):
    src = str(tmp_path / "in.safetensors")
    make(src)
    with pytest.raises(error, match=says) as e:
        nostall.quantize(src, tmp_path / "out.safetensors")
    assert isinstance(e.value, nostall.NostallError)
    assert not os.path.exists(tmp_path / "out.safetensors")


def test_a_converted_checkpoint_is_refused(src_file, tmp_path):
    out = tmp_path / "fp8.safetensors"
    nostall.quantize(src_file, out)
    with pytest.raises(CheckpointError, match="already"):
        nostall.quantize(out, tmp_path / "again.safetensors")


def test_outputs_it_may_not_write_are_argument_errors(src_file, tmp_path):
    out = tmp_path / "fp8.safetensors"
    nostall.quantize(src_file, out)
    with pytest.raises(ArgumentError, match="exists"):
        nostall.quantize(src_file, out)
    nostall.quantize(src_file, out, overwrite=True)
    with pytest.raises(ArgumentError, match=r"\.safetensors"):
        nostall.quantize(src_file, tmp_path / "fp8.bin")
    with pytest.raises(ArgumentError, match="overlaps"):
        nostall.quantize(tmp_path, tmp_path / "inside")
    with pytest.raises(ArgumentError, match="does not exist"):
        nostall.quantize(src_file, tmp_path / "no" / "such.safetensors")
