"""The benchmarks run here end to end on a CPU at tiny size: the tests hold them to what
they measured and wrote, not to how fast.

One thread per process: the bench's own threads (decoder, encoder, writer, servers) and
pytest-xdist's workers already share the machine's cores, and torch's intra-op pool spinning
beside them made a tiny decode 5-20x slower (114 s against 20 s on 2 busy cores)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # module scope: before the modules' own module fixtures (one bench run shared by tests)
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # the processes a bench starts
        torch.set_num_threads(1)
        yield
    torch.set_num_threads(before)
