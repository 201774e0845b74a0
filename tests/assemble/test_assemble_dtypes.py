"""target_dtypes: the per-tensor dtype each library's from_pretrained would load."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nostall.assemble import adopt, build_empty, target_dtypes

from assemble_support import Saved, diffusers, wan_transformer_config


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_t5_matches_from_pretrained(saved_models: dict[str, Saved], dtype: torch.dtype) -> None:
    saved = saved_models["t5"]
    reference = saved.reference(dtype=dtype)
    module = build_empty(saved.cls, saved.folder, dtype=dtype)
    plan = target_dtypes(module, dtype)
    tensors = {k: v.to(plan.get(k, v.dtype)) for k, v in saved.tensors().items()}
    adopt(module, tensors)

    expected = {k: v.dtype for k, v in reference.state_dict().items()}
    assert {k: v.dtype for k, v in module.state_dict().items()} == expected
    wo = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    # T5's _keep_in_fp32_modules = ["wo"] applies to float16 only.
    assert expected[wo] == (torch.float32 if dtype == torch.float16 else dtype)
    with torch.no_grad():
        inputs = saved.spec.inputs()
        torch.testing.assert_close(
            saved.spec.output(module(**inputs)), saved.spec.output(reference(**inputs))
        )


def test_diffusers_keep_in_fp32_modules() -> None:
    module = build_empty(diffusers.WanTransformer3DModel, wan_transformer_config())
    plan = target_dtypes(module, torch.bfloat16)
    assert set(plan) == set(module.state_dict())
    fp32 = {k for k, v in plan.items() if v == torch.float32}
    # Wan keeps "time_embedder", "scale_shift_table", "norm1/2/3" (a whole
    # dotted component must match) in float32.
    assert fp32 == {
        "scale_shift_table",
        "blocks.0.scale_shift_table",
        "blocks.0.norm2.weight",
        "blocks.0.norm2.bias",
        "condition_embedder.time_embedder.linear_1.weight",
        "condition_embedder.time_embedder.linear_1.bias",
        "condition_embedder.time_embedder.linear_2.weight",
        "condition_embedder.time_embedder.linear_2.bias",
    }
    assert plan["blocks.0.attn1.to_q.weight"] == torch.bfloat16


def test_other_modules_take_the_dtype_for_floats_only() -> None:
    module = build_empty(nn.BatchNorm1d, {"num_features": 4})
    assert target_dtypes(module, torch.float16) == {
        "weight": torch.float16,
        "bias": torch.float16,
        "running_mean": torch.float16,
        "running_var": torch.float16,
    }
