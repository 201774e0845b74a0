"""``docs/bench/index.json``: what the runs say now, generated from ``docs/bench/runs/``.

For each bench, its latest run, and for each target the **latest measured** value (the
newest run where it is not ``null``) with that run's threshold, op and verdict, the run
file, its commit and date; a target a later partial run did not measure keeps its
earlier figure. For each headline (:mod:`benchdocs.headlines`) the same: the newest run
that measured nostall and its peer.

Every entry also says whether ``src/`` changed between its run's commit and the commit
the index was generated at (``src_changed``: ``git diff --quiet <commit> HEAD -- src/``;
``null`` where git or the commit is not available), so a reader sees which figures
predate the code. Where a target's threshold changed after its figure was measured, the
entry carries ``threshold_now`` / ``op_now`` / ``met_now`` from the newest run naming it.

The documents are rendered from the index (:mod:`benchdocs.render`), never from a
"latest" file; ``scripts/bench-records index`` regenerates it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from benchdocs import BenchDocsError
from benchdocs.headlines import HEADLINES, figures
from benchdocs.runs import load_runs, parse_name, record_targets, run_date

__all__ = [
    "INDEX",
    "build_index",
    "git_src_changed",
    "read_index",
    "without_head",
    "write_index",
]

INDEX = "docs/bench/index.json"  # from the repository root
# The fields that depend on the commit the index was generated at, not on the runs.
AT_HEAD = ("src_changed",)  # (and the top-level "commit": the HEAD it was generated at)


def _git(root: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def git_src_changed(
    root: str | os.PathLike[str],
) -> tuple[str | None, Callable[[str], bool | None]]:
    """``(HEAD, changed)``: ``changed(commit)`` is whether ``src/`` differs between
    ``commit`` and HEAD (``None``: not a git checkout, or a commit it does not hold)."""
    root = Path(root)
    head = _git(root, "rev-parse", "--short", "HEAD")
    at = head.stdout.strip() if head is not None and head.returncode == 0 else None
    seen: dict[str, bool | None] = {}

    def changed(commit: str) -> bool | None:
        if at is None:
            return None
        if commit not in seen:
            out = _git(root, "diff", "--quiet", commit, "HEAD", "--", "src/")
            seen[commit] = None if out is None or out.returncode > 1 else out.returncode == 1
        return seen[commit]

    return at, changed


def _met(value: Any, op: str | None, threshold: Any) -> bool | None:
    if value is None or op not in ("<=", ">=") or threshold is None:
        return None
    return bool(value <= threshold if op == "<=" else value >= threshold)


def _from(name: str, record: dict[str, Any], changed: Callable[[str], bool | None]) -> dict:
    return {
        "run": name,
        "commit": record["commit"],
        "date": record["date"],
        "src_changed": changed(record["commit"]),
    }


def _target(
    rows: list[tuple[str, dict, dict]], changed: Callable[[str], bool | None]
) -> dict[str, Any]:
    """One target's entry from the runs naming it (``(run, record, target)``, newest first)."""
    now = rows[0][2]
    measured = next((r for r in rows if r[2].get("value") is not None), None)
    if measured is None:
        return {
            "value": None,
            "threshold": now.get("threshold"),
            "op": now.get("op"),
            "met": None,
            "run": None,
            "commit": None,
            "date": None,
            "src_changed": None,
        }
    name, record, t = measured
    e = {
        "value": t["value"],
        "threshold": t.get("threshold"),
        "op": t.get("op"),
        "met": t.get("met"),
        **_from(name, record, changed),
    }
    if "detail" in t:
        e["detail"] = t["detail"]
    if now.get("op") is not None and (now.get("threshold"), now["op"]) != (e["threshold"], e["op"]):
        # the threshold moved after this figure was measured: held to today's as well
        e.update(threshold_now=now.get("threshold"), op_now=now["op"])
        e["met_now"] = _met(e["value"], now["op"], now.get("threshold"))
    return e


def build_index(
    runs: Mapping[str, dict[str, Any]],
    *,
    head: str | None = None,
    src_changed: Callable[[str], bool | None] = lambda commit: None,
) -> dict[str, Any]:
    """The index of ``runs`` (``{file name: record}``, any order).

    Example::

        >>> a = {"commit": "aaaaaaa", "date": "2026-12-01T10:00:00+00:00", "targets": {
        ...     "x_s": {"value": 0.6, "threshold": 0.7, "op": "<=", "met": True}}}
        >>> b = {"commit": "bbbbbbb", "date": "2026-12-02T10:00:00+00:00", "targets": {
        ...     "x_s": {"value": None, "threshold": 0.7, "op": "<=", "met": None}}}
        >>> i = build_index({"s-aaaaaaa-2026-12-01.json": a, "s-bbbbbbb-2026-12-02.json": b})
        >>> x = i["benches"]["s"]["targets"]["x_s"]
        >>> x["value"], x["run"]  # the later run did not measure it: the earlier figure stands
        (0.6, 's-aaaaaaa-2026-12-01.json')
        >>> i["benches"]["s"]["latest_run"]["run"]
        's-bbbbbbb-2026-12-02.json'
    """
    by_bench: dict[str, list[tuple[str, dict]]] = {}
    for name, record in runs.items():
        parsed = parse_name(name)
        if parsed is None:
            raise BenchDocsError(
                f"{name}: not a run's name; file it with scripts/bench-records add"
            )
        by_bench.setdefault(parsed.bench, []).append((name, record))
    benches: dict[str, Any] = {}
    for bench in sorted(by_bench):
        # newest first: by the record's date, then by its number of the day
        newest = sorted(
            by_bench[bench],
            key=lambda x: (run_date(x[1]), parse_name(x[0]).n, x[0]),  # type: ignore[union-attr]
            reverse=True,
        )
        # every target, with the runs naming it, newest first
        named: dict[str, list[tuple[str, dict, dict]]] = {}
        for name, record in newest:
            for key, t in record_targets(record).items():
                named.setdefault(key, []).append((name, record, t))
        benches_targets = {key: _target(rows, src_changed) for key, rows in named.items()}
        latest_name, latest = newest[0]
        benches[bench] = {
            "latest_run": _from(latest_name, latest, src_changed),
            "runs": len(newest),
            "targets": benches_targets,
        }
    headlines: dict[str, Any] = {}
    for h in HEADLINES:
        candidates = sorted(
            by_bench.get(h.bench, []), key=lambda x: (run_date(x[1]), x[0]), reverse=True
        )
        for name, record in candidates:
            got = figures(h, record)
            if got is not None:
                headlines[h.key] = {**got, **_from(name, record, src_changed)}
                break
    return {
        "about": "Generated by scripts/bench-records index from docs/bench/runs/; do not edit. "
        "Per target: the latest measured value and the run it came from.",
        "commit": head,  # the HEAD the index was generated at (src_changed is since when)
        "runs": sorted(runs),
        "benches": benches,
        "headlines": headlines,
    }


def write_index(root: str | os.PathLike[str]) -> Path:
    """Regenerate ``root``'s index from its runs (atomically); its path."""
    root = Path(root)
    head, changed = git_src_changed(root)
    index = build_index(load_runs(root), head=head, src_changed=changed)
    path = root / INDEX
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(index, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def without_head(index: Mapping[str, Any]) -> Any:
    """``index`` less what depends on the commit it was generated at (:data:`AT_HEAD`):
    what two indexes of the same runs share."""
    if isinstance(index, Mapping):
        top = {k: v for k, v in index.items() if k != "commit"} if "runs" in index else index
        return {k: without_head(v) for k, v in top.items() if k not in AT_HEAD}
    if isinstance(index, list):
        return [without_head(v) for v in index]
    return index


def read_index(root: str | os.PathLike[str], runs: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """``root``'s index, checked against ``runs``: an index that misses a run, or names one
    that is gone, is stale and refused (run ``scripts/bench-records index``)."""
    path = Path(root) / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BenchDocsError(
            f"{path}: cannot read the index ({e}); run scripts/bench-records index"
        ) from e
    listed = set(index.get("runs", []))
    if listed != set(runs):
        new, gone = sorted(set(runs) - listed), sorted(listed - set(runs))
        raise BenchDocsError(
            f"{path} is stale: runs not in it {new}, runs it names that are gone {gone}; run "
            "scripts/bench-records index"
        )
    return index
