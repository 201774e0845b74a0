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

__all__ = [
    "add_bias_",
    "bias_residual",
    "channel_norm",
    "copy_into",
    "rms_silu_cl_into",
    "rms_silu_into",
    "triton_available",
    "upsample2x_cl",
]

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


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, for the decoder's history copies: two padded frames per conv
    in and out of the working buffer. Those are strided slices (each channel's frames
    are contiguous, the channels are not), which ATen copies with its generic, not
    vectorised, kernel: about a tenth of exact mode's device time at 720p. On CUDA with
    Triton, when both sides are rows of one contiguous length at one row stride each,
    one kernel copies them at full bandwidth. A copy moves bits, so nothing changes."""
    rows = _rows(src, dst) if triton_available(dst.device) and src.dtype == dst.dtype else None
    if rows is None:
        dst.copy_(src)
        return
    n, count, s_row, d_row = rows
    block = 4096
    _copy_rows[(count, triton.cdiv(n, block))](src, dst, n, s_row, d_row, BLOCK=block)


def _rows(src: torch.Tensor, dst: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``(row length, rows, src row stride, dst row stride)`` if ``src`` and ``dst`` (same
    shape) are both rows of one contiguous run, taken in ``src``'s memory order."""
    if src.shape != dst.shape or src.numel() == 0:
        return None
    dims = [i for i in range(src.dim()) if src.shape[i] > 1]
    dims.sort(key=lambda i: -src.stride(i))
    n, k = 1, len(dims)
    while k > 0 and src.stride(dims[k - 1]) == n and dst.stride(dims[k - 1]) == n:
        n *= src.shape[dims[k - 1]]
        k -= 1
    if k == 0:
        return n, 1, 0, 0
    if k == 1:
        i = dims[0]
        return n, src.shape[i], src.stride(i), dst.stride(i)
    return None


def _dense_like(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` lie the same way over one dense block each (same strides)."""
    return a.shape == b.shape and a.stride() == b.stride() and _dense(a)


def _dense(a: torch.Tensor) -> bool:
    """One dense block, channels first or (4-D/5-D) channels last."""
    if a.is_contiguous():
        return True
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(a.dim())
    return fmt is not None and a.is_contiguous(memory_format=fmt)


def _channel_step(y: torch.Tensor) -> int:
    """Elements between one channel and the next in ``y``'s memory (dense ``y``)."""
    return 1 if not y.is_contiguous() else y[0, 0].numel()


def add_bias_(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y.add_(bias)`` over the channel axis, as ATen adds a cuDNN conv's bias (cuDNN
    convs have none; ATen adds it afterwards in ``y``'s dtype): same bits, one
    vectorised pass instead of ATen's broadcast kernel."""
    if bias is None:
        return y
    if triton_available(y.device) and y.dtype in _ROUND and _dense(y):
        _launch_bias(y, bias, None, y)
        return y
    return y.add_(bias.view(1, -1, *([1] * (y.dim() - 2))))


def bias_residual(y: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
    """``y.add_(bias) + h`` (a residual block's second conv, its bias, the shortcut) in
    one pass, written into ``y``; each step rounded to ``y``'s dtype as eager rounds it."""
    fused = bias is not None and triton_available(y.device) and y.dtype in _ROUND
    if fused and h.dtype == y.dtype and _dense_like(y, h):
        _launch_bias(y, bias, h, y)
        return y
    return add_bias_(y, bias) + h


def _launch_bias(y, bias, h, out, *, block: int = 4096) -> None:
    n = y.numel()
    _bias_add[(triton.cdiv(n, block),)](
        y,
        bias,
        y if h is None else h,
        out,
        n,
        _channel_step(y),
        y.shape[1],
        HAS_RES=h is not None,
        ROUND=_ROUND[y.dtype],
        BLOCK=block,
        num_warps=8,
    )


def rms_silu_cl_into(
    x: torch.Tensor,
    gamma: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    """The ``fast`` mode's fused norm: ``out[...] = silu(rms_norm(x + bias) * scale * gamma)``
    for channels-last ``x`` and ``out`` (channels adjacent in memory), one program per
    block of pixels with every channel in registers, so the norm is computed in the
    kernel instead of by a separate reduction, and the previous conv's bias is added on
    the way in. Not bit-identical to eager (the sum's order differs; ``exp`` is the fast
    one): ``fast`` mode's frames are checked by PSNR. Elsewhere: the eager chain."""
    if (
        triton_available(x.device)
        and x.dtype in _ROUND
        and x.is_contiguous(memory_format=torch.channels_last_3d)
        and out.stride(1) == 1
    ):
        B, C, T, H, W = x.shape
        pixels = B * T * H * W
        block_c = triton.next_power_of_2(C)
        block_p = max(1, 4096 // block_c)
        _rms_silu_cl[(triton.cdiv(pixels, block_p),)](
            x,
            gamma.reshape(-1),
            x if bias is None else bias,
            out,
            pixels,
            C,
            T,
            H,
            W,
            out.stride(0),
            out.stride(2),
            out.stride(3),
            out.stride(4),
            float(scale),
            _EPS,
            HAS_BIAS=bias is not None,
            BLOCK_P=block_p,
            BLOCK_C=block_c,
            ROUND=_ROUND[x.dtype],
            num_warps=8,
        )
        return
    if bias is not None:
        x = x + bias.view(1, -1, 1, 1, 1)
    rms_silu_into(x, gamma, scale, out, fused=False)


def upsample2x_cl(x: torch.Tensor) -> torch.Tensor | None:
    """Nearest-neighbour 2x up-sampling of channels-last frames ``(N, C, h, w)`` into
    new channels-last frames ``(N, C, 2h, 2w)``: each input pixel's channels are read
    once and written to its four output pixels. ATen's channels-last nearest kernel
    took 2.5 ms per 720p call on the H200, several times the bandwidth bound. Values are
    only moved, so the result equals ``F.interpolate(x, scale_factor=2, mode="nearest")``
    (and ``"nearest-exact"``, the same pixels at an integer factor). ``None`` where the
    kernel cannot run (the caller interpolates)."""
    if not (triton_available(x.device) and x.dim() == 4):
        return None
    if not x.is_contiguous(memory_format=torch.channels_last):
        return None
    N, C, h, w = x.shape
    out = torch.empty(
        N, C, 2 * h, 2 * w, dtype=x.dtype, device=x.device, memory_format=torch.channels_last
    )
    pixels = N * h * w
    block_c = triton.next_power_of_2(C)
    block_p = max(1, 4096 // block_c)
    _up2x_cl[(triton.cdiv(pixels, block_p),)](
        x, out, pixels, C, h, w, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4
    )
    return out


# The dtypes whose fused results were checked bit for bit on the GPU (fp16 runs the eager
# chain: the kernel's fp16 rounding path exists but has not been checked there).
_ROUND = {torch.bfloat16: 0, torch.float32: 2}


def _launch(x, norm, gamma, scale, out, *, block: int = 256, num_warps: int = 2) -> None:
    """One program per (b, c, t, h) row and ``block`` columns; ``block``/``num_warps`` are
    the knobs ``scripts/diag_vae_exact.py --tune-kernel`` measures. Measured on an H200 at
    commit 045851d, bf16 (see the benchmarks' diag records): 256 x 2 warps is the fastest
    of 12 configurations for both the 720p (96 channels, 1.32 ms against 1.89 ms for
    2048 x 4) and the 360p (192 channels) activations."""
    B, C, T, H, W = x.shape
    rows = B * C * T * H
    block = min(block, triton.next_power_of_2(W))
    xs, os_ = x.stride(), out.stride()
    _rms_silu[(rows, triton.cdiv(W, block))](
        x,
        norm,
        gamma.reshape(-1),
        out,
        C,
        T,
        H,
        W,
        *xs,
        *os_,
        norm.stride(0),
        norm.stride(2),
        norm.stride(3),
        norm.stride(4),
        float(scale),
        _EPS,
        BLOCK=block,
        ROUND=_ROUND[x.dtype],
        num_warps=num_warps,
    )


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
        x_ptr,
        n_ptr,
        g_ptr,
        o_ptr,
        C,
        T,
        H,
        W,
        xb,
        xc,
        xt,
        xh,
        xw,
        ob,
        oc,
        ot,
        oh,
        ow,
        nb,
        nt,
        nh,
        nw,
        scale,
        eps,
        BLOCK: tl.constexpr,
        ROUND: tl.constexpr,
    ):
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

    @triton.jit
    def _copy_rows(src, dst, n, s_row, d_row, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + row * d_row + offs, tl.load(src + row * s_row + offs, mask=mask), mask=mask)

    @triton.jit
    def _bias_add(
        y_ptr,
        b_ptr,
        h_ptr,
        o_ptr,
        n,
        step,
        C,
        HAS_RES: tl.constexpr,
        ROUND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        c = (i // step) % C
        y = tl.load(y_ptr + i, mask=mask, other=0.0).to(tl.float32)
        y = _round(y + tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32), ROUND)
        if HAS_RES:
            y = _round(y + tl.load(h_ptr + i, mask=mask, other=0.0).to(tl.float32), ROUND)
        if ROUND == 2:
            tl.store(o_ptr + i, y, mask=mask)
        else:
            tl.store(
                o_ptr + i, y.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask
            )

    @triton.jit
    def _rms_silu_cl(
        x_ptr,
        g_ptr,
        b_ptr,
        o_ptr,
        P,
        C,
        T,
        H,
        W,
        ob,
        ot,
        oh,
        ow,
        scale,
        eps,
        HAS_BIAS: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_C: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        # One program per BLOCK_P pixels (in x's memory order b, t, h, w), all channels.
        p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.arange(0, BLOCK_C)
        cmask = c < C
        mask = (p < P)[:, None] & cmask[None, :]
        x = tl.load(x_ptr + p[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)
            x = tl.where(mask, _round(x + b[None, :], ROUND), 0.0)
        n = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)
        g = tl.load(g_ptr + c, mask=cmask, other=0.0).to(tl.float32)
        y = _round(x / n[:, None], ROUND)
        y = _round(y * scale, ROUND)
        y = _round(y * g[None, :], ROUND)
        y = y / (1.0 + tl.exp(-y))
        w = p % W
        h = (p // W) % H
        t = (p // (W * H)) % T
        bb = p // (W * H * T)
        ptr = o_ptr + (bb * ob + t * ot + h * oh + w * ow)[:, None] + c[None, :]
        if ROUND == 2:
            tl.store(ptr, y, mask=mask)
        else:
            tl.store(ptr, y.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _up2x_cl(x_ptr, o_ptr, P, C, h, w, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.arange(0, BLOCK_C)
        mask = (p < P)[:, None] & (c < C)[None, :]
        v = tl.load(x_ptr + p[:, None] * C + c[None, :], mask=mask)
        j = p % w
        i = (p // w) % h
        n = p // (w * h)
        row = (n * 2 * h + 2 * i) * 2 * w + 2 * j  # the top-left output pixel
        for d in tl.static_range(4):
            q = row + (d // 2) * 2 * w + (d % 2)
            tl.store(o_ptr + q[:, None] * C + c[None, :], v, mask=mask)
