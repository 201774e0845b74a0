"""One host tier for the worker processes of a host: ModelCache(host_tier="shared:NAME")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nostall.errors import ArgumentError

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


def worker(store, *names, env, device="cpu", tier="shared:t"):
    """Run a worker process; its switches' tiers and images, in order."""
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
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("nostall-")]


def test_a_host_tier_name_is_checked(store):
    import nostall

    with pytest.raises(ArgumentError, match="'shared:NAME'"):
        nostall.ModelCache(store, device="cpu", host_tier="shared:")
    with pytest.raises(ArgumentError, match="host_tier='global'"):
        nostall.ModelCache(store, device="cpu", host_tier="global")
