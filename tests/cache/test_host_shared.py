"""One host tier for the worker processes of a host: ModelCache(host_tier="shared:NAME")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nostall.errors import ArgumentError
from nostall.memory import SharedPool

# A worker process: switch to each pipeline named, print each switch's component tiers
# and the image's bytes digest.
_WORKER = """
import hashlib, json, sys
sys.path.insert(0, {tests!r})
import nostall
from cache_support import run
store, device, tier, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
with nostall.ModelCache(store, device=device, host_tier=tier) as cache:
    for name in names:
        with cache.use(name) as pipe:
            image = run(pipe, name, device=device)
        tiers = {{c.role: c.tier for c in cache.last_report.components}}
        print(json.dumps([name, tiers, hashlib.sha256(image.tobytes()).hexdigest()]))
"""


def worker(store, *names, env, device="cpu", tier="shared:t", keep=True):
    """Run a worker process; its switches' tiers and images, in order.

    With ``keep``, the tier is marked kept first (``SharedPool(keep=True)``, as an operator
    keeps one across worker restarts), so the next worker finds what this one read; without,
    the worker, its last process, removes it as it exits."""
    name, root = tier.partition(":")[2], env.get("NOSTALL_SHM_DIR") or "/dev/shm"
    if keep and not any(s.name == name and s.keep for s in SharedPool.segments(root=root)):
        SharedPool(name, 2 << 20, root=root, keep=True).close()  # the worker resizes it
    code = _WORKER.format(tests=os.path.join(os.path.dirname(__file__)))
    p = subprocess.run(
        [sys.executable, "-c", code, str(store), device, tier, *names],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("[")]


def test_what_one_worker_read_is_a_memory_hit_for_the_next(store, tmp_path):
    env = {**os.environ, "NOSTALL_SHM_DIR": str(tmp_path)}
    first = worker(store, "flux", env=env)
    assert all(t == "disk" for _, tiers, _ in first for t in tiers.values())
    # A new process: every component is in the host's tier already.
    second = worker(store, "flux", env=env)
    assert all(t == "host" for _, tiers, _ in second for t in tiers.values()), second
    images = {name: digest for name, _, digest in first}
    assert {name: digest for name, _, digest in second} == images
    assert [s.name for s in SharedPool.segments(root=tmp_path)] == ["t"]  # kept


def test_a_tier_nobody_keeps_goes_with_its_last_worker(store, tmp_path):
    env = {**os.environ, "NOSTALL_SHM_DIR": str(tmp_path)}
    first = worker(store, "flux", env=env, keep=False)
    assert all(t == "disk" for _, tiers, _ in first for t in tiers.values())
    assert os.listdir(tmp_path) == []  # no segment left in RAM


def test_a_host_tier_name_is_checked(store):
    import nostall

    with pytest.raises(ArgumentError, match="'shared:NAME'"):
        nostall.ModelCache(store, device="cpu", host_tier="shared:")
    with pytest.raises(ArgumentError, match="host_tier='global'"):
        nostall.ModelCache(store, device="cpu", host_tier="global")
