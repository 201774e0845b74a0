"""FP8 checkpoints through ``load_model``: e4m3 storage, upcast per call (CPU)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import nostall
from nostall.errors import CheckpointError
from nostall.quant import modules as modules_mod
from nostall.store import resolve
from nostall.verify import sqnr_db


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    from nostall.synthetic import write_store

    root = tmp_path_factory.mktemp("store")
    flux = write_store(root, ("flux",))["flux"]
    return {c: os.path.join(flux, c) for c in ("text_encoder", "text_encoder_2")}


def _run(model, seed=0):
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids)[0].float()


def _linears(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("component", ["text_encoder", "text_encoder_2"])
def test_a_converted_encoder_loads_fp8_and_computes_close(encoders, tmp_path, component, caplog):
    src, dst = encoders[component], tmp_path / component
    report = nostall.quantize(src, dst)
    ref = nostall.load_model(src)
    modules_mod._said.clear()
    with caplog.at_level(logging.INFO, logger="nostall.quant.modules"):
        fp8 = nostall.load_model(dst)
        nostall.load_model(dst)
    fp8_layers = [m for m in _linears(fp8) if m.weight.dtype == torch.float8_e4m3fn]
    assert len(fp8_layers) == report.quantized
    assert all(type(m).__name__.startswith("FP8") and m.weight_scale.dtype == torch.float32
               for m in fp8_layers)  # fmt: skip
    assert sqnr_db(_run(ref), _run(fp8)) > 15
    size = sum(p.numel() * p.element_size() for p in fp8.parameters())
    assert size < sum(p.numel() * p.element_size() for p in ref.parameters())
    assert sum("upcast per call" in r.getMessage() for r in caplog.records) == 1


def test_dtype_casts_everything_but_the_fp8_weights(encoders, tmp_path):
    src, dst = encoders["text_encoder"], tmp_path / "te"
    nostall.quantize(src, dst)
    model = nostall.load_model(dst, dtype=torch.bfloat16)
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16, torch.float8_e4m3fn}
    assert _run(model).isfinite().all()


def test_community_scaled_fp8_files_load(encoders, tmp_path):
    # One scale per tensor, a scaled_fp8 marker and input_scale tensors beside the weights.
    src = encoders["text_encoder"]
    dst = tmp_path / "comfy"
    shutil.copytree(src, dst)
    (path,) = [f.path for f in resolve(dst).files]
    tensors = load_file(path)
    out = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    for name, t in tensors.items():
        if name.endswith("proj.weight") and t.dim() == 2:
            scale = t.abs().max().float() / 448
            out[name] = (t.float() / scale).to(torch.float8_e4m3fn)
            out[name + "_scale"] = scale.reshape(())
            out[name.replace(".weight", ".input_scale")] = torch.ones(())
        else:
            out[name] = t
    save_file(out, path)
    model = nostall.load_model(dst)
    assert any(m.weight.dtype == torch.float8_e4m3fn for m in _linears(model))
    assert sqnr_db(_run(nostall.load_model(src)), _run(model)) > 10


def test_fp8_layouts_it_does_not_know_are_typed_errors(encoders, tmp_path):
    src = encoders["text_encoder"]
    for case in ("no-scale", "not-linear"):
        dst = tmp_path / case
        shutil.copytree(src, dst)
        (path,) = [f.path for f in resolve(dst).files]
        t = load_file(path)
        if case == "no-scale":
            name = next(n for n in t if n.endswith("q_proj.weight"))
            t[name] = t[name].to(torch.float8_e4m3fn)
            says = "has no"
        else:
            name = next(n for n in t if n.endswith("token_embedding.weight"))
            t[name] = t[name].to(torch.float8_e4m3fn)
            t[name + "_scale"] = torch.ones(t[name].shape[0])
            says = "not a linear layer"
        save_file(t, path)
        with pytest.raises(CheckpointError, match=says) as e:
            nostall.load_model(dst)
        assert e.value.tensor and name in e.value.tensor
        assert str(dst) in str(e.value)  # the message names the checkpoint


# ---- FP8 tensor cores (scaled_mm over the loaded bytes) --------------------------------


def test_tensor_core_path_computes_on_the_loaded_bytes(encoders, tmp_path, monkeypatch, caplog):
    src, dst = encoders["text_encoder"], tmp_path / "te"
    nostall.quantize(src, dst)
    upcast = nostall.load_model(dst, dtype=torch.bfloat16)
    # CPU stands in for a capable GPU (torch's CPU _scaled_mm runs the same call)
    monkeypatch.setattr(modules_mod, "fp8_compute", lambda device: ("tensor-cores", "test"))
    modules_mod._said.clear()
    with caplog.at_level(logging.INFO, logger="nostall.quant.modules"):
        cores = nostall.load_model(dst, dtype=torch.bfloat16)
    fp8 = [m for m in _linears(cores) if m.weight.dtype == torch.float8_e4m3fn]
    assert fp8 and all(m._fp8_tensor_cores for m in fp8)
    assert all(type(m).__name__ == "FP8Linear" and not m.weight.requires_grad for m in fp8)
    said = [r.getMessage() for r in caplog.records if "tensor cores" in r.getMessage()]
    assert len(said) == 1 and f"{len(fp8)} of {len(fp8)}" in said[0]
    # activations are quantized too: close to the upcast path, not equal
    a, b = _run(upcast), _run(cores)
    assert not torch.equal(a, b) and sqnr_db(a, b) > 20
    assert sqnr_db(_run(nostall.load_model(src)), b) > 15


def test_scaled_mm_applies_both_scales_and_the_bias():
    from nostall.quant.fp8 import quantize_weight
    from nostall.quant.kernels import quantize_rows_reference
    from nostall.quant.linear import fp8_linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.linspace(0.1, 3, 48)[:, None]
    x = (torch.randn(2, 5, 64, generator=g) * torch.linspace(0.5, 4, 5)[:, None]).bfloat16()
    bias = torch.randn(48, generator=g)
    q, s = quantize_weight(w)
    y = fp8_linear(x, q, s, bias, tensor_cores=True)
    assert y.shape == (2, 5, 48) and y.dtype == torch.bfloat16
    xq, xs = quantize_rows_reference(x.reshape(-1, 64))
    want = (xq.double() * xs.double()) @ (q.double() * s.double()[:, None]).t() + bias.double()
    assert torch.allclose(y.reshape(-1, 48).double(), want, rtol=1e-2, atol=1e-2)
    assert fp8_linear(x[:, :0], q, s, bias, tensor_cores=True).shape == (2, 0, 48)
    # fp32 activations (or the CPU default) upcast instead
    up = fp8_linear(x.float(), q, s, bias, tensor_cores=True)
    assert up.dtype == torch.float32
    assert torch.allclose(up, torch.nn.functional.linear(x.float(), q.float() * s[:, None], bias))


def test_row_quantization_maps_each_rows_largest_magnitude_to_448():
    from nostall.quant.kernels import quantize_rows

    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3e-3, 1e-3, -6e-3]]).bfloat16()
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 1) and s.dtype == torch.float32
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]
    assert torch.allclose(q.float() * s, x.float(), rtol=0.07)


def test_layers_that_do_not_fit_the_tensor_cores_upcast():
    lin = nn.Linear(24, 16)  # 24 is not a multiple of 16
    q = lin.weight.detach().to(torch.float8_e4m3fn)
    lin.weight = nn.Parameter(q, requires_grad=False)
    modules_mod.install_fp8(lin, {"weight": torch.ones(())}, compute="tensor-cores")
    assert type(lin).__name__ == "FP8Linear" and lin.weight.dtype == torch.float8_e4m3fn
    assert not lin._fp8_tensor_cores
    assert lin(torch.randn(3, 24).bfloat16()).dtype == torch.bfloat16


def test_fp8_compute_says_why_it_upcasts():
    how, why = modules_mod.fp8_compute(torch.device("cpu"))
    assert how == "upcast" and "cpu" in why


# ---- torchao's flattened layout --------------------------------------------------------


def _torchao_file(src, dst, *, block=None, kind=None, drop_scale=False):
    """Rewrite nostall's FP8 copy at ``dst`` in torchao's flattened layout, made by
    torchao's own flatten_tensor_state_dict."""
    pytest.importorskip("torchao")
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
    from torchao.quantization import Float8Tensor

    nostall.quantize(src, dst)
    (path,) = [f.path for f in resolve(dst).files]
    t = load_file(path)
    state = {}
    for name, v in t.items():
        if name.endswith("_scale"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            scale = t[name + "_scale"].reshape(-1, 1)
            state[name] = Float8Tensor(
                v, scale, block_size=block or [1, v.shape[1]], dtype=torch.float32
            )
        else:
            state[name] = v
    tensors, metadata = flatten_tensor_state_dict(state)
    if kind is not None:
        first = next(n for n in state if isinstance(state[n], Float8Tensor))
        info = json.loads(metadata[first])
        info["_type"] = kind
        metadata[first] = json.dumps(info)
    if drop_scale:
        del tensors[next(n for n in tensors if n.endswith("_weight_scale"))]
    save_file(tensors, path, metadata=metadata)
    return dst


def test_torchao_flattened_files_load(encoders, tmp_path):
    src = encoders["text_encoder"]
    dst = _torchao_file(src, tmp_path / "ao")
    names = {e.name for _, e in resolve(dst).entries()}
    assert any(n.endswith("._weight_qdata") for n in names)  # really torchao's layout
    model = nostall.load_model(dst)
    assert sum(m.weight.dtype == torch.float8_e4m3fn for m in _linears(model)) > 0
    ours = nostall.load_model(tmp_path / "ao")  # same bytes, read again
    assert torch.equal(_run(model), _run(ours))
    assert sqnr_db(_run(nostall.load_model(src)), _run(model)) > 15


@pytest.mark.parametrize(
    "case, says",
    [
        ("blockwise", "blockwise FP8"),
        ("other-type", "Int4Tensor"),
        ("no-scale", "but no"),
    ],
)
def test_torchao_layouts_nostall_does_not_read_are_typed_errors(encoders, tmp_path, case, says):
    src = encoders["text_encoder"]
    kw = {
        "blockwise": {"block": [16, 16]},
        "other-type": {"kind": "Int4Tensor"},
        "no-scale": {"drop_scale": True},
    }[case]
    dst = _torchao_file(src, tmp_path / case, **kw)
    with pytest.raises(CheckpointError, match=says) as e:
        nostall.load_model(dst)
    assert e.value.tensor


# ---- install_fp8 on module trees -------------------------------------------------------


class _Twice(nn.Module):
    """One linear layer under two names, beside one of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(16, 16))
        self.second = self.first  # named_modules() lists it as "first" only
        self.own = nn.Linear(16, 16)


def _fp8_weights(module: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    scales = {}
    for name in names:
        owner = module.get_submodule(name.rpartition(".")[0])
        owner.weight = nn.Parameter(owner.weight.detach().to(torch.float8_e4m3fn), False)
        scales[name] = torch.ones(16)
    return scales


@pytest.mark.parametrize("names", [["first.0.weight", "own.weight"], ["second.0.weight"]])
def test_fp8_layers_are_found_under_any_of_their_names(names):
    module = _Twice()
    assert modules_mod.install_fp8(module, _fp8_weights(module, names)) == len(names)
    for name in names:
        owner = module.get_submodule(name.rpartition(".")[0])
        assert type(owner).__name__ == "FP8Linear" and owner.weight_scale.shape == (16,)
    assert isinstance(module.own, nn.Linear)
    assert module.own(torch.randn(2, 16)).shape == (2, 16)


def test_a_scale_for_a_layer_the_module_lacks_raises_as_get_submodule_does():
    module = _Twice()
    with pytest.raises(AttributeError, match="no attribute `missing`"):
        modules_mod.install_fp8(module, {"missing.weight": torch.ones(16)})


class _Kept(nn.Module):
    _keep_in_fp32_modules = ("from_class",)

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.inner._keep_in_fp32_modules = ["from_instance"]
        self.computed = _Computed()


class _Computed(nn.Module):
    @property
    def _keep_in_fp32_modules(self) -> list[str]:
        return ["from_property"]


def test_keep_in_fp32_reads_class_instance_and_property_declarations():
    assert modules_mod.keep_in_fp32(_Kept()) == ("from_class", "from_instance", "from_property")
    assert modules_mod.keep_in_fp32(nn.Sequential(nn.Linear(2, 2))) == ()
