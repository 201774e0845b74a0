"""``nostall bench ...`` on the CPU at tiny sizes: reports written, outputs protected,
options checked before a benchmark starts, the page cache dropped only when asked."""

from __future__ import annotations

import json

import pytest
from cli_support import plain, runner, usage_error

from nostall.cli import app


@pytest.fixture(scope="module")
def ckpt_folder(tmp_path_factory):
    """Where ``bench load --preset tiny`` writes its checkpoint (then reuses it)."""
    return tmp_path_factory.mktemp("bench-load") / "ckpt"


def _bench_load(folder, out, *extra):
    args = ["bench", "load", "--preset", "tiny", "--device", "cpu", "--folder", str(folder)]
    return runner.invoke(app, [*args, "--out", str(out), "--repeat", "1", *extra])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_load_tiny_on_cpu_writes_json(tmp_path, ckpt_folder):
    out = tmp_path / "load.json"
    result = _bench_load(ckpt_folder, out, "--scenario", "page-cache", "--scenario", "memory-cache")
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    recs = {(r["method"], r["scenario"]): r for r in report["records"]}
    assert recs[("nostall (staging ring)", "page-cache")]["equal"] is True
    assert recs[("nostall (pool, memory-cache hit)", "memory-cache")]["equal"] is True
    assert recs[("nostall load_model (pool hit)", "memory-cache")]["equal"] is True
    assert recs[("diffusers device_map", "page-cache")]["equal"] is True
    # peers that cannot run here are reported, not dropped
    assert recs[("fastsafetensors (no GDS)", "page-cache")]["note"].startswith("skipped")
    assert report["commit"] and report["date"]
    assert "load bench (tiny" in result.output and "report written to" in result.output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_page_cache_is_dropped_only_with_drop_caches(tmp_path, ckpt_folder, monkeypatch):
    from nostall.bench import load as load_bench

    drops = []
    # Never the real one: it would evict every cached file of the machine running tests.
    monkeypatch.setattr(load_bench, "drop_caches", lambda: drops.append(1))
    cold = ["--scenario", "cold", "--method", "nostall (staging ring)"]
    result = _bench_load(ckpt_folder, tmp_path / "a.json", *cold)
    assert result.exit_code == 0, result.output
    assert drops == [] and "dropping the OS page cache" not in result.output
    (rec,) = json.loads((tmp_path / "a.json").read_text())["records"]
    assert rec["seconds"] is None and "only when asked" in rec["note"]
    result = _bench_load(ckpt_folder, tmp_path / "b.json", *cold, "--drop-caches")
    assert result.exit_code == 0, result.output
    assert len(drops) == 3 and "dropping the OS page cache" in result.output
    (rec,) = json.loads((tmp_path / "b.json").read_text())["records"]
    assert rec["seconds"] > 0


@pytest.mark.slow
def test_bench_switch_cold_part_needs_drop_caches(tmp_path, tiny_store, monkeypatch):
    from nostall.bench import load as load_bench

    drops = []
    monkeypatch.setattr(load_bench, "drop_caches", lambda: drops.append(1))
    out = tmp_path / "switch.json"
    args = ["bench", "switch", "--size", "tiny", "--device", "cpu", "--part", "cold"]
    result = runner.invoke(app, [*args, "--folder", str(tiny_store), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert drops == []
    assert "only when asked" in json.loads(out.read_text())["cold"]["skipped"]
    assert "switch bench (tiny)" in plain(result.output)


@pytest.mark.timeout(300)
def test_bench_decode_memory_only_needs_cuda(tmp_path):
    m = str(tmp_path / "m.json")
    result = runner.invoke(
        app,
        ["bench", "decode", "--size", "tiny", "--device", "cpu", "--part", "memory", "--out", m],
    )
    assert result.exit_code != 0
    assert "CUDA" in str(result.exception) or "CUDA" in result.output
    assert not (tmp_path / "m.json").exists()


def test_bench_outputs_default_outside_docs():
    from typer.main import get_command

    bench = get_command(app).commands["bench"]
    for name, options in (("load", ("out",)), ("decode", ("out", "figure"))):
        params = {p.name: p for p in bench.commands[name].params}
        for option in options:
            assert params[option].default.startswith("bench-out/"), (name, option)
        assert params["overwrite"].default is False
    for name in ("load", "switch"):
        params = {p.name: p for p in bench.commands[name].params}
        assert params["drop_caches"].default is False, name


@pytest.mark.parametrize("which", ["load", "decode"])
def test_bench_refuses_to_overwrite_a_report(tmp_path, which):
    out = tmp_path / "report.json"
    out.write_text("recorded")
    folder = tmp_path / "ckpt"
    args = ["bench", which, "--device", "cpu", "--out", str(out)]
    args += ["--preset", "tiny", "--folder", str(folder)] if which == "load" else ["--size", "tiny"]
    result = runner.invoke(app, args)
    usage_error(result, "already exists", "--overwrite")
    assert out.read_text() == "recorded"
    assert not folder.exists()  # refused before the benchmark started


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["load", "--preset", "huge"],
            "Invalid value for --preset: 'huge' is not one of flux, tiny",
        ),
        (["load", "--scenario", "warm"], "'warm' is not one of cold, page-cache, memory-cache"),
        (["load", "--repeat", "0"], "'--repeat': 0 is out of range; give at least 1"),
        (
            ["decode", "--size", "8k"],
            "Invalid value for --size: '8k' is not one of 720p, 480p, tiny",
        ),
        (["decode", "--dtype", "fp16"], "'fp16' is not one of bf16, fp32"),
        (["decode", "--preset", "warp"], "--preset: unknown x264 preset 'warp'"),
        (["decode", "--part", "nope"], "'nope' is not one of timed, memory"),
        (["fp8", "--size", "8k"], "Invalid value for --size: '8k' is not one of full, tiny"),
        (["fp8", "--part", "nope"], "'nope' is not one of loads"),
        (["switch", "--size", "8k"], "'8k' is not one of full, full-lean, full-flux, tiny"),
        (["switch", "--part", "nope"], "'nope' is not one of nostall"),
        (["serve", "--part", "nope"], "'nope' is not one of worker, fleet, embed"),
        (["serve", "--clients", "0"], "'--clients': 0 is out of range"),
    ],
)
def test_bad_bench_options_are_usage_errors_before_anything_runs(tmp_path, args, says):
    folder = tmp_path / "work"
    where = ["--folder", str(folder)] if args[0] in ("load", "switch") else []
    out = ["--out", str(tmp_path / "r.json")]
    result = runner.invoke(app, ["bench", *args, "--device", "cpu", *where, *out])
    usage_error(result, says)
    assert list(tmp_path.iterdir()) == []  # nothing written, no report


@pytest.mark.parametrize("which", ["load", "decode", "fp8", "serve", "switch"])
def test_a_report_path_that_is_a_folder_is_refused_before_the_run(tmp_path, which):
    result = runner.invoke(app, ["bench", which, "--device", "cpu", "--out", str(tmp_path)])
    usage_error(result, "is a folder, but a file is written there")
