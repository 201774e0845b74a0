"""build_empty: parameters on meta, no init compute, real buffers, patches undone."""

from __future__ import annotations

import gc
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from nostall.assemble import build_empty, empty_parameters, read_config
from nostall.errors import CheckpointError

from assemble_support import Saved, diffusers, transformers, wan_transformer_config

INIT_NAMES = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
)

# FLUX's real width (3072 = 24 heads x 128) with 1 + 2 of its 19 + 38 blocks:
# 0.6 B parameters, 2.4 GB in float32 if anything were allocated for real.
WIDE_FLUX = {"num_layers": 1, "num_single_layers": 2}


@pytest.fixture
def init_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[str]]]:
    """torch.nn.init functions reached, split by whether the tensor was on meta."""
    calls: dict[str, list[str]] = {"real": [], "meta": []}
    for name in INIT_NAMES:
        original = getattr(nn.init, name)

        def record(tensor: torch.Tensor, *args, _name=name, _original=original, **kwargs):
            calls["meta" if tensor.is_meta else "real"].append(_name)
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(nn.init, name, record)
    yield calls


@pytest.fixture
def hf_init_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Initialisers transformers' own init helpers got past their skip-flag check."""
    import importlib

    calls: list[str] = []
    # a submodule: an attribute of the package only once imported (the suite's order
    # decided whether some earlier test had)
    table = importlib.import_module(f"{transformers.__name__}.initialization").TORCH_INIT_FUNCTIONS
    for name, original in list(table.items()):

        def record(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setitem(table, name, record)
    yield calls


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("name", ["flux", "unet", "vae"])
def test_no_parameter_is_initialised(
    saved_models: dict[str, Saved], init_calls: dict[str, list[str]], name: str
) -> None:
    saved = saved_models[name]
    saved.spec.make()
    assert init_calls["real"], "the recorder must see a normal construction's init"
    init_calls["real"].clear()
    module = build_empty(saved.cls, saved.folder)
    assert all(p.is_meta for p in module.parameters())
    assert init_calls["real"] == []
    # Not even reached for meta tensors: torch's meta decomposition of
    # uniform_ & co. would cost half the construction time.
    assert init_calls["meta"] == []


@pytest.mark.parametrize("name", ["t5", "clip"])
def test_transformers_init_skips_meta_parameters(
    saved_models: dict[str, Saved], hf_init_calls: list[str], name: str
) -> None:
    saved = saved_models[name]
    saved.spec.make()
    assert hf_init_calls, "the recorder must see a normal construction's init"
    hf_init_calls.clear()
    build_empty(saved.cls, saved.folder)
    assert hf_init_calls == []


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_wide_model_builds_fast_without_memory(init_calls: dict[str, list[str]]) -> None:
    gc.collect()
    before = _rss()
    start = time.perf_counter()
    module = build_empty(diffusers.FluxTransformer2DModel, WIDE_FLUX)
    elapsed = time.perf_counter() - start
    grown = _rss() - before
    params = list(module.parameters())
    assert sum(p.numel() for p in params) > 500e6
    assert all(p.is_meta for p in params)
    assert init_calls["real"] == []
    assert grown < 256 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"
    # ~15 ms here; a real build takes seconds. Generous for loaded CI machines.
    assert elapsed < 2.0


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_buffers_computed_in_init_are_real(dtype: torch.dtype | None) -> None:
    cls = diffusers.WanTransformer3DModel
    previous = torch.get_default_dtype()
    # What diffusers' from_pretrained(torch_dtype=dtype) constructs under.
    torch.set_default_dtype(dtype or previous)
    try:
        normal = cls.from_config(wan_transformer_config())
    finally:
        torch.set_default_dtype(previous)
    empty = build_empty(cls, wan_transformer_config(), dtype=dtype)
    assert torch.get_default_dtype() == previous

    expected = dict(normal.named_buffers())
    actual = dict(empty.named_buffers())
    assert {"rope.freqs_cos", "rope.freqs_sin"} <= set(actual)
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert not actual[key].is_meta, key
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key
    assert all(p.is_meta for p in empty.parameters())


def test_transformers_post_init_fills_buffers_not_parameters(
    saved_models: dict[str, Saved],
) -> None:
    module = build_empty(transformers.CLIPTextModel, saved_models["clip"].folder)
    (name,) = [n for n, _ in module.named_buffers() if n.endswith("position_ids")]
    assert torch.equal(module.get_buffer(name), torch.arange(16).unsqueeze(0))
    assert all(p.is_meta for p in module.parameters())


def test_ties_made_in_init_survive(saved_models: dict[str, Saved]) -> None:
    module = build_empty(transformers.T5EncoderModel, saved_models["t5"].folder)
    assert module.shared.weight.is_meta
    assert module.encoder.embed_tokens.weight is module.shared.weight


def test_dict_config_and_folder_agree(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["unet"]
    from_folder = build_empty(saved.cls, saved.folder)
    from_dict = build_empty(saved.cls, read_config(saved.folder))
    shapes = {k: v.shape for k, v in from_folder.state_dict(keep_vars=True).items()}
    assert shapes == {k: v.shape for k, v in from_dict.state_dict(keep_vars=True).items()}
    assert from_folder.config._name_or_path == os.fspath(saved.folder)


class Plain(nn.Module):
    """A module from neither library: built as cls(**config)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.register_buffer("table", torch.arange(width), persistent=False)
        self.register_buffer("scale", torch.full((width,), 0.1), persistent=False)


def test_plain_module_is_built_from_kwargs() -> None:
    module = build_empty(Plain, {"width": 8})
    assert all(p.is_meta for p in module.parameters())
    assert module.linear.weight.shape == (8, 8)
    assert torch.equal(module.table, torch.arange(8))
    assert torch.equal(module.norm.running_var, torch.ones(8))
    assert module.scale.dtype == torch.float32


def test_dtype_is_the_default_dtype_during_construction() -> None:
    # As from_pretrained(torch_dtype=...) does: buffers made without an explicit
    # dtype in __init__ come out in it; explicit ones (int64 table) do not.
    module = build_empty(Plain, {"width": 8}, dtype=torch.float64)
    assert module.scale.dtype == torch.float64
    assert torch.equal(module.scale, torch.full((8,), 0.1, dtype=torch.float64))
    assert module.table.dtype == torch.int64
    assert torch.get_default_dtype() == torch.float32


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        raise RuntimeError("bad config value")


def test_patches_are_undone_when_init_raises() -> None:
    register = nn.Module.register_parameter
    inits = {name: getattr(nn.init, name) for name in INIT_NAMES}
    previous = torch.get_default_dtype()
    with pytest.raises(CheckpointError, match="does not construct Boom") as info:
        build_empty(Boom, {}, dtype=torch.float64)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert nn.Module.register_parameter is register
    assert {name: getattr(nn.init, name) for name in INIT_NAMES} == inits
    assert torch.get_default_dtype() == previous
    assert gc.isenabled()
    assert not nn.Linear(2, 2).weight.is_meta


def test_other_threads_build_real_modules_meanwhile() -> None:
    built: list[nn.Linear] = []
    with empty_parameters():
        mine = nn.Linear(4, 4)
        thread = threading.Thread(target=lambda: built.append(nn.Linear(4, 4)))
        thread.start()
        thread.join()
    assert mine.weight.is_meta
    (theirs,) = built
    assert not theirs.weight.is_meta
    # Their init ran for real (not skipped as if on meta).
    assert theirs.weight.abs().sum() > 0


def test_missing_config_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=re.escape("no config.json")):
        build_empty(diffusers.AutoencoderKL, tmp_path)


class _Strided(nn.Module):
    """Parameters of several dtypes and layouts, a flag, and a tagged attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Parameter(torch.randn(3, 5))
        self.transposed = nn.Parameter(torch.randn(5, 3).t())
        self.low = nn.Parameter(torch.randn(4).half(), requires_grad=False)
        self.plain.tag = "kept"


def test_meta_parameters_keep_dtype_shape_strides_and_attributes() -> None:
    real = _Strided()
    module = build_empty(_Strided, {})
    for name, param in module.named_parameters():
        ref = getattr(real, name).detach().to("meta")
        assert param.is_meta and type(param) is nn.Parameter, name
        assert (param.dtype, param.shape, param.stride()) == (ref.dtype, ref.shape, ref.stride())
        assert param.requires_grad == getattr(real, name).requires_grad, name
        assert param._is_hf_initialized, name
    assert module.plain.tag == "kept"


def test_gc_paused_restores_the_collector_as_found() -> None:
    from nostall.assemble import gc_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause is left alone
    finally:
        gc.enable()
