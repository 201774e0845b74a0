"""The benchmark blocks of README.md and docs/*.md are what the runs and the index render to."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from benchdocs import BenchDocsError, commands, render
from benchdocs.index import INDEX, without_head
from benchdocs.markdown import Doc
from benchdocs.runs import RUNS, load_runs

ROOT = Path(__file__).resolve().parents[2]
DOCS = render.documents(ROOT)


def test_committed_blocks_are_what_the_runs_render():
    diff = render.check(ROOT)
    assert not diff, "run scripts/render-benchmarks; the committed blocks differ:\n" + "".join(
        diff[:80]
    )


def test_the_committed_index_is_what_the_runs_give():
    from benchdocs.index import build_index

    committed = json.loads((ROOT / INDEX).read_text())
    assert without_head(committed) == without_head(build_index(load_runs(ROOT))), (
        "run scripts/bench-records index"
    )


@pytest.fixture
def repo_copy(tmp_path):
    """The documents, the runs and the index, in a scratch repository (no git)."""
    for name in DOCS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / RUNS, tmp_path / RUNS, ignore=shutil.ignore_patterns("*.png", "*.log"))
    shutil.copy(ROOT / INDEX, tmp_path / INDEX)
    for path in (tmp_path / RUNS).glob("*.json"):
        path.chmod(0o644)  # records copied from the device may be read-only
    return tmp_path


def test_a_new_run_is_filed_indexed_and_rendered(repo_copy, tmp_path_factory, capsys):
    # A partial switch run: it measured one target. Filing it re-indexes; rendering then
    # shows its figure, and every figure it did not measure keeps its earlier run.
    report = tmp_path_factory.mktemp("out") / "switch.json"
    t = {"value": None, "threshold": 0.68, "op": "<=", "met": None}
    report.write_text(json.dumps({
        "benchmark": "switch", "date": "2026-12-09T10:00:00+00:00", "commit": "abcdef1",
        "hardware": {"gpu": "NVIDIA H200"}, "targets": {
            "flux_memory_hit_s": t,
            "sdxl_memory_hit_s": {"value": 0.1234, "threshold": 0.16, "op": "<=", "met": True},
        },
    }))  # fmt: skip
    assert commands.render_benchmarks(["--check", "--root", str(repo_copy)]) == 0
    capsys.readouterr()
    assert commands.bench_records(["--root", str(repo_copy), "add", str(report)]) == 0
    assert "switch-abcdef1-2026-12-09.json" in capsys.readouterr().out
    # the documents are stale now: the check says so, with the diff
    assert commands.render_benchmarks(["--check", "--root", str(repo_copy)]) == 1
    out = capsys.readouterr()
    assert "+| `sdxl_memory_hit_s` | <= 0.16 |" in out.out and "render-benchmarks" in out.err
    assert commands.render_benchmarks(["--root", str(repo_copy)]) == 0
    text = (repo_copy / "docs" / "BENCHMARKS.md").read_text()
    row = next(r for r in text.splitlines() if r.startswith("| `sdxl_memory_hit_s` | <= 0.16 |"))
    assert "0.1234 (met) | [`abcdef1` 2026-12-09](bench/runs/switch-abcdef1-2026-12-09.json)" in row
    row = next(r for r in text.splitlines() if r.startswith("| `flux_memory_hit_s` |"))
    assert "0.6262 (met) | [`e4f0342` 2026-11-30]" in row  # not hidden by the partial run
    assert render.check(repo_copy) == []


def test_a_hand_edit_inside_a_block_fails_the_check(repo_copy, capsys):
    bench = repo_copy / "docs" / "BENCHMARKS.md"
    bench.write_text(
        bench.read_text().replace("| nostall, into the pool |", "| nostall, edited by hand |")
    )
    assert commands.render_benchmarks(["--check", "--root", str(repo_copy)]) == 1
    assert "+| nostall, into the pool |" in capsys.readouterr().out


def test_a_stale_index_is_refused(repo_copy):
    (repo_copy / RUNS / "gpu-check-a0193a0-2026-12-02.json").unlink()
    with pytest.raises(BenchDocsError, match=r"stale.*gpu-check-a0193a0.*bench-records index"):
        render.check(repo_copy)


def test_every_figure_table_in_the_docs_is_rendered():
    # A markdown table with a digit in its body, outside every generated block, would be a
    # number that no record backs.
    for name in DOCS:
        text = re.sub(r"<!-- bench:.*?<!-- /bench -->", "", (ROOT / name).read_text(), flags=re.S)
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        rows = [line for line in text.splitlines() if line.startswith("|")]
        bodies = [r for r in rows if not re.fullmatch(r"\|( --- \|)+", r)]
        with_numbers = [r for r in bodies[1:] if re.search(r"\d", r)]
        assert not with_numbers, f"{name}: tables not rendered from a record: {with_numbers}"


def test_unknown_and_unclosed_blocks_are_refused():
    doc = Doc({}, path="docs/x.md")
    with pytest.raises(BenchDocsError, match=r"docs/x\.md: unknown block.*bench:nope"):
        render.render_text("<!-- bench:nope -->\n<!-- /bench -->", doc, {})
    with pytest.raises(BenchDocsError, match="close each"):
        render.render_text("<!-- bench:x -->\nno end", doc, {"x": lambda d: ""})


def test_a_missing_run_names_the_file():
    with pytest.raises(BenchDocsError, match=r"no run docs/bench/runs/gone\.json"):
        Doc({}).rec("gone.json")


def test_links_are_relative_to_each_document():
    for path, want in (
        ("README.md", "docs/bench/runs/a.json"),
        ("docs/video.md", "bench/runs/a.json"),
    ):
        assert Doc({"a.json": {}}, path=path).link("a.json") == f"[`a.json`]({want})"


@pytest.mark.parametrize("name", DOCS)
def test_every_local_link_in_the_docs_resolves(name):
    doc = ROOT / name
    broken = [
        target
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", doc.read_text())
        if not target.startswith(("http://", "https://", "mailto:"))
        and not (doc.parent / target).exists()
    ]
    assert not broken, f"{name} links to files that are not there: {broken}"
