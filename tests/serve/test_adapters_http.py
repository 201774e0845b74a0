"""LoRAs through the worker's images endpoint: fused per request, the base for requests
without them, every bad ``loras`` field a 422 naming it."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def loras(store):
    """LoRAs of the tiny FLUX and SDXL under the store's loras/ folder, and a broken one."""
    from nostall.synthetic import write_lora

    folder = store / "loras"
    folder.mkdir(exist_ok=True)
    write_lora(store / "flux", folder / "flux-style.safetensors", rank=4, seed=5, std=0.2)
    write_lora(store / "sdxl", folder / "sdxl-style.safetensors", rank=4, seed=6, std=0.2,
               fmt="kohya", text_encoder=True)  # fmt: skip
    data = (folder / "flux-style.safetensors").read_bytes()
    (folder / "broken.safetensors").write_bytes(data[: len(data) // 3])
    return folder


def _png(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))


def _body(model="flux", **kw):
    body = {"model": model, "prompt": "a fox", "size": "32x32", "steps": 2, "seed": 3}
    if model == "flux":
        body["max_sequence_length"] = 16
    return {**body, **kw}


def _diffusers(store, model, lora, scale):
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(store / model))
    pipe.set_progress_bar_config(disable=True)
    kw = {"max_sequence_length": 16} if model == "flux" else {}
    if lora:
        pipe.load_lora_weights(str(store / "loras" / f"{lora}.safetensors"), adapter_name="a")
        pipe.set_adapters(["a"], [scale])
    g = torch.Generator().manual_seed(3)
    return np.asarray(pipe(prompt="a fox", height=32, width=32, num_inference_steps=2,
                           generator=g, output_type="pil", **kw).images[0])  # fmt: skip


@pytest.mark.parametrize("model", ["flux", "sdxl"])
def test_a_request_with_a_lora_gets_diffusers_image_and_the_next_one_the_base(
    serve, store, loras, model
):
    server, _ = serve()
    lora = f"{model}-style"
    with httpx.Client(base_url=server.url, timeout=300) as c:
        base = _png(c.post("/v1/images/generations", json=_body(model)))
        body = _body(model, loras=[{"name": lora, "scale": 0.7}])
        styled = _png(c.post("/v1/images/generations", json=body))
        again = _png(c.post("/v1/images/generations", json=_body(model)))
    assert np.array_equal(base, _diffusers(store, model, None, 0))
    assert np.array_equal(again, base)  # the base bit for bit after a LoRA request
    ref = _diffusers(store, model, lora, 0.7)
    assert np.abs(styled.astype(int) - base).max() > 3  # the LoRA shows
    # fused against diffusers' unfused adapter: float noise, at most a level in a pixel
    assert np.abs(styled.astype(int) - ref).max() <= 1


@pytest.mark.parametrize(
    ("loras_field", "says"),
    [
        ([{"name": "flux-stlye", "scale": 1.0}], "flux-style"),  # close names offered
        ([{"name": "../flux/transformer", "scale": 1.0}], "no LoRA"),  # names, not paths
        ([{"name": "flux-style", "scale": 1e9}], "beyond"),
        ([{"name": "flux-style"}, {"name": "flux-style"}], "twice"),
        ([{"name": "flux-style", "scale": 1.0}] * 9, "at most 8"),
        ([{"name": "sdxl-style", "scale": 1.0}], "sdxl-style"),  # another base's LoRA
        ([{"name": "broken", "scale": 1.0}], "broken"),  # a file the server cannot read
    ],
    ids=["unknown", "path", "huge", "twice", "too-many", "other-base", "broken-file"],
)
def test_bad_loras_are_422_naming_the_field(serve, loras, loras_field, says):
    server, worker = serve()
    with httpx.Client(base_url=server.url, timeout=300) as c:
        r = c.post("/v1/images/generations", json=_body(loras=loras_field))
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["field"] == "loras" and says in err["message"], err
        ok = c.post("/v1/images/generations", json=_body())  # still serving
        assert ok.status_code == 200
    assert worker.ready


def test_a_string_scale_is_refused_by_the_schema(serve, loras):
    server, _ = serve()
    r = httpx.post(f"{server.url}/v1/images/generations",
                   json=_body(loras=[{"name": "flux-style", "scale": "1"}]), timeout=60)  # fmt: skip
    assert r.status_code == 422 and "scale" in r.text


def _control_b64(side=32, fmt="PNG") -> str:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, fmt)
    return base64.b64encode(buf.getvalue()).decode()


def test_a_request_with_a_controlnet_gets_diffusers_controlnet_image(serve, store, controlnets):
    import torch
    from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline

    server, _ = serve()
    control = {"name": "edges", "image": _control_b64(), "scale": 0.8}
    with httpx.Client(base_url=server.url, timeout=300) as c:
        base = _png(c.post("/v1/images/generations", json=_body("sdxl")))
        got = _png(c.post("/v1/images/generations", json=_body("sdxl", controlnet=control)))
        again = _png(c.post("/v1/images/generations", json=_body("sdxl")))
    pipe = StableDiffusionXLControlNetPipeline.from_pretrained(
        str(store / "sdxl"), controlnet=ControlNetModel.from_pretrained(str(controlnets))
    )
    pipe.set_progress_bar_config(disable=True)
    img = Image.open(io.BytesIO(base64.b64decode(control["image"])))
    ref = pipe(prompt="a fox", height=32, width=32, num_inference_steps=2, image=img,
               controlnet_conditioning_scale=0.8, generator=torch.Generator().manual_seed(3),
               output_type="pil").images[0]  # fmt: skip
    assert np.abs(got.astype(int) - np.asarray(ref)).max() <= 1
    assert np.abs(got.astype(int) - base).max() > 3 and np.array_equal(again, base)


@pytest.mark.parametrize(
    ("control", "field", "says"),
    [
        ({"name": "egdes", "image": "x"}, "controlnet", "edges"),
        ({"name": "edges", "image": _control_b64(side=48)}, "controlnet.image", "32x32"),
        ({"name": "edges", "image": "bm90IGFuIGltYWdl"}, "controlnet.image", "not a base64"),
        ({"name": "edges", "image": _control_b64(), "scale": 9.0}, "controlnet.scale", "[0, 5]"),
    ],
    ids=["unknown", "wrong-size", "not-an-image", "scale"],
)
def test_bad_controlnet_fields_are_422(serve, controlnets, control, field, says):
    server, _ = serve()
    r = httpx.post(f"{server.url}/v1/images/generations",
                   json=_body("sdxl", controlnet=control), timeout=60)  # fmt: skip
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == field and says in err["message"], err


def test_a_controlnet_of_another_architecture_is_422_at_run_time(serve, controlnets):
    server, worker = serve()
    control = {"name": "edges", "image": _control_b64(), "scale": 1.0}
    r = httpx.post(f"{server.url}/v1/images/generations",
                   json=_body("flux", controlnet=control), timeout=120)  # fmt: skip
    assert r.status_code == 422 and r.json()["error"]["field"] == "controlnet", r.text
    assert worker.ready
