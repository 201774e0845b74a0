"""build_empty + adopt gives the same model as the library's own from_pretrained."""

from __future__ import annotations

import pytest
import torch

from nostall.assemble import adopt, build_empty, resolve_model_class

from assemble_support import Saved

NAMES = ["flux", "flux_sharded", "unet", "vae", "wan_vae", "t5", "clip"]


def _assemble(saved: Saved, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    cls = resolve_model_class(saved.folder)
    assert cls is saved.cls
    return adopt(build_empty(cls, saved.folder), tensors, path=saved.folder)


@pytest.mark.parametrize("name", NAMES)
def test_matches_from_pretrained(saved_models: dict[str, Saved], name: str) -> None:
    saved = saved_models[name]
    reference = saved.reference()
    tensors = saved.tensors()
    ours = _assemble(saved, tensors)

    ref_state = reference.state_dict()
    our_state = ours.state_dict()
    assert list(our_state) == list(ref_state)
    for key, value in ref_state.items():
        assert our_state[key].dtype == value.dtype, key
        assert torch.equal(our_state[key], value), key

    # named_buffers includes non-persistent ones (CLIP's position_ids), which
    # state_dict() leaves out and no checkpoint carries.
    ref_buffers = dict(reference.named_buffers())
    our_buffers = dict(ours.named_buffers())
    assert our_buffers.keys() == ref_buffers.keys()
    for key, value in ref_buffers.items():
        assert our_buffers[key].dtype == value.dtype, key
        assert our_buffers[key].device == value.device, key
        assert torch.equal(our_buffers[key], value), key

    assert not ours.training
    assert not any(p.is_meta for p in ours.parameters())

    # Inference as pipelines run it; outside no_grad, requires_grad=False
    # parameters would let SDPA pick another (equally valid) CPU kernel.
    with torch.no_grad():
        expected = saved.spec.output(reference(**saved.spec.inputs()))
        actual = saved.spec.output(ours(**saved.spec.inputs()))
    # Not torch.equal: the weights are bit-identical, but ours live where
    # load_file put them, and MKL picks its GEMM kernel by pointer alignment
    # (a weight 4 bytes off a 16-byte boundary moves results by ~1e-7).
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_adopted_tensors_alias_the_state_dict(saved_models: dict[str, Saved], name: str) -> None:
    saved = saved_models[name]
    tensors = saved.tensors()
    ours = _assemble(saved, tensors)
    state = ours.state_dict(keep_vars=True)
    for key, value in tensors.items():
        assert state[key].data_ptr() == value.data_ptr(), key
        assert state[key].dtype == value.dtype, key


def test_clip_position_ids_are_the_computed_ones(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["clip"]
    ours = _assemble(saved, saved.tensors())
    # "embeddings.position_ids" in transformers 5, under "text_model." in 4.
    (name,) = [n for n, _ in ours.named_buffers() if n.endswith("position_ids")]
    assert name not in saved.tensors()
    assert torch.equal(ours.get_buffer(name), torch.arange(16).unsqueeze(0))


def test_t5_tied_embedding_is_one_parameter(saved_models: dict[str, Saved]) -> None:
    saved = saved_models["t5"]
    tensors = saved.tensors()
    # save_pretrained drops the tied copy; adopt must restore the tie.
    assert "encoder.embed_tokens.weight" not in tensors
    ours = _assemble(saved, tensors)
    assert ours.encoder.embed_tokens.weight is ours.shared.weight
    assert ours.shared.weight.data_ptr() == tensors["shared.weight"].data_ptr()


def test_t5_tie_from_the_other_side(saved_models: dict[str, Saved]) -> None:
    # A checkpoint holding only the tied copy: transformers ties symmetrically.
    saved = saved_models["t5"]
    tensors = saved.tensors()
    tensors["encoder.embed_tokens.weight"] = tensors.pop("shared.weight")
    ours = _assemble(saved, tensors)
    assert ours.shared.weight is ours.encoder.embed_tokens.weight
    assert ours.shared.weight.data_ptr() == tensors["encoder.embed_tokens.weight"].data_ptr()
