"""A compiled module keeps its graph across LoRA switches: fusing writes the weights in
place, so dynamo's guards (on the parameters' identity, not their values) still hold."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from nostall import ModelCache


def test_twenty_lora_switches_recompile_nothing(tmp_path):

    from nostall.synthetic import write_lora, write_store

    write_store(tmp_path, ("flux",))
    (tmp_path / "loras").mkdir()
    for i in range(2):
        write_lora(tmp_path / "flux", tmp_path / "loras" / f"l{i}.safetensors", rank=2, seed=i)
    torch._dynamo.reset()
    try:
        _switch_twenty_times(tmp_path)
    finally:
        torch._dynamo.reset()  # no compiled state (nor its fake tensors) for later tests


def _switch_twenty_times(tmp_path):
    from torch._dynamo.utils import counters

    from nostall.synthetic.transformer import step_inputs

    with ModelCache(tmp_path, device="cpu") as cache:
        with cache.use("flux") as pipe:
            t = pipe.transformer
            compiled = torch.compile(t, backend="eager", dynamic=False)
            dtype = next(t.parameters()).dtype
            inputs = {
                k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in step_inputs(t, "tiny", torch.device("cpu")).items()
            }
            base = compiled(**inputs)[0]
        counters.clear()
        outs = []
        for k in range(20):
            with cache.use("flux", loras={f"l{k % 2}": 1.0}) as pipe:
                assert pipe.transformer is t  # the same module, weights changed in place
                outs.append(compiled(**inputs)[0])
        with cache.use("flux") as pipe:
            again = compiled(**inputs)[0]
    # nothing compiled after the first call: no new frame, no recompilation
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert torch.equal(again, base)  # the base, bit for bit
    assert not torch.equal(outs[0], base) and not torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])  # the same LoRA gives the same output each time
