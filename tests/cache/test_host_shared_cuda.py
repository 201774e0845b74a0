"""The shared host tier on a GPU: a second process's switch is a pinned memory hit."""

from __future__ import annotations

import os

import pytest
from test_host_shared import worker

pytestmark = pytest.mark.cuda


def test_a_second_process_switches_from_the_shared_tier_on_the_gpu(store):
    from nostall.memory import SharedPool

    # In /dev/shm: CUDA pins shared memory (tmpfs); Linux refuses to pin a disk file's
    # pages for long (FOLL_LONGTERM on file-backed mappings, since 6.5).
    env = {k: v for k, v in os.environ.items() if k != "NOSTALL_SHM_DIR"}
    name = f"test-{os.getpid()}"
    try:
        first = worker(store, "flux", "sdxl", env=env, device="cuda", tier=f"shared:{name}")
        assert all(t == "disk" for _, tiers, _ in first for t in tiers.values())
        second = worker(store, "sdxl", "flux", env=env, device="cuda", tier=f"shared:{name}")
        assert all(t == "host" for _, tiers, _ in second for t in tiers.values()), second
        assert {n: d for n, _, d in second} == {n: d for n, _, d in first}
    finally:
        SharedPool.destroy(name, force=True)
