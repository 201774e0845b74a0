"""``nostall quantize --check``: how far the FP8 copy's outputs are from the original's.

Everything runs the FP8 copy's **real forward**, as ``load_model`` builds it on the
device given (FP8 tensor cores with activations quantized per row on a capable GPU,
the weight upcast per call on a CPU), against the original in the same dtype:

* per layer: every converted linear layer, as its FP8 module, applied to the same
  random inputs (rows of N(0, 1)) as its original;
* at the output, for transformers text encoders (T5, UMT5, CLIP: what ``input_ids``
  drive), both whole models on the same random token ids. Diffusion models need
  model-specific inputs (latents, timesteps, conditioning), so for them the check is
  per layer only, and says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from safetensors import safe_open

from nostall.quant.fp8 import SCALE_SUFFIX
from nostall.store import resolve

__all__ = ["CheckReport", "check", "sqnr_db"]


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``got`` against ``ref``, in dB."""
    ref, got = ref.double(), got.double()
    noise = (ref - got).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))


@dataclass
class CheckReport:
    """Per converted layer ``(name, SQNR dB)``; the output's SQNR when it could run; how
    the FP8 layers computed (``compute``: ``"tensor-cores"`` or ``"upcast"``)."""

    layers: list[tuple[str, float]] = field(default_factory=list)
    output_db: float | None = None
    output_note: str = ""
    compute: str = ""

    @property
    def worst(self) -> tuple[str, float] | None:
        return min(self.layers, key=lambda r: r[1]) if self.layers else None


def check(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    samples: int = 64,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> CheckReport:
    """Compare the converted checkpoint ``dst`` with its original ``src`` (a file, shard
    index or component folder, as :func:`~nostall.quantize` took them), on ``device``
    (default: the GPU when there is one; there activations are bf16, as served)."""
    from nostall.quant.modules import fp8_compute, install_fp8

    dev = torch.device(device) if device is not None else _default_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    report = CheckReport(compute=fp8_compute(dev)[0])
    original = _tensor_files(resolve(src))
    converted = _tensor_files(resolve(dst))
    g = torch.Generator().manual_seed(seed)
    for name in sorted(converted):
        if not name.endswith(SCALE_SUFFIX):
            continue
        weight = name[: -len(SCALE_SUFFIX)]
        with safe_open(converted[weight][0], framework="pt") as f:
            q = f.get_tensor(converted[weight][1])
            if q.dtype != torch.float8_e4m3fn:
                continue
            scale = f.get_tensor(converted[name][1])
        with safe_open(original[weight][0], framework="pt") as f:
            w = f.get_tensor(original[weight][1])
        ref = nn.Linear(w.shape[1], w.shape[0], bias=False, device=dev, dtype=dtype)
        ref.weight.data.copy_(w)
        layer = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        layer.weight = nn.Parameter(q.to(dev), requires_grad=False)
        install_fp8(layer, {"weight": scale.to(dev)})
        x = torch.randn(samples, w.shape[1], generator=g).to(dev, dtype)
        with torch.no_grad():
            report.layers.append((weight, sqnr_db(ref(x), layer(x))))
    report.output_db, report.output_note = _output_check(src, dst, seed, dev, dtype)
    return report


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _tensor_files(ckpt) -> dict[str, tuple[str, str]]:
    """Each tensor's ``(file, key in it)``, by the name it is read under."""
    return {e.name: (ckpt.files[i].path, e.key) for i, e in ckpt.entries()}


def _output_check(src, dst, seed: int, dev: torch.device, dtype: torch.dtype):
    folder = os.fspath(src)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        return None, "per layer only: no config.json to build the model from"
    with open(config_path) as f:
        config = json.load(f)
    archs = config.get("architectures") or []
    if not any(a.endswith(("EncoderModel", "TextModel", "TextModelWithProjection")) for a in archs):
        return None, "per layer only: outputs need model-specific inputs (not a text encoder)"
    from nostall.api import load_model

    g = torch.Generator().manual_seed(seed)
    vocab = int(config.get("vocab_size", 1000))
    ids = torch.randint(0, vocab, (2, 16), generator=g).to(dev)
    outs = []
    for path in (folder, os.fspath(dst)):
        model = load_model(path, device=dev, dtype=dtype).eval()
        with torch.no_grad():
            outs.append(model(input_ids=ids)[0].float())
        del model
    return sqnr_db(*outs), f"{archs[0]} on random token ids (2 x 16), FP8 forward on {dev}"
