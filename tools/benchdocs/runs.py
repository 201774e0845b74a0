"""Where the benchmark records live: one immutable file per run under ``docs/bench/runs/``.

A run is filed as ``<bench>-<commit>-<day>.json``: the bench (``switch``, ``gpu-check``,
…), the commit the record names, and the record's own date as ``YYYY-MM-DD`` (UTC). A
second run of one bench at one commit on one day is ``…-2.json``, a third ``…-3.json``.
A filed run is never rewritten: a later run is a new file, so a partial run cannot
overwrite a complete one (the index, :mod:`benchdocs.index`, says which run measured
each figure last).

Example::

    >>> name = run_name({"benchmark": "switch", "commit": "e4f0342",
    ...                  "date": "2026-11-30T17:53:34+00:00"})
    >>> name.file
    'switch-e4f0342-2026-11-30.json'
    >>> parse_name("gpu-check-a0193a0-2026-12-02-2.json")
    RunName(bench='gpu-check', commit='a0193a0', day='2026-12-02', n=2)
    >>> parse_name("gpu-check.json") is None
    True
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchdocs import BenchDocsError

__all__ = [
    "RUNS",
    "RunName",
    "file_run",
    "load_runs",
    "parse_name",
    "record_targets",
    "run_date",
    "run_name",
]

RUNS = "docs/bench/runs"  # from the repository root
_HASH = re.compile(r"[0-9a-f]{7,64}")
_BENCH = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_NAME = re.compile(
    r"(?P<bench>[a-z0-9]+(?:-[a-z0-9]+)*?)-(?P<commit>[0-9a-f]{7,64})"
    r"-(?P<day>\d{4}-\d{2}-\d{2})(?:-(?P<n>[2-9]|[1-9][0-9]+))?\.json"
)


@dataclass(frozen=True)
class RunName:
    """The parts of a run's file name; ``n`` is 1 for the first run of that bench, commit
    and day, 2 for the second."""

    bench: str
    commit: str
    day: str
    n: int = 1

    @property
    def file(self) -> str:
        suffix = "" if self.n == 1 else f"-{self.n}"
        return f"{self.bench}-{self.commit}-{self.day}{suffix}.json"


def parse_name(name: str) -> RunName | None:
    """The parts of a run file's name, or ``None`` if it is not one."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    return RunName(m["bench"], m["commit"], m["day"], int(m["n"] or 1))


def run_date(record: dict[str, Any]) -> dt.datetime:
    """The record's ``date`` as an aware UTC time (a date without a zone is taken as UTC)."""
    try:
        d = dt.datetime.fromisoformat(record["date"])
    except (KeyError, TypeError, ValueError) as e:
        raise BenchDocsError(
            f"the record's date is {record.get('date')!r}: a run needs an ISO date "
            "(what every bench's header writes)"
        ) from e
    return (d if d.tzinfo else d.replace(tzinfo=dt.timezone.utc)).astimezone(dt.timezone.utc)


def run_name(record: dict[str, Any], bench: str | None = None) -> RunName:
    """The name a record is filed under (the first of its day; :func:`file_run` numbers
    the others). ``bench`` names it when the record does not (older gpu-check records);
    it must agree with the record's ``benchmark`` where both are given."""
    named = record.get("benchmark")
    if bench and named and bench != named:
        raise BenchDocsError(f"the record says benchmark {named!r}, not {bench!r}; drop --bench")
    bench = bench or named
    if not isinstance(bench, str) or not _BENCH.fullmatch(bench):
        raise BenchDocsError(
            f"the record names no benchmark (benchmark: {named!r}); pass --bench NAME "
            "(lower case words joined by '-', e.g. gpu-check)"
        )
    commit = record.get("commit")
    if not isinstance(commit, str) or not _HASH.fullmatch(commit):
        raise BenchDocsError(
            f"the record's commit is {commit!r}, not a commit hash; a run is filed under the "
            "commit it measured (bench records take it from $NOSTALL_COMMIT or .commit)"
        )
    return RunName(bench, commit, run_date(record).date().isoformat())


def _read(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BenchDocsError(f"{path}: not a readable JSON record ({e}); fix or restore it") from e
    if not isinstance(record, dict):
        raise BenchDocsError(f"{path}: a record is a JSON object, this is {type(record).__name__}")
    return record


def load_runs(root: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Every run under ``root``'s ``docs/bench/runs/``: ``{file name: record}``, oldest first
    (by the record's date, then its number of the day).

    A JSON file there whose name is not a run's is refused: file it with
    ``scripts/bench-records add``.
    """
    folder = Path(root) / RUNS
    found = []
    for path in folder.glob("*.json"):
        name = parse_name(path.name)
        if name is None:
            raise BenchDocsError(
                f"{path}: not a run's name (<bench>-<commit>-<YYYY-MM-DD>[-N].json); file "
                "it with scripts/bench-records add"
            )
        record = _read(path)
        found.append((run_date(record), name.n, path.name, record))
    found.sort(key=lambda x: x[:3])
    return {name: record for _, _, name, record in found}


def file_run(
    path: str | os.PathLike[str], root: str | os.PathLike[str], *, bench: str | None = None
) -> tuple[Path, bool]:
    """Copy the report at ``path`` into ``root``'s runs under its name; ``(where, new)``.

    The copy is byte for byte, written under a temporary name and renamed into place.
    A report already filed (the same JSON under one of its day's names) is not filed
    again: ``new`` is then ``False``.
    """
    src = Path(path)
    record = _read(src)
    name = run_name(record, bench)
    folder = Path(root) / RUNS
    folder.mkdir(parents=True, exist_ok=True)
    while (folder / name.file).exists():
        if _read(folder / name.file) == record:
            return folder / name.file, False
        name = replace(name, n=name.n + 1)
    dest = folder / name.file
    tmp = folder / f".{name.file}.partial"
    shutil.copyfile(src, tmp)  # a reader never sees half a record
    tmp.chmod(0o644)  # reports fetched from the device may be read-only
    try:
        os.link(tmp, dest)  # fails if another filing took the name meanwhile
    except FileExistsError:
        tmp.unlink()
        return file_run(path, root, bench=bench)
    except OSError:  # a file system without hard links: the name was free a moment ago
        os.replace(tmp, dest)
        return dest, True
    tmp.unlink()
    return dest, True


def record_targets(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A record's targets as ``{name: {value, threshold, op, met[, detail]}}``; older
    records listed them as ``{target, measured, met, detail}`` (no threshold of their own)."""
    t = record.get("targets") or {}
    if isinstance(t, dict):
        return t
    return {
        x["target"]: {
            "value": x.get("measured"),
            "threshold": None,
            "op": None,
            "met": x.get("met"),
            **({"detail": x["detail"]} if x.get("detail") else {}),
        }
        for x in t
    }
