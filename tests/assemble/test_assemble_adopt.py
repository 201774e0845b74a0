"""adopt: no copies, one error listing every mismatch, ties, buffers, devices."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from nostall.assemble import adopt, build_empty
from nostall.errors import ArgumentError, CheckpointError, ModelMismatchError

from assemble_support import Saved


def _empty(saved: Saved) -> nn.Module:
    return build_empty(saved.cls, saved.folder)


def _flat_views(
    tensors: dict[str, torch.Tensor], device: str = "cpu"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Copy every tensor into one flat buffer (64-byte aligned slots); return the views."""
    dtype = next(iter(tensors.values())).dtype
    align = 64 // dtype.itemsize
    sizes = {k: -(-v.numel() // align) * align for k, v in tensors.items()}
    flat = torch.empty(sum(sizes.values()), dtype=dtype, device=device)
    views, offset = {}, 0
    for key, value in tensors.items():
        view = flat[offset : offset + value.numel()].view(value.shape)
        view.copy_(value)
        views[key] = view
        offset += sizes[key]
    return flat, views


def test_views_of_one_flat_buffer_are_adopted_in_place(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["flux"]
    flat, views = _flat_views(saved.tensors())
    module = adopt(_empty(saved), views)
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for key, view in views.items():
        ptr = module.get_parameter(key).data_ptr()
        assert ptr == view.data_ptr(), key
        assert start <= ptr < end, key
    flat.zero_()  # writes through to the module: nothing was copied
    assert all(not p.any() for p in module.parameters())


def test_every_problem_in_one_error(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["flux"]
    tensors = saved.tensors()
    del tensors["proj_out.bias"]
    tensors["bogus.weight"] = torch.zeros(3)
    tensors["x_embedder.weight"] = torch.zeros(5, 4)
    module = _empty(saved)

    with pytest.raises(ModelMismatchError) as info:
        adopt(module, tensors, path=saved.folder)
    error = info.value
    assert isinstance(error, CheckpointError)
    assert error.missing == ["proj_out.bias"]
    assert error.unexpected == ["bogus.weight"]
    assert error.mismatched == [("x_embedder.weight", (5, 4), (32, 4))]
    assert error.path == str(saved.folder)
    message = str(error)
    for needle in (str(saved.folder), "proj_out.bias", "bogus.weight", "x_embedder.weight"):
        assert needle in message
    assert "(5, 4)" in message and "(32, 4)" in message
    assert "hint:" in message and "config.json" in message
    # Checked before touching anything: the module is still entirely empty.
    assert all(p.is_meta for p in module.parameters())


def test_missing_parameter_is_an_error_even_when_not_strict(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["flux"]
    tensors = saved.tensors()
    del tensors["norm_out.linear.weight"]
    tensors["extra"] = torch.zeros(1)
    with pytest.raises(ModelMismatchError) as info:
        adopt(_empty(saved), tensors, strict=False)
    assert info.value.missing == ["norm_out.linear.weight"]
    assert info.value.unexpected == ["extra"]


def test_unexpected_keys_need_strict_false(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["flux"]
    tensors = saved.tensors()
    tensors["lora_A.weight"] = torch.zeros(2, 2)
    with pytest.raises(ModelMismatchError, match="strict=False") as info:
        adopt(_empty(saved), tensors)
    assert info.value.unexpected == ["lora_A.weight"]
    assert info.value.missing == [] and info.value.mismatched == []
    module = adopt(_empty(saved), tensors, strict=False)
    assert not any(p.is_meta for p in module.parameters())


def test_prefixed_checkpoint_gets_a_prefix_hint(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["vae"]
    tensors = {f"first_stage_model.{k}": v for k, v in saved.tensors().items()}
    with pytest.raises(ModelMismatchError, match=re.escape("extra prefix 'first_stage_model.'")):
        adopt(_empty(saved), tensors)


class WithNorm(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)


def test_missing_buffers_follow_strict() -> None:
    torch.manual_seed(0)
    tensors = WithNorm().state_dict()
    del tensors["norm.running_mean"]
    with pytest.raises(ModelMismatchError) as info:
        adopt(build_empty(WithNorm, {}), tensors)
    assert info.value.missing == ["norm.running_mean"]

    # Not strict: the buffer keeps the value __init__ gave it.
    module = adopt(build_empty(WithNorm, {}), tensors, strict=False)
    assert torch.equal(module.norm.running_mean, torch.zeros(4))

    # torch itself tolerates a missing num_batches_tracked (old checkpoints).
    tensors = WithNorm().state_dict()
    del tensors["norm.num_batches_tracked"]
    adopt(build_empty(WithNorm, {}), tensors)


class Shared(nn.Module):
    """Ties made in __init__ without transformers: a shared Parameter and a shared module."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight
        self.alias = self.first


def test_ties_made_in_init_are_restored() -> None:
    tensors = {k: torch.randn(v.shape) for k, v in Shared().state_dict().items()}
    # What save_pretrained/safetensors keeps of shared tensors: one name each.
    for key in ("second.weight", "alias.weight", "alias.bias"):
        del tensors[key]
    module = adopt(build_empty(Shared, {}), tensors)
    assert module.second.weight is module.first.weight
    assert module.alias is module.first
    assert module.first.weight.data_ptr() == tensors["first.weight"].data_ptr()
    assert module.second.bias.data_ptr() == tensors["second.bias"].data_ptr()


def test_checkpoint_copy_of_a_non_persistent_buffer_is_ignored(
    saved_models: dict[str, Saved],
) -> None:
    saved = saved_models["clip"]
    module = _empty(saved)
    (name,) = [n for n, _ in module.named_buffers() if n.endswith("position_ids")]
    tensors = saved.tensors()
    # Old CLIP checkpoints carry position_ids, sometimes as garbage floats.
    tensors[name] = torch.full((1, 16), 7.5)
    adopt(module, tensors)
    assert torch.equal(module.get_buffer(name), torch.arange(16).unsqueeze(0))


def test_library_declared_unexpected_keys_are_ignored(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["t5"]
    tensors = saved.tensors()
    # A full T5 checkpoint loaded as T5EncoderModel: r"decoder" is declared ignorable.
    tensors["decoder.block.0.layer.0.SelfAttention.q.weight"] = torch.zeros(16, 16)
    adopt(_empty(saved), tensors)
    tensors["lm_head.weight"] = torch.zeros(64, 16)
    with pytest.raises(ModelMismatchError) as info:
        adopt(_empty(saved), tensors)
    assert info.value.unexpected == ["lm_head.weight"]


def test_legacy_diffusers_attention_names_are_renamed(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["vae"]
    tensors = saved.tensors()
    legacy = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    renamed = {}
    for key, value in tensors.items():
        for new, old in legacy.items():
            key = key.replace(f"attentions.0.{new}.", f"attentions.0.{old}.")
        renamed[key] = value
    assert any(".query." in k for k in renamed)
    module = adopt(_empty(saved), renamed)
    assert module.get_parameter("encoder.mid_block.attentions.0.to_q.weight").data_ptr() == (
        renamed["encoder.mid_block.attentions.0.query.weight"].data_ptr()
    )
    assert ".query." not in " ".join(module.state_dict())


def test_computed_buffers_follow_the_adopted_tensors(saved_models: dict[str, Saved]) -> None:
    # No GPU here: the meta device stands in for "wherever the tensors are".
    saved = saved_models["clip"]
    on_meta = {
        k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in saved.tensors().items()
    }
    module = adopt(_empty(saved), on_meta)
    assert {b.device.type for b in module.buffers()} == {"meta"}

    module = adopt(_empty(saved), saved.tensors(), device="meta")
    assert {b.device.type for b in module.buffers()} == {"meta"}
    assert {p.device.type for p in module.parameters()} == {"cpu"}  # never moved


def test_mixed_devices_need_an_explicit_device(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["clip"]
    tensors = saved.tensors()
    key = next(iter(tensors))
    tensors[key] = torch.empty(tensors[key].shape, device="meta")
    with pytest.raises(ArgumentError, match="several devices"):
        adopt(_empty(saved), tensors)
    module = adopt(_empty(saved), tensors, device="cpu")
    assert {b.device.type for b in module.buffers()} == {"cpu"}


def test_requires_grad(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["vae"]
    module = adopt(_empty(saved), saved.tensors())
    assert not any(p.requires_grad for p in module.parameters())
    assert not module.training
    module = adopt(_empty(saved), saved.tensors(), requires_grad=True)
    assert all(p.requires_grad for p in module.parameters())


def test_non_tensor_values_are_rejected(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["vae"]
    tensors: dict = saved.tensors()
    tensors["encoder.conv_in.bias"] = [0.0] * 8
    with pytest.raises(TypeError, match=re.escape("encoder.conv_in.bias")):
        adopt(_empty(saved), tensors)


@pytest.mark.cuda
def test_flat_cuda_buffer(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["clip"]
    reference = saved.reference().to("cuda")
    _flat, views = _flat_views(saved.tensors(), device="cuda")
    module = adopt(_empty(saved), views)
    assert {b.device.type for b in module.buffers()} == {"cuda"}
    for key, view in views.items():
        assert module.get_parameter(key).data_ptr() == view.data_ptr()
    inputs = {k: v.to("cuda") for k, v in saved.spec.inputs().items()}
    with torch.no_grad():
        expected = saved.spec.output(reference(**inputs))
        actual = saved.spec.output(module(**inputs))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


class _Recorder(nn.Linear):
    """A layer whose train() does more than set its flag (transformers' models do)."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.modes: list[bool] = []

    def train(self, mode: bool = True) -> _Recorder:
        self.modes.append(mode)
        return super().train(mode)


class _Tree(nn.Module):
    def __init__(self, recorder: bool) -> None:
        super().__init__()
        self.first = nn.Sequential(
            nn.Linear(2, 2), nn.ReLU(), _Recorder() if recorder else nn.Linear(2, 2)
        )
        self.shared = self.first  # a module under two names
        self.head = nn.Linear(2, 2)


@pytest.mark.parametrize("recorder", [False, True], ids=["plain", "overridden-train"])
def test_adopted_modules_are_all_in_eval_mode(recorder: bool) -> None:
    module = build_empty(_Tree, {"recorder": recorder})
    assert all(m.training for m in module.modules())
    tensors = {k: torch.randn(v.shape) for k, v in module.state_dict().items()}
    assert adopt(module, tensors) is module
    assert all(not m.training for m in module.modules())
    if recorder:
        # Its own train() ran, as Module.eval() would run it.
        assert module.first[2].modes and not any(module.first[2].modes)
