"""The grouped LoRA kernel's logic on a CPU, under Triton's interpreter
(``TRITON_INTERPRET=1``, in a child process: the flag is read when a kernel is built):
many weights of odd shapes and ranks, factors addressed inside one packed block, one in
place, each equal to the exact sum within one fp16 rounding."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHILD = textwrap.dedent(
    """
    import torch
    from nostall.adapters.kernels import fused_addmm_group
    torch.manual_seed(0)
    dt = torch.float16
    flat = torch.zeros(200_000, dtype=dt)
    items, checks, off = [], [], 0
    for i, (m, n, k) in enumerate([(200, 130, 8), (64, 300, 16), (129, 17, 3), (130, 140, 40)]):
        base = torch.randn(m, n).to(dt)
        up = flat[off : off + m * k].view(m, k)
        off += m * k + 64
        down = flat[off : off + k * n].view(k, n)
        off += k * n + 64
        up.copy_(torch.randn(m, k) * 0.1)
        down.copy_(torch.randn(k, n) * 0.1)
        want = base.double() + (0.5 + i) * (up.double() @ down.double())
        out = base.clone() if i == 1 else torch.empty_like(base)  # the second in place
        items.append((out if i == 1 else base, up.data_ptr(), down.data_ptr(), 0.5 + i, out, k))
        checks.append((out, want))
    assert fused_addmm_group(items)
    for out, want in checks:
        err = (out.double() - want).abs() / (want.abs() * 2**-10 + 1e-4)
        assert float(err.max()) <= 1.0, float(err.max())
    print("ok")
    """
)


@pytest.mark.slow
def test_the_grouped_kernel_writes_every_weight_within_one_rounding():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
