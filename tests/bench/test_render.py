"""The benchmark tables of README.md and docs/BENCHMARKS.md are what the records render to."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from nostall.bench import render
from nostall.bench.markdown import Doc
from nostall.errors import ArgumentError

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "bench"


def test_committed_tables_are_what_the_records_render():
    diff = render.check(ROOT)
    assert not diff, "run scripts/render-benchmarks; the committed tables differ:\n" + "".join(
        diff[:80]
    )


@pytest.fixture
def repo_copy(tmp_path):
    """The two documents and the records, in a scratch repository."""
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(ROOT / "docs" / "BENCHMARKS.md", tmp_path / "docs" / "BENCHMARKS.md")
    shutil.copytree(BENCH, tmp_path / "docs" / "bench", ignore=shutil.ignore_patterns("*.png"))
    for path in (tmp_path / "docs" / "bench").rglob("*.json"):
        path.chmod(0o644)  # records copied from the device may be read-only
    return tmp_path


def test_a_changed_record_fails_the_check_and_rendering_fixes_it(repo_copy):
    path = repo_copy / "docs" / "bench" / "load.json"
    report = json.loads(path.read_text())
    ring = next(r for r in report["records"] if r["method"] == "nostall (staging ring)")
    ring["seconds"] = 9.876
    path.write_text(json.dumps(report))
    diff = "".join(render.check(repo_copy))
    assert "-| nostall, staging ring (no pool) | 0.643 s" in diff
    assert "+| nostall, staging ring (no pool) | 9.876 s" in diff
    assert render.main(["--root", str(repo_copy)]) == 0
    assert render.check(repo_copy) == []
    assert (
        "| nostall, staging ring (no pool) | 9.876 s"
        in (repo_copy / "docs/BENCHMARKS.md").read_text()
    )


def test_check_exits_non_zero_and_prints_the_diff(repo_copy, capsys):
    bench = repo_copy / "docs" / "BENCHMARKS.md"
    bench.write_text(
        bench.read_text().replace("| nostall, into the pool |", "| nostall, edited by hand |")
    )
    assert render.main(["--check", "--root", str(repo_copy)]) == 1
    out = capsys.readouterr()
    assert "+| nostall, into the pool |" in out.out and "render-benchmarks" in out.err


def test_every_figure_table_in_the_docs_is_rendered():
    # A markdown table with a digit in its body, outside every generated block, would be a
    # number that no record backs.
    for name in render.DOCUMENTS:
        text = re.sub(r"<!-- bench:.*?<!-- /bench -->", "", (ROOT / name).read_text(), flags=re.S)
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        rows = [line for line in text.splitlines() if line.startswith("|")]
        bodies = [r for r in rows if not re.fullmatch(r"\|( --- \|)+", r)]
        with_numbers = [r for r in bodies[1:] if re.search(r"\d", r)]
        assert not with_numbers, f"{name}: tables not rendered from a record: {with_numbers}"


def test_unknown_and_unclosed_blocks_are_refused():
    doc = Doc({}, "bench/")
    with pytest.raises(ArgumentError, match=r"unknown block.*bench:nope"):
        render.render_text("<!-- bench:nope -->\n<!-- /bench -->", doc, {})
    with pytest.raises(ArgumentError, match="close each"):
        render.render_text("<!-- bench:x -->\nno end", doc, {"x": lambda d: ""})


def test_a_missing_record_names_the_file():
    with pytest.raises(ArgumentError, match=r"no record docs/bench/history/gone\.json"):
        Doc({}, "bench/").rec("history/gone.json")


@pytest.mark.parametrize(
    "record",
    sorted([*BENCH.glob("*.json"), *BENCH.glob("history/*.json")]),
    ids=lambda p: p.relative_to(BENCH).as_posix(),
)
def test_every_record_names_a_plain_commit_hash(record):
    commit = json.loads(record.read_text()).get("commit")
    assert isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{7,64}", commit), commit


@pytest.mark.parametrize("name", sorted(render.DOCUMENTS))
def test_every_local_link_in_the_docs_resolves(name):
    doc = ROOT / name
    broken = [
        target
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", doc.read_text())
        if not target.startswith(("http://", "https://")) and not (doc.parent / target).exists()
    ]
    assert not broken, f"{name} links to files that are not there: {broken}"
