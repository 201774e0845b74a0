"""LoRAs and ControlNets on the GPU: images equal diffusers' on cuda within float noise,
the base bit for bit afterwards, and no recompilation of an inductor-compiled
transformer across LoRA switches."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.cuda

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from nostall.synthetic import write_lora, write_store

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("adapters-cuda")
    write_store(folder, ("flux", "sdxl"))
    (folder / "loras").mkdir()
    write_lora(folder / "flux", folder / "loras" / "a.safetensors", rank=4, seed=1, std=0.2)
    write_lora(folder / "flux", folder / "loras" / "b.safetensors", rank=8, seed=2, std=0.2)
    return folder


def _image(pipe, **kw):
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    return pipe(prompt="a cat", height=32, width=32, num_inference_steps=2, generator=g,
                output_type="np", max_sequence_length=16, **kw).images[0]  # fmt: skip


def test_lora_on_cuda_equals_diffusers_and_the_base_comes_back(store):
    from diffusers import DiffusionPipeline

    from nostall import ModelCache

    ref_pipe = DiffusionPipeline.from_pretrained(str(store / "flux")).to("cuda")
    base_ref = _image(ref_pipe)
    ref_pipe.load_lora_weights(str(store / "loras" / "a.safetensors"), adapter_name="a")
    ref_pipe.set_adapters(["a"], [0.7])
    ref = _image(ref_pipe)
    with ModelCache(store, device="cuda", gpu_budget=1 << 30) as cache:
        with cache.use("flux") as pipe:
            before = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
            base = _image(pipe)
        with cache.use("flux", loras={"a": 0.7}) as pipe:
            got = _image(pipe)
        with cache.use("flux", loras={"b": 1.0}) as pipe:
            _image(pipe)
        with cache.use("flux") as pipe:
            after = dict(pipe.transformer.named_parameters())
            assert all(torch.equal(before[n], after[n]) for n in before)
            assert np.array_equal(_image(pipe), base)
    assert np.array_equal(base, base_ref)
    assert np.abs(got - ref).max() < 1e-3 and np.abs(got - base).max() > 1e-3


def test_base_copies_without_device_room_wait_in_host_memory_with_the_same_images(store):
    from nostall import ModelCache

    images, where = [], []
    for reserve in (0, 1 << 50):  # room for the copies on the GPU; none (a huge reserve)
        with ModelCache(store, device="cuda", gpu_budget=1 << 30, activation_reserve=reserve,
                        lora_budget=64 << 20) as cache:  # fmt: skip
            with cache.use("flux") as pipe:
                before = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
            with cache.use("flux", loras={"a": 0.7, "b": 0.3}) as pipe:
                images.append(_image(pipe))
                stats = cache.stats()
                where.append(set(stats.lora_base_bytes))
                assert 0 < stats.lora_bytes <= stats.lora_budget  # kept in the LoRA pool
            with cache.use("flux") as pipe:
                after = dict(pipe.transformer.named_parameters())
                assert all(torch.equal(before[n], after[n]) for n in before)
            assert cache.stats().lora_base_bytes == {}
    assert where == [{"cuda:0"}, {"cpu"}]
    assert np.abs(images[0] - images[1]).max() < 1e-3  # (one addmm or a copy and addmm_)


def test_bf16_loras_are_fused_by_grouped_launches_within_one_rounding(store, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    from safetensors import safe_open
    from safetensors.torch import save_file

    import nostall.adapters.fuse as fuse
    from nostall import ModelCache

    src = store / "loras" / "a.safetensors"
    with safe_open(src, framework="pt") as f:  # the LoRA in the weights' dtype: grouped
        meta = f.metadata()
        tensors = {k: f.get_tensor(k).bfloat16() for k in f.keys()}  # noqa: SIM118
    path = str(tmp_path / "a-bf16.safetensors")
    save_file(tensors, path, metadata=meta)
    grouped: list[int] = []
    real = fuse.launch_group

    def counted(tables, ptrs=None):
        done = real(tables, ptrs)
        grouped.append(tables.ptrs.shape[0])  # (after: a kernel that failed is not counted)
        return done

    monkeypatch.setattr(fuse, "launch_group", counted)
    with ModelCache(store, device="cuda", gpu_budget=1 << 30, host_budget=256 << 20,
                    lora_budget=64 << 20, dtype=torch.bfloat16) as cache:  # fmt: skip
        with cache.use("flux") as pipe:
            before = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
        lora = cache.lora(path, "flux")
        assert lora.flat is not None  # kept in the pool: its factors move as one block
        with cache.use("flux", loras={path: 0.7}) as pipe:
            now = dict(pipe.transformer.named_parameters())
            for x in lora.layers:
                base = before[f"{x.module}.weight"].double()
                want = base + 0.7 * x.scale * (x.up.cuda().double() @ x.down.cuda().double())
                err = (now[f"{x.module}.weight"].double() - want).abs()
                assert bool((err <= want.abs() * 2**-7 + 1e-6).all()), x.module
        with cache.use("flux") as pipe:
            after = dict(pipe.transformer.named_parameters())
            assert all(torch.equal(before[n], after[n]) for n in before)
    assert sum(grouped) == len(lora.layers) and len(grouped) >= 1


def test_compiled_transformer_survives_lora_switches_on_cuda(store):
    from torch._dynamo.utils import counters

    from nostall import ModelCache
    from nostall.synthetic.transformer import step_inputs

    torch._dynamo.reset()
    with ModelCache(store, device="cuda", gpu_budget=1 << 30) as cache:
        with cache.use("flux") as pipe:
            t = pipe.transformer
            compiled = torch.compile(t, dynamic=False)
            dtype = next(t.parameters()).dtype
            inputs = {
                k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in step_inputs(t, "tiny", torch.device("cuda")).items()
            }
            base = compiled(**inputs)[0].clone()
        counters.clear()
        for k in range(20):
            with cache.use("flux", loras={"ab"[k % 2]: 1.0}):
                compiled(**inputs)
        with cache.use("flux"):
            again = compiled(**inputs)[0]
    assert counters["stats"]["unique_graphs"] == 0 and not counters["recompiles"]
    assert torch.equal(again, base)


def test_a_grouped_kernel_that_fails_to_build_falls_back_weight_by_weight(
    store, tmp_path, monkeypatch, caplog
):
    from safetensors import safe_open
    from safetensors.torch import save_file

    import nostall.adapters.fuse as fuse
    import nostall.adapters.kernels as kernels
    from nostall import ModelCache

    with safe_open(store / "loras" / "b.safetensors", framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k).bfloat16() for k in f.keys()}  # noqa: SIM118
    path = str(tmp_path / "b-bf16.safetensors")
    save_file(tensors, path, metadata=meta)

    def broken(tables, ptrs=None):
        raise RuntimeError("no compiler (simulated)")

    monkeypatch.setattr(kernels, "_AVAILABLE", True)  # restored after: later tests group
    images = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(fuse, "launch_group", broken)
        cache = ModelCache(store, device="cuda", gpu_budget=1 << 30, host_budget=256 << 20,
                           lora_budget=64 << 20, dtype=torch.bfloat16)  # fmt: skip
        with cache, cache.use("flux", loras={path: 0.8}) as pipe:
            images.append(_image(pipe))
    assert "fusing weight by weight" in caplog.text and not kernels.available()
    assert np.abs(images[0] - images[1]).max() < 1e-2  # the same LoRA, another rounding


def test_switching_back_to_a_lora_replays_its_launches_bit_for_bit(store, tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import save_file

    import nostall.adapters.fuse as fuse
    from nostall import ModelCache

    paths = []
    for name in ("a", "b"):
        with safe_open(store / "loras" / f"{name}.safetensors", framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k).bfloat16() for k in f.keys()}  # noqa: SIM118
        paths.append(str(tmp_path / f"{name}-bf16.safetensors"))
        save_file(tensors, paths[-1], metadata=meta)
    replays: list[int] = []
    real = fuse._Plan.run
    monkeypatch.setattr(fuse._Plan, "run", lambda self, up: replays.append(1) or real(self, up))
    with ModelCache(store, device="cuda", gpu_budget=1 << 30, host_budget=256 << 20,
                    lora_budget=64 << 20, dtype=torch.bfloat16) as cache:  # fmt: skip
        seen = []
        for k in range(4):  # a, b, a (replayed), b (replayed)
            with cache.use("flux", loras={paths[k % 2]: 0.7}) as pipe:
                seen.append({n: p.detach().clone() for n, p in pipe.transformer.named_parameters()})
    assert len(replays) == 2
    for k in (2, 3):
        assert all(torch.equal(seen[k][n], seen[k - 2][n]) for n in seen[k])
    assert any(not torch.equal(seen[0][n], seen[1][n]) for n in seen[0])
