"""One GPU kernel for a fused LoRA weight: ``out = base + alpha · up @ down``, each weight
element read once and written once.

``torch.addmm(base, up, down, out=w)`` first copies ``base`` into ``w`` and then runs a
GEMM that reads and writes ``w`` again: four passes over the weight where two would do.
For a FLUX LoRA on all 418 block linears (17.2 GB of bf16 weights) that made a LoRA
switch 53 ms on an H200, against 11 ms for the plain copy back to the base. The rank is
small (4–128), so one tile of ``up`` and one of ``down`` give a whole output tile: the
kernel below computes it in float32 on the tensor cores, adds the base tile and rounds
once, as cuBLAS does with ``beta = 1``.

Triton is imported at the first call, never at import; without Triton, on a CPU, or
for a float32 weight (where ``tl.dot`` would round the inputs to TF32), :func:`fused_addmm`
says no and the caller uses ``addmm``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fused_addmm"]

_KERNEL: Any = None
_BLOCK = 128  # output tile (BLOCK × BLOCK): 32 KB of bf16 read and written per program


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def fuse(base, up, down, out, M, N, K, alpha,
             sbm, sbn, sum_, suk, sdk, sdn, som, son,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(up + rm[:, None] * sum_ + rk[None, :] * suk,
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # fmt: skip
            b = tl.load(down + rk[:, None] * sdk + rn[None, :] * sdn,
                        mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)  # fmt: skip
            acc += tl.dot(a, b)  # (BM, BK) @ (BK, BN), float32 accumulate
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        w = tl.load(base + rm[:, None] * sbm + rn[None, :] * sbn, mask=mask, other=0.0)
        res = w.to(tl.float32) + alpha * acc  # rounded once, below
        tl.store(out + rm[:, None] * som + rn[None, :] * son, res.to(out.dtype.element_ty),
                 mask=mask)  # fmt: skip

    _KERNEL = fuse
    return fuse


def fused_addmm(
    base: torch.Tensor, up: torch.Tensor, down: torch.Tensor, alpha: float, out: torch.Tensor
) -> bool:
    """``out = base + alpha · up @ down`` in one pass (``base`` may be ``out``); returns
    ``False``, having done nothing, where the kernel does not apply: not a CUDA tensor,
    not bf16/fp16, mixed dtypes or devices, or no Triton."""
    if not (base.is_cuda and base.dtype in (torch.bfloat16, torch.float16)):
        return False
    if base.ndim != 2 or up.ndim != 2 or down.ndim != 2:
        return False
    tensors = (base, up, down, out)
    if any(t.dtype != base.dtype or t.device != base.device for t in tensors):
        return False
    (m, n), k = base.shape, up.shape[1]
    if up.shape[0] != m or down.shape != (k, n) or out.shape != (m, n):
        return False
    try:
        kernel = _kernel()
    except ImportError:
        return False
    bk = max(16, min(64, 1 << (k - 1).bit_length()))  # tl.dot needs 16 or more
    grid = (-(-m // _BLOCK), -(-n // _BLOCK))
    with torch.cuda.device(base.device):
        kernel[grid](
            base, up, down, out, m, n, k, float(alpha),
            base.stride(0), base.stride(1), up.stride(0), up.stride(1),
            down.stride(0), down.stride(1), out.stride(0), out.stride(1),
            BM=_BLOCK, BN=_BLOCK, BK=bk, num_warps=8,
        )  # fmt: skip
    return True
