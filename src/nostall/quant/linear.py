"""One FP8 linear layer's forward: FP8 tensor cores, or the weight upcast per call.

The weight is e4m3 ``(N, K)`` with a float32 scale per output row ``(N,)`` (or one
value, community files); ``weight ≈ q * scale[:, None]``.

* **tensor cores** (CUDA, compute capability 8.9+; bf16 activations): the activation
  is quantised per row in one kernel (:func:`~nostall.quant.kernels.quantize_rows`),
  then ``torch._scaled_mm`` multiplies the two e4m3 operands and applies both scales
  and the bias in its epilogue, writing bf16. Under ``torch.compile`` the quantisation
  is written in plain ops, which inductor fuses into the kernel before it.
* **upcast**: ``x @ (q * scale)ᵀ`` in ``x``'s dtype, what diffusers' layerwise casting
  does (CPU, older GPUs, fp16/fp32 activations).

The same function runs for ``load_model`` and for the model cache, so both compute the
same bits from the same bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nostall.quant.fp8 import dequantize
from nostall.quant.kernels import quantize_rows, quantize_rows_reference

__all__ = ["fp8_linear"]


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    tensor_cores: bool,
) -> torch.Tensor:
    """``F.linear(x, weight * scale[:, None], bias)`` with an e4m3 ``weight``; on tensor
    cores when ``tensor_cores`` and ``x`` is bf16 (else upcast)."""
    if tensor_cores and x.dtype == torch.bfloat16:
        return _scaled(x, weight, scale, bias)
    w = dequantize(weight, scale, x.dtype)
    return F.linear(x, w, bias.to(x.dtype) if bias is not None else None)


def _scaled(x, weight, scale, bias):
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty((*lead, n))
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if torch.compiler.is_compiling():
        xq, xs = quantize_rows_reference(x2)
    else:
        xq, xs = quantize_rows(x2)
    # scaled_mm's row-wise form takes (M, 1) and (1, N) float32 scales.
    sb = (
        scale.reshape(1, n) if scale.numel() == n else scale.reshape(1, 1).expand(1, n).contiguous()
    )
    if bias is not None and bias.dtype != torch.bfloat16:
        bias = bias.to(torch.bfloat16)
    # weight.t() is the column-major (K, N) operand scaled_mm wants: no copy.
    y = torch._scaled_mm(
        xq,
        weight.t(),
        scale_a=xs,
        scale_b=sb,
        bias=bias,
        out_dtype=torch.bfloat16,
        use_fast_accum=True,
    )
    return y.reshape(*lead, n)
