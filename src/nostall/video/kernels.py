"""Fused kernels for the Wan decoder's exact mode.

:func:`rms_silu_into` computes what a Wan residual block does before each 3x3x3 conv,
``silu(F.normalize(x.float(), dim=1).to(x.dtype) * scale * gamma + 0.0)``, and writes it
straight into the interior of the conv's padded input buffer. Eager PyTorch runs that
as about nine full passes over the activation (a float copy, the division, the cast
back, two products, the ``+ 0.0``, SiLU, then ``cat`` and ``F.pad`` to build the conv
input); here it is one read and one write.

The result is bit-identical to the eager chain, because the kernel repeats its
arithmetic and its roundings: the channel norm comes from the same PyTorch reduction
(``vector_norm`` with ``dtype=float32``, which reads ``x`` without the float copy and
sums in the same order); the division is IEEE (``div_rn``, as nvcc compiles ``/``);
every intermediate that eager stores in ``x.dtype`` is rounded to it (round to nearest
even); ``+ 0.0`` turns ``-0`` into ``+0``; and SiLU is ``y / (1 + expf(-y))`` with
libdevice's ``expf``, which is what ATen's SiLU kernel calls. The GPU tests check it bit
for bit at 720p; the CPU (and any device without Triton) runs the eager chain itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["channel_norm", "rms_silu_into", "triton_available"]

_EPS = 1e-12  # F.normalize's default

try:  # Triton ships with CUDA builds of PyTorch; CPU builds may lack it
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_available(device: torch.device) -> bool:
    """Whether the fused kernel can run on ``device``."""
    return triton is not None and device.type == "cuda"


def channel_norm(x: torch.Tensor) -> torch.Tensor:
    """``x.float().norm(2, dim=1, keepdim=True)`` without the float copy of ``x``
    (bit-identical: same reduction, same order)."""
    if x.dtype == torch.float32:
        return x.norm(2, 1, keepdim=True)
    return torch.linalg.vector_norm(x, 2, 1, keepdim=True, dtype=torch.float32)


def rms_silu_into(
    x: torch.Tensor, gamma: torch.Tensor, scale: float, out: torch.Tensor, *, fused: bool = True
) -> None:
    """``out[...] = silu(rms_norm(x) * scale * gamma + 0.0)`` as WanRMS_norm + SiLU compute it.

    ``x``: ``(B, C, T, H, W)`` (any strides); ``gamma``: ``C`` elements; ``out``: a
    tensor of ``x``'s shape and dtype, usually a strided view of a padded buffer. The
    kernel runs for bf16 and fp32 on CUDA with Triton; otherwise (``fused=False``, fp16,
    a CPU tensor) the eager chain itself writes ``out``.
    """
    if fused and triton_available(x.device) and x.dtype in _ROUND:
        _launch(x, channel_norm(x), gamma, scale, out)
        return
    normalized = F.normalize(x.float() if x.dtype != torch.float32 else x, dim=1).to(x.dtype)
    y = normalized * scale * gamma.view(-1, 1, 1, 1) + 0.0
    out.copy_(F.silu(y))


# The dtypes whose fused results were checked bit for bit on the GPU (fp16 runs the eager
# chain: the kernel's fp16 rounding path exists but has not been checked there).
_ROUND = {torch.bfloat16: 0, torch.float32: 2}


def _launch(x, norm, gamma, scale, out, *, block: int = 2048, num_warps: int = 4) -> None:
    """One program per (b, c, t, h) row and ``block`` columns; ``block``/``num_warps`` are
    the knobs ``scripts/diag_vae_exact.py --tune-kernel`` measures."""
    B, C, T, H, W = x.shape
    rows = B * C * T * H
    block = min(block, triton.next_power_of_2(W))
    xs, os_ = x.stride(), out.stride()
    _rms_silu[(rows, triton.cdiv(W, block))](
        x, norm, gamma.reshape(-1), out,
        C, T, H, W,
        *xs, *os_,
        norm.stride(0), norm.stride(2), norm.stride(3), norm.stride(4),
        float(scale), _EPS,
        BLOCK=block, ROUND=_ROUND[x.dtype], num_warps=num_warps,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _round(y, ROUND: tl.constexpr):
        # What storing the intermediate in x.dtype does in eager (fp32: nothing).
        if ROUND == 0:
            y = y.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        elif ROUND == 1:
            y = y.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
        return y

    @triton.jit
    def _rms_silu(
        x_ptr, n_ptr, g_ptr, o_ptr,
        C, T, H, W,
        xb, xc, xt, xh, xw,
        ob, oc, ot, oh, ow,
        nb, nt, nh, nw,
        scale, eps,
        BLOCK: tl.constexpr, ROUND: tl.constexpr,
    ):  # fmt: skip
        # One program per (b, c, t, h) row and block of w: the index arithmetic is scalar.
        row = tl.program_id(0).to(tl.int64)
        h = row % H
        t = (row // H) % T
        c = (row // (H * T)) % C
        b = row // (H * T * C)
        w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = w < W
        x = tl.load(x_ptr + b * xb + c * xc + t * xt + h * xh + w * xw, mask=mask, other=0.0)
        n = tl.load(n_ptr + b * nb + t * nt + h * nh + w * nw, mask=mask, other=1.0)
        g = tl.load(g_ptr + c).to(tl.float32)
        y = tl.math.div_rn(x.to(tl.float32), tl.maximum(n, eps))
        y = _round(y, ROUND)  # F.normalize(...).to(x.dtype)
        y = _round(y * scale, ROUND)
        y = _round(y * g, ROUND)
        y = tl.where(y == 0.0, 0.0, y)  # + 0.0
        y = tl.math.div_rn(y, 1.0 + libdevice.exp(-y))  # SiLU, as ATen computes it
        ptr = o_ptr + b * ob + c * oc + t * ot + h * oh + w * ow
        if ROUND == 2:
            tl.store(ptr, y, mask=mask)
        else:
            tl.store(ptr, y.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
