"""The pieces of the generated tables: provenance lines that flag a record, target tables."""

from __future__ import annotations

from benchdocs.index import build_index
from benchdocs.markdown import Doc, provenance, targets_table

BASE = {"date": "2026-12-01T15:00:00+00:00", "hardware": {"gpu": "NVIDIA H200", "cpus": 16}}


def test_a_record_from_a_changed_tree_is_flagged():
    runs = {
        "clean.json": {**BASE, "commit": "abc1234", "dirty": False},
        "dirty.json": {**BASE, "commit": "abc1234", "dirty": True, "changed_files": [" M a.py"]},
        "legacy.json": {**BASE, "commit": "abc1234-dirty"},
    }
    doc = Doc(runs)
    assert "differed" not in provenance(doc, "clean.json")
    assert "**The tree differed from `abc1234` (1 changed file).**" in provenance(doc, "dirty.json")
    assert "**Commit not recorded" in provenance(doc, "legacy.json")


def _target(value, threshold, op, met):
    return {"value": value, "threshold": threshold, "op": op, "met": met}


def test_targets_show_each_run_and_the_latest_measured_figure():
    runs = {
        "s-aaaaaaa-2026-12-01.json": {**BASE, "commit": "aaaaaaa", "targets": {
            "x_s": _target(0.61, 0.68, "<=", True),
            "y": _target(None, 1.0, ">=", None),
        }},
        "s-bbbbbbb-2026-12-02.json": {**BASE, "commit": "bbbbbbb",
                                      "date": "2026-12-02T15:00:00+00:00", "targets": {
            "x_s": _target(None, 0.68, "<=", None),
        }},
    }  # fmt: skip
    doc = Doc(runs, build_index(runs))
    assert targets_table(doc, "s", list(runs)).splitlines() == [
        "| target | threshold | `aaaaaaa` 2026-12-01 | `bbbbbbb` 2026-12-02 | latest measured "
        "| measured in |",
        "| --- | --- | --- | --- | --- | --- |",
        "| `x_s` | <= 0.68 | 0.61 (met) | — (not run) | 0.61 (met) "
        "| [`aaaaaaa` 2026-12-01](bench/runs/s-aaaaaaa-2026-12-01.json) |",
        "| `y` | >= 1 | — (not run) | — | not measured yet | — |",
    ]


def test_a_threshold_moved_since_the_figure_is_held_to_both():
    runs = {
        "s-aaaaaaa-2026-12-01.json": {**BASE, "commit": "aaaaaaa",
                                      "targets": {"r": _target(8.6, 10.0, ">=", False)}},
        "s-bbbbbbb-2026-12-02.json": {**BASE, "commit": "bbbbbbb",
                                      "date": "2026-12-02T15:00:00+00:00",
                                      "targets": {"r": _target(None, 7.5, ">=", None)}},
    }  # fmt: skip
    table = targets_table(Doc(runs, build_index(runs)), "s")
    assert "| `r` | >= 7.5 | 8.6 (met; its run held it to >= 10: **missed**) |" in table


def test_older_records_list_their_targets_without_thresholds():
    runs = {
        "d-ccccccc-2026-12-01.json": {**BASE, "commit": "ccccccc", "targets": [
            {"target": "ratio (supplementary)", "measured": 1.008, "met": None,
             "detail": "1.008x decode-only"},
        ]},
    }  # fmt: skip
    table = targets_table(Doc(runs, build_index(runs)), "d", list(runs))
    assert table.splitlines()[0] == (
        "| target | `ccccccc` 2026-12-01 | latest measured | measured in |"
    )
    assert (
        "| ratio (supplementary) | 1.008x decode-only (no threshold) | 1.008 (no threshold) |"
        in (table)
    )
