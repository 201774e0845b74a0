"""A record names a real commit, and says separately whether the tree differed from it."""

from __future__ import annotations

import json
import subprocess

import pytest

from nostall.bench import record
from nostall.errors import ArgumentError


def _git(repo, *args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with two commits; ``NOSTALL_COMMIT`` unset."""
    monkeypatch.delenv(record.COMMIT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "src/a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    (tmp_path / "src" / "a.py").write_text("x = 2\n")
    _git(tmp_path, "commit", "-q", "-am", "two")
    return tmp_path


def test_a_clean_checkout_records_its_head(repo):
    p = record.provenance(repo)
    assert p.commit == _git(repo, "rev-parse", "--short", "HEAD")
    assert (p.dirty, p.changed_files, p.source) == (False, (), "git")


def test_changes_are_recorded_beside_the_commit_never_in_it(repo):
    (repo / "src" / "a.py").write_text("x = 3\n")
    (repo / "src" / "new.py").write_text("")  # an untracked module changes what runs
    (repo / "out.json").write_text("{}")  # an untracked output elsewhere does not
    p = record.provenance(repo)
    assert p.commit == _git(repo, "rev-parse", "--short", "HEAD")
    assert "dirty" not in p.commit
    assert p.dirty is True
    assert p.changed_files == (" M src/a.py", "?? src/new.py")


def test_the_commit_given_by_the_launching_machine_wins_over_a_stale_git(repo, monkeypatch):
    # The GPU machine's copy of .git is stale: it knows neither the commit nor the changes.
    monkeypatch.setenv(record.COMMIT_ENV, "0123abc\n M src/nostall/api.py\n")
    p = record.provenance(repo)
    assert (p.commit, p.dirty, p.source) == ("0123abc", True, "NOSTALL_COMMIT")
    assert p.changed_files == (" M src/nostall/api.py",)


def test_a_commit_file_is_read_and_a_dirty_suffix_is_split_off(repo):
    (repo / ".commit").write_text("0123abc-dirty\n")
    p = record.provenance(repo)
    assert (p.commit, p.dirty, p.source) == ("0123abc", True, ".commit")
    (repo / ".commit").write_text("0123abc\n")
    assert record.provenance(repo).dirty is None  # a bare hash says nothing about the tree


def test_a_commit_file_naming_head_takes_the_tree_state_from_git(repo):
    (repo / ".commit").write_text(_git(repo, "rev-parse", "HEAD") + "\n")
    (repo / "src" / "a.py").write_text("x = 4\n")
    p = record.provenance(repo)
    assert (p.dirty, p.changed_files, p.source) == (True, (" M src/a.py",), ".commit")


def test_a_leftover_commit_file_naming_an_ancestor_is_ignored(repo):
    (repo / ".commit").write_text(_git(repo, "rev-parse", "--short", "HEAD~1") + "\n")
    p = record.provenance(repo)
    assert (p.commit, p.source) == (_git(repo, "rev-parse", "--short", "HEAD"), "git")


def test_a_value_that_is_not_a_hash_is_skipped(repo, monkeypatch):
    monkeypatch.setenv(record.COMMIT_ENV, "unknown")  # what scripts/gpu-check sets without .commit
    assert record.provenance(repo).source == "git"


def test_outside_a_checkout_nothing_is_invented(tmp_path, monkeypatch):
    monkeypatch.delenv(record.COMMIT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    p = record.provenance(tmp_path)
    assert (p.commit, p.dirty) == (None, None)


def test_header_carries_the_provenance_and_the_machine(repo):
    h = record.header("load")
    assert h["benchmark"] == "load" and h["date"].endswith("+00:00")
    assert {"commit", "dirty", "changed_files", "commit_source"} <= h.keys()
    assert h["hardware"]["python"] and "gpu" not in h["hardware"]
    json.dumps(h)


def test_reports_are_not_written_over_unless_asked(tmp_path):
    path = str(tmp_path / "switch.json")
    record.check_new_output(path, overwrite=False)
    record.write_report({"run": 1}, path, overwrite=False)
    with pytest.raises(ArgumentError, match="already exists"):
        record.check_new_output(path, overwrite=False)
    with pytest.raises(ArgumentError, match="appeared while the benchmark ran"):
        record.write_report({"run": 2}, path, overwrite=False)
    assert json.loads((tmp_path / "switch.json").read_text()) == {"run": 1}
    record.write_report({"run": 3}, path)
    assert json.loads((tmp_path / "switch.json").read_text()) == {"run": 3}
