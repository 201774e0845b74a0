"""Filing a report as a run: its name, a second run of the day, a report filed twice, and
records that cannot be filed."""

from __future__ import annotations

import json

import pytest
from benchdocs import BenchDocsError
from benchdocs.runs import RUNS, file_run, load_runs, parse_name

REPORT = {"benchmark": "gpu-check", "commit": "a0193a0", "date": "2026-12-02T23:40:14-02:00"}


def _write(path, record):
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def test_a_report_is_filed_byte_for_byte_under_its_utc_day(tmp_path):
    src = _write(tmp_path / "gpu-check.json", REPORT)
    src.chmod(0o444)  # as fetched from the device
    where, new = file_run(src, tmp_path)
    assert new and where == tmp_path / RUNS / "gpu-check-a0193a0-2026-12-03.json"  # UTC day
    assert where.read_bytes() == src.read_bytes()
    assert [p.name for p in where.parent.iterdir()] == [where.name]  # no temporary left


def test_a_second_run_of_the_day_gets_a_suffix_and_a_report_filed_twice_is_filed_once(tmp_path):
    first = _write(tmp_path / "a.json", REPORT)
    second = _write(tmp_path / "b.json", {**REPORT, "date": "2026-12-03T08:00:00+00:00"})
    file_run(first, tmp_path)
    where, new = file_run(second, tmp_path)
    assert new and where.name == "gpu-check-a0193a0-2026-12-03-2.json"
    assert file_run(first, tmp_path) == (
        tmp_path / RUNS / "gpu-check-a0193a0-2026-12-03.json",
        False,
    )
    assert list(load_runs(tmp_path)) == [
        "gpu-check-a0193a0-2026-12-03.json",
        "gpu-check-a0193a0-2026-12-03-2.json",
    ]
    assert parse_name(where.name).n == 2


def test_a_record_naming_no_bench_takes_one_and_never_a_contradicting_one(tmp_path):
    old = _write(tmp_path / "old.json", {k: v for k, v in REPORT.items() if k != "benchmark"})
    with pytest.raises(BenchDocsError, match="pass --bench NAME"):
        file_run(old, tmp_path)
    assert file_run(old, tmp_path, bench="gpu-check")[0].name.startswith("gpu-check-a0193a0-")
    with pytest.raises(BenchDocsError, match="not 'switch'"):
        file_run(_write(tmp_path / "r.json", REPORT), tmp_path, bench="switch")


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({**REPORT, "commit": "a0193a0-dirty"}, "not a commit hash"),
        ({**REPORT, "commit": None}, "not a commit hash"),
        ({**REPORT, "date": "yesterday"}, "ISO date"),
    ],
)
def test_a_record_without_a_real_commit_or_date_is_not_filed(tmp_path, record, match):
    with pytest.raises(BenchDocsError, match=match):
        file_run(_write(tmp_path / "r.json", record), tmp_path)
    assert not (tmp_path / RUNS).exists() or not list((tmp_path / RUNS).iterdir())


def test_a_stray_file_among_the_runs_is_refused(tmp_path):
    (tmp_path / RUNS).mkdir(parents=True)
    _write(tmp_path / RUNS / "switch.json", REPORT)
    with pytest.raises(BenchDocsError, match="not a run's name"):
        load_runs(tmp_path)


def test_every_committed_run_is_named_after_its_own_record():
    from pathlib import Path

    from benchdocs.runs import run_name

    root = Path(__file__).resolve().parents[2]
    wrong = []
    for name, record in load_runs(root).items():
        parsed = parse_name(name)
        want = run_name(record, None if record.get("benchmark") else parsed.bench)
        if (want.bench, want.commit, want.day) != (parsed.bench, parsed.commit, parsed.day):
            wrong.append(f"{name}: its record says {want.file}")
    assert not wrong
