"""One host tier for the worker processes of a host: ModelCache(host_tier="shared:NAME")."""

from __future__ import annotations

import json
import os

import pytest

from nostall.errors import ArgumentError
from nostall.memory import SharedPool

from cache_support import switches

# A worker process: cache_support.switches, printed.
_WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
from cache_support import switches
store, device, tier, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
for row in switches(store, *names, device=device, tier=tier):
    print(json.dumps(row))
"""


def worker(fork_python, store, *names, device="cpu", tier="shared:t"):
    """Run a worker process (forked by the conftest's ``fork_python``, in this process's
    environment); its switches' tiers and images, in order."""
    code = _WORKER.format(tests=os.path.join(os.path.dirname(__file__)))
    p = fork_python(code, str(store), device, tier, *names, stderr=True)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("[")]


@pytest.mark.slow
def test_what_one_worker_read_is_a_memory_hit_for_the_next(
    store, tmp_path, monkeypatch, fork_python
):
    monkeypatch.setenv("NOSTALL_SHM_DIR", str(tmp_path))
    # Marked kept first, as an operator keeps one across worker restarts, so the next worker
    # finds what this one read (the worker resizes it).
    SharedPool("t", 2 << 20, root=tmp_path, keep=True).close()
    first = switches(store, "flux")  # this process is the first worker
    assert all(t == "disk" for _, tiers, _ in first for t in tiers.values())
    # A new process: every component is in the host's tier already.
    second = worker(fork_python, store, "flux")
    assert all(t == "host" for _, tiers, _ in second for t in tiers.values()), second
    images = {name: digest for name, _, digest in first}
    assert {name: digest for name, _, digest in second} == images
    assert [s.name for s in SharedPool.segments(root=tmp_path)] == ["t"]  # kept


def test_a_tier_nobody_keeps_goes_with_its_last_worker(store, tmp_path, monkeypatch):
    monkeypatch.setenv("NOSTALL_SHM_DIR", str(tmp_path))
    first = switches(store, "flux")  # closing its cache, its last worker, removes the tier
    assert all(t == "disk" for _, tiers, _ in first for t in tiers.values())
    assert os.listdir(tmp_path) == []  # no segment left in RAM


def test_a_host_tier_name_is_checked(store):
    import nostall

    with pytest.raises(ArgumentError, match="'shared:NAME'"):
        nostall.ModelCache(store, device="cpu", host_tier="shared:")
    with pytest.raises(ArgumentError, match="host_tier='global'"):
        nostall.ModelCache(store, device="cpu", host_tier="global")
