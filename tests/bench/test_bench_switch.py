from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")


def _children_in_this_process(monkeypatch):
    """The bench's "new process" runs its child's code in this process instead (a fresh
    interpreter importing torch and diffusers is most of a tiny part's time)."""
    import contextlib
    import io
    import types
    import weakref

    from nostall.bench import switch as switch_bench
    from nostall.store import catalog as store_mod

    def child(self, name, cache_dir=None):
        args = types.SimpleNamespace(store=self.folder, name=name, device="cpu", size=self.size,
                                     cache_dir=cache_dir or self.digests)  # fmt: skip
        buf = io.StringIO()
        # a new process starts with no store: forget the ones this process shares
        monkeypatch.setattr(store_mod, "_SHARED", weakref.WeakValueDictionary())
        with contextlib.redirect_stdout(buf):
            switch_bench._child(args)
        return json.loads(buf.getvalue().strip().splitlines()[-1])

    monkeypatch.setattr(switch_bench._Bench, "child", child)


@pytest.mark.slow
def test_switch_bench_runs_end_to_end_on_tiny_pipelines(tmp_path):
    from nostall.bench.switch import run_switch_bench

    saved = []
    report = run_switch_bench(
        folder=str(tmp_path / "store"),
        size="tiny",
        device="cpu",
        parts=("nostall", "same-arch", "prefetch", "peers"),
        log=lambda s: None,
        save=lambda r: saved.append(json.dumps(r)),
    )
    assert len(saved) == 4  # written after every part
    for part in ("nostall", "same-arch", "prefetch", "peers"):
        assert "error" not in report[part], report[part]
    passes = report["nostall"]["passes"]
    assert [s["pipeline"] for s in passes[1]["steps"]] == ["flux", "sdxl", "flux", "sdxl", "flux"]
    # The second pass switches from the host tier or the device, never from disk.
    tiers = {c["tier"] for s in passes[1]["steps"] for c in s["switch"]["components"]}
    assert "disk" not in tiers
    shared = report["nostall"]["shared_flux_b_after_flux"]["switch"]
    moved = [c["role"] for c in shared["components"] if c["tier"] not in ("gpu", "device")]
    assert moved == ["transformer"]
    assert any(r["transformer_in_place"] for r in report["same-arch"]["runs"])
    peers = report["peers"]
    assert {"diffusers_from_pretrained_to", "cpu_resident_to", "nostall_load_model"} <= set(peers)
    targets = report["targets"]
    assert set(targets["flux_memory_hit_s"]) == {"value", "threshold", "op", "met"}
    assert targets["cold_vs_disk_sequential_read"]["met"] is None  # not run: not claimed
    assert targets["shared_components_flux_b_moves_only_transformer"]["met"] is True


@pytest.mark.slow
def test_cold_part_drops_the_cache_announced_and_compares_with_the_disk(tmp_path, monkeypatch):
    from nostall.bench import load as load_bench
    from nostall.bench.switch import run_switch_bench

    drops, lines = [], []
    monkeypatch.setattr(load_bench, "drop_caches", lambda: drops.append(1))
    _children_in_this_process(monkeypatch)
    monkeypatch.setattr(
        load_bench, "disk_limit", lambda path, *, direct, drop: drop("dd") or (2.0, 1.5)
    )
    report = run_switch_bench(
        folder=str(tmp_path / "store"),
        size="tiny",
        device="cpu",
        parts=("cold",),
        log=lines.append,
        drop_caches=True,
    )
    cold = report["cold"]
    assert "error" not in cold, cold
    assert len(drops) == 2 and sum("dropping the OS page cache" in line for line in lines) == 2
    assert cold["disk"]["gbps"] == 1.5
    assert report["targets"]["cold_vs_disk_sequential_read"]["value"] == cold["gbps"] / 1.5


@pytest.mark.slow
def test_identity_memory_hit_and_diffusers_parts(tmp_path, monkeypatch):
    from nostall.bench import load as load_bench
    from nostall.bench.switch import run_switch_bench

    drops = []
    monkeypatch.setattr(load_bench, "drop_caches", lambda: drops.append(1))
    _children_in_this_process(monkeypatch)
    report = run_switch_bench(
        folder=str(tmp_path / "store"),
        size="tiny",
        device="cpu",
        parts=("identity", "memory-hit", "diffusers", "new-process"),
        log=lambda s: None,
        drop_caches=True,
    )
    for part in ("identity", "memory-hit", "diffusers", "new-process"):
        assert "error" not in report[part], report[part]
    ident = report["identity"]
    # fresh processes: the one with an empty index hashed, the next one did not
    assert [r["hashing"] for r in ident["cold"]] == [True, False] and len(drops) == 2
    assert [r["hashing"] for r in ident["page_cache"]] == [True, False]
    assert "cold_overhead" in ident and "page_cache_overhead" in ident
    hits = report["memory-hit"]
    for label in ("bf16", "fp8"):
        tiers = {c["tier"] for c in hits[label]["switch"]["components"]}
        assert tiers == {"host"}, (label, tiers)
    assert hits["fp8"]["switch"]["moved_bytes"] < hits["bf16"]["switch"]["moved_bytes"]
    # memory-hit filled the bench's digest index: the new process hashed nothing
    assert not any(c["hashed"] for c in report["new-process"]["switch"]["components"])
    t = report["targets"]
    for name in (
        "hash_overhead",
        "flux_memory_hit_speedup_vs_diffusers_from_pretrained",
        "fp8_flux_memory_hit_speedup_vs_diffusers_from_pretrained",
        "page_cache_flux_new_process_s",
    ):
        assert t[name]["value"] is not None, name
