"""``nostall quantize --check``: how far the FP8 copy's outputs are from the original's.

Per layer: every converted linear weight, applied to the same random inputs (rows of
N(0, 1), float32) as its original, gives an output SQNR in dB. At the output, for
transformers text encoders (T5, UMT5, CLIP: what ``input_ids`` drive), the original
module and a copy whose converted weights are replaced by their dequantized FP8 values
run the same random token ids. Diffusion models need model-specific inputs (latents,
timesteps, conditioning), so for them the check is per layer only, and says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from nostall.checkpoint import resolve
from nostall.quant.fp8 import SCALE_SUFFIX, dequantize

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
    """Per converted layer ``(name, SQNR dB)``; the output's SQNR when it could run."""

    layers: list[tuple[str, float]] = field(default_factory=list)
    output_db: float | None = None
    output_note: str = ""

    @property
    def worst(self) -> tuple[str, float] | None:
        return min(self.layers, key=lambda r: r[1]) if self.layers else None


def check(
    src: str | os.PathLike, dst: str | os.PathLike, *, samples: int = 64, seed: int = 0
) -> CheckReport:
    """Compare the converted checkpoint ``dst`` with its original ``src`` (a file, shard
    index or component folder, as :func:`~nostall.quantize` took them)."""
    report = CheckReport()
    original = _tensor_files(resolve(src))
    converted = _tensor_files(resolve(dst))
    g = torch.Generator().manual_seed(seed)
    dequantized: dict[str, torch.Tensor] = {}
    for name in sorted(converted):
        if not name.endswith(SCALE_SUFFIX):
            continue
        weight = name[: -len(SCALE_SUFFIX)]
        with safe_open(converted[weight], framework="pt") as f:
            q = f.get_tensor(weight)
            if q.dtype != torch.float8_e4m3fn:
                continue
            scale = f.get_tensor(name)
        with safe_open(original[weight], framework="pt") as f:
            w = f.get_tensor(weight)
        x = torch.randn(samples, w.shape[1], generator=g)
        deq = dequantize(q, scale, torch.float32)
        report.layers.append((weight, sqnr_db(x @ w.float().t(), x @ deq.t())))
        dequantized[weight] = deq.to(w.dtype)
    report.output_db, report.output_note = _output_check(src, dequantized, seed)
    return report


def _tensor_files(ckpt) -> dict[str, str]:
    return {e.name: ckpt.files[i].path for i, e in ckpt.entries()}


def _output_check(src, dequantized: dict[str, torch.Tensor], seed: int):
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

    model = load_model(folder, device="cpu").eval()
    g = torch.Generator().manual_seed(seed)
    vocab = int(config.get("vocab_size", 1000))
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    with torch.no_grad():
        ref = model(input_ids=ids)[0].float()
        params = dict(model.named_parameters())
        for name, w in dequantized.items():
            if name in params:
                params[name].data = w
        got = model(input_ids=ids)[0].float()
    return sqnr_db(ref, got), f"{type(model).__name__} on random token ids (2 x 16)"
