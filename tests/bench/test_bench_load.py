"""``nostall bench load``: page-cache drops are announced and recorded; reports are not overwritten."""

from __future__ import annotations

import json

import pytest

from nostall.bench import load as load_mod
from nostall.errors import ArgumentError


@pytest.mark.timeout(300)
@pytest.mark.parametrize("allowed", [True, False])
def test_every_page_cache_drop_is_announced_first_and_recorded(tmp_path, monkeypatch, allowed):
    events: list[tuple[str, str]] = []

    def fake_drop() -> str | None:
        # Never the real one: it would evict every cached file of the machine running tests.
        events.append(("drop", ""))
        return None if allowed else "cannot drop the page cache (Permission denied)"

    monkeypatch.setattr(load_mod, "drop_caches", fake_drop)
    report = load_mod.run_load_bench(
        preset="tiny",
        device="cpu",
        folder=str(tmp_path / "ckpt"),
        scenarios=("cold",),
        repeat=1,
        methods=("nostall (staging ring)",),
        log=lambda line: events.append(("log", line)),
        drop_caches=True,
    )
    drops = [i for i, (kind, _) in enumerate(events) if kind == "drop"]
    assert len(drops) == 3
    for i in drops:  # said on the console right before each drop
        kind, line = events[i - 1]
        assert kind == "log" and "dropping the OS page cache" in line and "drop_caches" in line
    recorded = report["page_cache_drops"]
    assert [d["before"] for d in recorded] == [
        "dd buffered read",
        "dd O_DIRECT read",
        "nostall (staging ring) (cold)",
    ]
    assert all(d["dropped"] is allowed for d in recorded)
    if not allowed:
        assert all("Permission denied" in d["note"] for d in recorded)
        assert any("not dropped" in line for _, line in events)
    json.dumps(report)  # the record is part of the JSON


def test_reports_are_not_written_over_unless_asked(tmp_path):
    path = tmp_path / "load.json"
    load_mod.check_new_output(str(path), overwrite=False)  # nothing there yet
    load_mod.write_report({"run": 1}, str(path), overwrite=False)
    assert json.loads(path.read_text()) == {"run": 1}
    with pytest.raises(ArgumentError, match=r"load\.json already exists.*--overwrite"):
        load_mod.check_new_output(str(path), overwrite=False)
    with pytest.raises(ArgumentError, match="appeared while the benchmark ran"):
        load_mod.write_report({"run": 2}, str(path), overwrite=False)
    assert json.loads(path.read_text()) == {"run": 1}
    assert json.loads((tmp_path / "load.json.partial").read_text()) == {"run": 2}
    load_mod.check_new_output(str(path), overwrite=True)
    load_mod.write_report({"run": 3}, str(path), overwrite=True)
    assert json.loads(path.read_text()) == {"run": 3}
