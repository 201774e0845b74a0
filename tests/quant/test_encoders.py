"""Every text encoder ``quantize`` converts runs its real FP8 forward (CPU: upcast).

The tiny pipelines' encoders have widths that are not multiples of 16 in places (T5's
37-wide feed-forward), so some layers stayed unconverted there. These are built at
widths FP8 takes everywhere, as the real T5-XXL (4096/10240), UMT5-XXL, CLIP-L and
CLIP-G are.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import nostall
from nostall.errors import CheckpointError
from nostall.quant import modules as modules_mod
from nostall.quant.fp8 import quantize_weight
from nostall.store import resolve
from nostall.verify import sqnr_db

pytest.importorskip("transformers")

ENCODERS = ("t5", "umt5", "clip-l", "clip-g")


def build_encoder(kind: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind in ("t5", "umt5"):
        # 32 buckets x 16 heads: T5's relative_attention_bias is a 2-D ".weight" whose
        # sides are multiples of 16, as T5-XXL's (32 x 64), but an nn.Embedding
        cfg = dict(vocab_size=128, d_model=64, d_kv=4, d_ff=128, num_layers=2, num_heads=16,
                   relative_attention_num_buckets=32, feed_forward_proj="gated-gelu")  # fmt: skip
        if kind == "t5":
            return tf.T5EncoderModel(tf.T5Config(**cfg))
        return tf.UMT5EncoderModel(tf.UMT5Config(**cfg))
    cfg = tf.CLIPTextConfig(vocab_size=128, hidden_size=64, intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=32, projection_dim=64)  # fmt: skip
    if kind == "clip-l":
        return tf.CLIPTextModel(cfg)
    return tf.CLIPTextModelWithProjection(cfg)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    out = {}
    for kind in ENCODERS:
        build_encoder(kind).save_pretrained(root / kind)
        out[kind] = root / kind
    return out


def _run(model, device="cpu"):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        out = model(input_ids=ids)
    return (out.text_embeds if hasattr(out, "text_embeds") else out[0]).float()


@pytest.mark.parametrize("kind", ENCODERS)
def test_each_encoder_runs_its_fp8_forward_on_the_cpu(encoders, tmp_path, kind):
    report = nostall.quantize(encoders[kind], tmp_path / kind)
    fp8 = nostall.load_model(tmp_path / kind)
    layers = [m for m in fp8.modules() if isinstance(m, nn.Linear)]
    converted = [m for m in layers if m.weight.dtype == torch.float8_e4m3fn]
    assert len(converted) == report.quantized > 0
    if kind in ("t5", "umt5"):
        # wo stays: T5 casts the feed-forward's activations to wo.weight's dtype
        assert report.kept_reasons["the model keeps it in full precision"] == 2
        # the relative attention bias is an embedding (T5: layer 0 only; UMT5: every layer)
        assert report.kept_reasons["not an nn.Linear weight"] >= 1
        assert all(m.weight.dtype == torch.float32 for n, m in fp8.named_modules()
                   if n.endswith(".wo"))  # fmt: skip
    out = _run(fp8)
    assert out.isfinite().all()
    assert sqnr_db(_run(nostall.load_model(encoders[kind])), out) > 15


def _convert_wo_too(src, dst):
    """A community-style file that converted T5's wo as well (one scale per row)."""
    import shutil

    shutil.copytree(src, dst)
    (f,) = resolve(dst).files
    t = load_file(f.path)
    for name in [n for n in t if n.endswith("DenseReluDense.wo.weight")]:
        q, s = quantize_weight(t[name])
        t[name], t[name + "_scale"] = q, s
    save_file(t, f.path, metadata={"format": "pt"})
    return dst


def test_fp8_in_a_layer_the_model_keeps_in_full_precision(encoders, tmp_path, caplog):
    dst = _convert_wo_too(encoders["t5"], tmp_path / "t5-wo")
    modules_mod._said.clear()
    with caplog.at_level(logging.INFO, logger="nostall.quant.modules"):
        model = nostall.load_model(dst)  # dequantized once, said once
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo
    assert wo.weight.dtype == torch.float32 and type(wo) is nn.Linear
    assert sum("dequantized" in r.getMessage() for r in caplog.records) == 1
    assert sqnr_db(_run(nostall.load_model(encoders["t5"])), _run(model)) > 20
    # where nothing may be read (the model cache binds while copies run): a typed error
    module = nostall.load_model(encoders["t5"])
    name = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    q, s = quantize_weight(module.get_parameter(name).detach())
    module.get_submodule(name[: -len(".weight")]).weight = nn.Parameter(q, requires_grad=False)
    with pytest.raises(CheckpointError, match="keeps in float32") as info:
        modules_mod.install_fp8(module, {name: s}, dequantize_kept=False)
    assert info.value.tensor == name


@pytest.mark.parametrize("case, says", [("int scale", "floating point"), ("2-D scale", "shape")])
def test_scales_of_the_wrong_dtype_or_shape_are_refused(encoders, tmp_path, case, says):
    import shutil

    dst = tmp_path / "bad"
    nostall.quantize(encoders["clip-l"], dst)
    (f,) = resolve(dst).files
    t = load_file(f.path)
    name = next(n for n in t if n.endswith("q_proj.weight_scale"))
    t[name] = (
        t[name].to(torch.int32) if case == "int scale" else t[name].reshape(1, -1).repeat(2, 1)
    )
    save_file(t, f.path, metadata=f.metadata)
    with pytest.raises(CheckpointError, match=says) as info:
        nostall.load_model(dst)
    assert info.value.tensor == name and str(dst) in str(info.value)
    shutil.rmtree(dst)
