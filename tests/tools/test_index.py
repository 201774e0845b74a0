"""The index: the latest measured figure of each target and headline, never hidden by a
later partial run, and whether src/ changed since the run that measured it."""

from __future__ import annotations

import doctest
import importlib
import json
import subprocess

import pytest
from benchdocs.index import INDEX, build_index, git_src_changed, write_index
from benchdocs.runs import RUNS


def _t(value, threshold=1.0, op="<=", met=None):
    met = met if met is not None or value is None else value <= threshold
    return {"value": value, "threshold": threshold, "op": op, "met": met}


def _run(commit, day, **extra):
    return {"benchmark": "switch", "commit": commit, "date": f"{day}T12:00:00+00:00", **extra}


def test_a_partial_run_never_hides_an_earlier_measurement():
    runs = {
        "switch-aaaaaaa-2026-12-01.json": _run("aaaaaaa", "2026-12-01",
                                               targets={"x": _t(0.5), "y": _t(2.0)}),
        "switch-bbbbbbb-2026-12-02.json": _run("bbbbbbb", "2026-12-02",
                                               targets={"x": _t(None), "y": _t(0.9)}),
    }  # fmt: skip
    i = build_index(runs, src_changed=lambda c: c == "aaaaaaa")
    x, y = (i["benches"]["switch"]["targets"][k] for k in ("x", "y"))
    assert (x["value"], x["met"], x["run"], x["src_changed"]) == (
        0.5,
        True,
        "switch-aaaaaaa-2026-12-01.json",
        True,
    )
    assert (y["value"], y["met"], y["commit"], y["src_changed"]) == (0.9, True, "bbbbbbb", False)
    assert i["benches"]["switch"]["latest_run"]["run"] == "switch-bbbbbbb-2026-12-02.json"
    assert i["runs"] == sorted(runs)


def test_a_headline_comes_from_the_latest_run_that_measured_both_sides():
    peers = {"diffusers_from_pretrained_to": [{"pipeline": "flux", "switch_s": 5.0}]}
    whole = {"flux_whole_from_host": {"switch": {"total_s": 0.5}}}
    runs = {
        "switch-aaaaaaa-2026-12-01.json": _run("aaaaaaa", "2026-12-01", nostall=whole, peers=peers),
        "switch-bbbbbbb-2026-12-02.json": _run("bbbbbbb", "2026-12-02", nostall=whole),  # no peer
    }
    h = build_index(runs)["headlines"]["switch"]
    assert (h["nostall"], h["peer"], h["ratio"], h["commit"]) == (0.5, 5.0, 10.0, "aaaaaaa")
    assert "load-cold" not in build_index(runs)["headlines"]  # no load run: no headline


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_src_changed_is_git_diff_of_src_between_the_commit_and_head(tmp_path):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "one")
    first = subprocess.check_output(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"])
    (tmp_path / "docs.md").write_text("only docs\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "docs")
    second = subprocess.check_output(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"])
    (tmp_path / "src" / "a.py").write_text("x = 2\n")
    _git(tmp_path, "commit", "-qam", "src")
    head, changed = git_src_changed(tmp_path)
    assert head and changed(first.decode().strip()) is True
    assert changed(second.decode().strip()) is True
    assert changed(head) is False
    assert changed("0000000") is None  # a commit this checkout does not hold

    (tmp_path / RUNS).mkdir(parents=True)
    run = _run(head, "2026-12-03", targets={"x": _t(0.5)})
    (tmp_path / RUNS / f"switch-{head}-2026-12-03.json").write_text(json.dumps(run))
    index = json.loads(write_index(tmp_path).read_text())
    assert index["commit"] == head
    assert index["benches"]["switch"]["targets"]["x"]["src_changed"] is False


def test_outside_git_src_changed_is_unknown(tmp_path):
    head, changed = git_src_changed(tmp_path)
    assert head is None and changed("abc1234") is None
    (tmp_path / RUNS).mkdir(parents=True)
    assert json.loads(write_index(tmp_path).read_text())["benches"] == {}
    assert (tmp_path / INDEX).exists()


@pytest.mark.parametrize(
    "module", ["runs", "index", "headlines", "markdown", "render"], ids=lambda m: m
)
def test_the_docstring_examples_run(module):
    # tools/ is not among pytest's doctest paths (src/nostall is): run them here.
    mod = importlib.import_module(f"benchdocs.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
