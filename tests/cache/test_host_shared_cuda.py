"""The shared host tier on a GPU: a second process's switch is a pinned memory hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_host_shared import _WORKER

pytestmark = pytest.mark.cuda


def worker(store, *names, env, device, tier):
    """A worker in a fresh process of its own (``env``: without the tests' shm folder, so
    the tier is in /dev/shm); its switches' tiers and images, in order."""
    from nostall.memory import SharedPool

    # Kept first, as an operator keeps one across worker restarts, so the next worker finds
    # what this one read (without, the worker, its last process, removes it as it exits).
    name, root = tier.partition(":")[2], env.get("NOSTALL_SHM_DIR") or "/dev/shm"
    if not any(s.name == name and s.keep for s in SharedPool.segments(root=root)):
        SharedPool(name, 2 << 20, root=root, keep=True).close()  # the worker resizes it
    code = _WORKER.format(tests=os.path.dirname(__file__))
    argv = [sys.executable, "-c", code, str(store), device, tier, *names]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("[")]


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
