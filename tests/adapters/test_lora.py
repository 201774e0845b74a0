"""LoRAs through the model cache: images equal diffusers' (load_lora_weights +
set_adapters) within float noise, the base bit for bit afterwards, and every bad input a
typed error."""

from __future__ import annotations

import copy
import logging
import os
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("peft")

from nostall import ModelCache
from nostall.errors import (
    AdapterError,
    ArgumentError,
    CheckpointError,
    UnknownModel,
)


def _peft_lora(pipe, folder, name, *, role, targets, r=4, alpha=8, seed=0):
    """A random LoRA in diffusers/PEFT format, written as diffusers writes it."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    module = inject_adapter_in_model(cfg, copy.deepcopy(getattr(pipe, role)), adapter_name="x")
    g = torch.Generator().manual_seed(seed)
    for n, p in module.named_parameters():
        if "lora_" in n:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    sd = get_peft_model_state_dict(module, adapter_name="x")
    key = "unet" if role == "unet" else role
    type(pipe).save_lora_weights(
        folder,
        weight_name=f"{name}.safetensors",
        **{f"{key}_lora_layers": sd, f"{key}_lora_adapter_metadata": cfg.to_dict()},
    )
    return os.path.join(folder, f"{name}.safetensors")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from diffusers import DiffusionPipeline

    from nostall.synthetic import write_store

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("lora-store")
    write_store(folder, ("flux", "sdxl"))
    loras = folder / "loras"
    loras.mkdir()
    flux = DiffusionPipeline.from_pretrained(str(folder / "flux"))
    attn = ["to_q", "to_k", "to_v", "proj_mlp"]
    _peft_lora(flux, loras, "style", role="transformer", targets=attn, seed=0)
    _peft_lora(flux, loras, "detail", role="transformer", targets=["to_out.0", "to_q"], r=2,
               alpha=2, seed=1)  # fmt: skip
    sdxl = DiffusionPipeline.from_pretrained(str(folder / "sdxl"))
    _peft_lora(sdxl, loras, "sdxl-style", role="unet", targets=["to_q", "to_v"], seed=2)
    return folder


def _image(pipe, **kw):
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    return pipe(prompt="a cat", height=32, width=32, num_inference_steps=2, generator=g,
                output_type="np", **kw).images[0]  # fmt: skip


def _diffusers(store, name, adapters, weights, **kw):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(store / name))
    for a in adapters:
        pipe.load_lora_weights(str(store / "loras" / f"{a}.safetensors"), adapter_name=a)
    if adapters:
        pipe.set_adapters(list(adapters), list(weights))
    return _image(pipe, **kw)


def _enter(block):
    with block:
        pass


def _params(pipe):
    return {
        f"{role}.{n}": p.detach().clone()
        for role in ("transformer", "unet", "text_encoder", "text_encoder_2")
        if getattr(pipe, role, None) is not None
        for n, p in getattr(pipe, role).named_parameters()
    }


@pytest.mark.parametrize(
    ("name", "loras", "kw"),
    [
        ("flux", {"style": 1.0}, {"max_sequence_length": 16}),
        ("flux", {"style": 0.5}, {"max_sequence_length": 16}),
        ("flux", {"style": 0.8, "detail": 0.4}, {"max_sequence_length": 16}),
        ("sdxl", {"sdxl-style": 0.7}, {}),
    ],
    ids=["flux-one", "flux-half", "flux-two", "sdxl"],
)
def test_images_equal_diffusers_and_the_base_comes_back_bit_for_bit(store, name, loras, kw):
    ref = _diffusers(store, name, list(loras), list(loras.values()), **kw)
    base_ref = _diffusers(store, name, [], [], **kw)
    with ModelCache(store, device="cpu") as cache:
        with cache.use(name) as pipe:
            before = _params(pipe)
            base = _image(pipe, **kw)
        with cache.use(name, loras=loras) as pipe:
            got = _image(pipe, **kw)
        with cache.use(name) as pipe:
            after = _params(pipe)
            again = _image(pipe, **kw)
    assert np.array_equal(base, base_ref)
    assert np.abs(got - base).max() > 1e-3  # the LoRA changes the image
    assert np.abs(got - ref).max() < 1e-5
    assert np.array_equal(again, base)
    assert all(torch.equal(before[k], after[k]) for k in before)  # every weight's bits


def test_switching_loras_moves_only_what_changed_and_evicting_resets_the_fusion(store):
    with ModelCache(store, device="cpu") as cache:
        with cache.use("flux", loras={"style": 1.0}) as pipe:
            one = _image(pipe, max_sequence_length=16)
        with cache.use("flux", loras={"style": 1.0}) as pipe:  # same: nothing to do
            assert np.array_equal(_image(pipe, max_sequence_length=16), one)
        cache.evict("gpu")  # the device copy goes; a reload brings the base bytes
        with cache.use("flux") as pipe:
            reloaded = _params(pipe)
        with cache.use("flux", loras={"style": 1.0}) as pipe:
            assert np.abs(_image(pipe, max_sequence_length=16) - one).max() < 1e-6
        with cache.use("flux") as pipe:
            assert all(torch.equal(reloaded[k], v) for k, v in _params(pipe).items())


def test_two_blocks_wanting_other_loras_take_turns(store):
    with ModelCache(store, device="cpu") as cache:
        cache.pipeline("flux")
        inside, order = threading.Event(), []

        def first():
            with cache.use("flux", loras={"style": 1.0}):
                inside.set()
                time.sleep(0.5)
                order.append("first out")

        t = threading.Thread(target=first)
        t.start()
        assert inside.wait(60)
        with cache.use("flux", loras={"detail": 1.0}):
            order.append("second in")
        t.join()
    assert order == ["first out", "second in"]


def test_bad_loras_are_typed_errors_naming_the_fault(store, tmp_path):
    import shutil

    with ModelCache(store, device="cpu") as cache:
        with pytest.raises(UnknownModel, match="stlye") as e:
            _enter(cache.use("flux", loras={"stlye": 1.0}))
        assert "style" in e.value.close
        for w in (float("nan"), float("inf"), 1e6):
            with pytest.raises(ArgumentError, match="weight"):
                _enter(cache.use("flux", loras={"style": w}))
        # a LoRA of SDXL's UNet on FLUX: it adapts a component FLUX does not have
        with pytest.raises(AdapterError, match="sdxl-style"):
            _enter(cache.use("flux", loras={"sdxl-style": 1.0}))
        # truncated: a typed error naming the file, and the cache still serves
        cut = tmp_path / "cut.safetensors"
        data = (store / "loras" / "style.safetensors").read_bytes()
        cut.write_bytes(data[: len(data) // 2])
        with pytest.raises(CheckpointError, match=r"cut\.safetensors"):
            _enter(cache.use("flux", loras={str(cut): 1.0}))
        # shapes of another base: the first mismatching layer is named
        from safetensors.torch import load_file, save_file

        sd = load_file(str(store / "loras" / "style.safetensors"))
        first = sorted(k for k in sd if k.endswith("lora_B.weight"))[0]
        sd[first] = torch.zeros(sd[first].shape[0] + 8, sd[first].shape[1])
        other = tmp_path / "other.safetensors"
        save_file(sd, str(other))
        layer = first.removeprefix("transformer.").removesuffix(".lora_B.weight")
        with pytest.raises(AdapterError, match=layer.replace(".", r"\.")):
            _enter(cache.use("flux", loras={str(other): 1.0}))
        # a replaced file is read again
        swapped = tmp_path / "swap.safetensors"
        shutil.copy(store / "loras" / "style.safetensors", swapped)
        with cache.use("flux", loras={str(swapped): 1.0}) as pipe:
            a = _image(pipe, max_sequence_length=16)
        time.sleep(0.01)
        shutil.copy(store / "loras" / "detail.safetensors", swapped)
        with cache.use("flux", loras={str(swapped): 1.0}) as pipe:
            b = _image(pipe, max_sequence_length=16)
        with cache.use("flux", loras={"detail": 1.0}) as pipe:
            assert np.array_equal(_image(pipe, max_sequence_length=16), b)
        assert np.abs(a - b).max() > 1e-4
        with cache.use("flux") as pipe:  # after all that, still serving
            pipe.set_progress_bar_config(disable=True)


def test_a_lora_of_another_base_or_format_is_a_short_adapter_error_naming_its_first_layer(
    store, tmp_path
):
    """Whichever way it fails to fit (diffusers' converter refuses it, converts it into
    keys no component has, or the pipeline lacks its component), a LoRA of another base
    is an AdapterError naming the file and its first layer, a few hundred characters
    long, never every key (the kohya SDXL LoRA on FLUX was a 12 kB CheckpointError)."""
    from safetensors.torch import save_file

    from nostall.synthetic import write_lora

    kohya = tmp_path / "sdxl-kohya.safetensors"
    write_lora(store / "sdxl", kohya, rank=4, text_encoder=True, fmt="kohya", seed=4)
    stray = tmp_path / "stray.safetensors"
    factors = {"foo.lora_up.weight": torch.zeros(4, 2), "foo.lora_down.weight": torch.zeros(2, 4)}
    save_file(factors, str(stray))
    plain = tmp_path / "plain.safetensors"
    save_file({f"blocks.{i}.weight": torch.zeros(2, 2) for i in range(40)}, str(plain))
    cases = [  # (base, LoRA file, its first layer: None where no key is a LoRA factor)
        ("flux", kohya, "lora_te1_text_model_encoder_layers_0_mlp_fc1"),  # converter refuses
        ("flux", store / "loras" / "sdxl-style.safetensors", "unet.down_blocks"),
        ("sdxl", store / "loras" / "style.safetensors", "transformer.single_transformer_blocks"),
        ("flux", stray, "foo"),  # converted, into keys no component has
        ("sdxl", stray, "foo"),
        ("sdxl", plain, None),
    ]
    with ModelCache(store, device="cpu") as cache:
        for base, path, layer in cases:
            with pytest.raises(AdapterError) as e:
                _enter(cache.use(base, loras={str(path): 1.0}))
            said = str(e.value)
            assert len(said) < 500, (base, path.name, said)
            assert str(path) in said and e.value.path == str(path)
            assert e.value.field == "loras"  # a service's 422 names the field
            if layer is None:
                assert e.value.layer is None
                assert "no key of it is a LoRA factor" in said and "40 tensors" in said
                assert "'blocks.0.weight'" in said
            else:
                assert e.value.layer.startswith(layer) and e.value.layer in said
        with cache.use("flux", loras={"style": 1.0}) as pipe:  # still serving
            pipe.set_progress_bar_config(disable=True)


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_sdxl_with_text_encoder_layers_and_alphas_equals_diffusers(store, tmp_path, fmt):
    """kohya (sd-scripts) keys and alpha tensors, and PEFT keys with adapter metadata:
    UNet and both CLIP text encoders adapted, alpha twice the rank."""
    from nostall.synthetic import write_lora

    name = f"sdxl-te-{fmt}"
    path = store / "loras" / f"{name}.safetensors"
    write_lora(store / "sdxl", path, rank=4, alpha=8.0, text_encoder=True, fmt=fmt, seed=3)
    ref = _diffusers(store, "sdxl", [name], [0.6])
    with ModelCache(store, device="cpu") as cache:
        lora = cache.lora(name, "sdxl")
        assert set(lora.roles) == {"unet", "text_encoder", "text_encoder_2"}
        with cache.use("sdxl") as pipe:
            base = _image(pipe)
        with cache.use("sdxl", loras={name: 0.6}) as pipe:
            got = _image(pipe)
    assert np.abs(got - base).max() > 1e-3
    assert np.abs(got - ref).max() < 1e-5
