"""The pieces of the generated tables: provenance lines that flag a record, target tables."""

from __future__ import annotations

from nostall.bench.markdown import Doc, provenance, targets_table

BASE = {"date": "2026-12-01T15:00:00+00:00", "hardware": {"gpu": "NVIDIA H200", "cpus": 16}}


def test_a_record_from_a_changed_tree_is_flagged():
    records = {
        "clean.json": {**BASE, "commit": "abc1234", "dirty": False},
        "dirty.json": {**BASE, "commit": "abc1234", "dirty": True, "changed_files": [" M a.py"]},
        "legacy.json": {**BASE, "commit": "abc1234-dirty"},
    }
    doc = Doc(records, "bench/")
    assert "differed" not in provenance(doc, "clean.json")
    assert "**The tree differed from `abc1234` (1 changed file).**" in provenance(doc, "dirty.json")
    assert "**Commit not recorded" in provenance(doc, "legacy.json")


def test_targets_of_two_records_share_rows_and_say_what_was_not_run():
    doc = Doc(
        {
            "a.json": {**BASE, "commit": "aaaaaaa", "targets": {
                "x_s": {"value": 0.61, "threshold": 0.68, "op": "<=", "met": True},
                "y": {"value": None, "threshold": 1.0, "op": ">=", "met": None},
            }},
            "b.json": {**BASE, "commit": "bbbbbbb", "targets": {
                "x_s": {"value": 0.71, "threshold": 0.68, "op": "<=", "met": False},
            }},
            "old.json": {**BASE, "commit": "ccccccc", "targets": [
                {"target": "ratio (supplementary)", "measured": 1.008, "met": None},
            ]},
        },
        "bench/",
    )  # fmt: skip
    assert targets_table(doc, ["a.json", "b.json"]).splitlines() == [
        "| target | threshold | `aaaaaaa` | `bbbbbbb` |",
        "| --- | --- | --- | --- |",
        "| `x_s` | <= 0.68 | 0.61 (met) | 0.71 (**missed**) |",
        "| `y` | >= 1 | — (not run) | — |",
    ]
    assert "| ratio (supplementary) | 1.008 (no threshold) |" in targets_table(doc, ["old.json"])
