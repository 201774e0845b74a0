"""Markdown pieces that the generated tables of the docs share: cells, tables, provenance
lines, target tables.

Reads records as plain dicts (JSON only). A :class:`Doc` is one document being rendered:
the runs, the index, and where the document sits, so that a link to a run works from
``README.md`` and from every page under ``docs/``.
"""

from __future__ import annotations

import datetime as dt
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchdocs import BenchDocsError
from benchdocs.runs import RUNS, record_targets

__all__ = [
    "NA",
    "Doc",
    "commit_flags",
    "day",
    "machine",
    "num",
    "provenance",
    "run_cell",
    "secs",
    "table",
    "targets_table",
    "when",
]

_HASH = re.compile(r"[0-9a-f]{7,64}")
NA = "—"


@dataclass(frozen=True)
class Doc:
    """The runs (``{file name: record}``), the index, and the document's path from the
    repository root (``README.md``, ``docs/BENCHMARKS.md``)."""

    runs: Mapping[str, dict]
    index: Mapping[str, Any] = field(default_factory=dict)
    path: str = "docs/BENCHMARKS.md"

    def rec(self, name: str) -> dict:
        """The run ``docs/bench/runs/<name>``."""
        try:
            return self.runs[name]
        except KeyError:
            raise BenchDocsError(
                f"no run {RUNS}/{name}; the docs cite it. Restore it, or point the block "
                f"at a run that exists ({', '.join(sorted(self.runs)) or 'there are none'})"
            ) from None

    def href(self, path: str) -> str:
        """``path`` (from the repository root, an ``#anchor`` kept) as seen from this document.

        >>> Doc({}, path="docs/fp8.md").href("docs/BENCHMARKS.md#fp8")
        'BENCHMARKS.md#fp8'
        >>> Doc({}, path="README.md").href("docs/bench/runs/x.json")
        'docs/bench/runs/x.json'
        """
        target, hash_, anchor = path.partition("#")
        rel = posixpath.relpath(target, posixpath.dirname(self.path) or ".")
        return rel + hash_ + anchor

    def link(self, name: str) -> str:
        """A link to the run ``name``, its file name as the text."""
        return f"[`{name}`]({self.href(f'{RUNS}/{name}')})"

    def run_at(self, commit: str, date: str, *, besides: str | None = None) -> str:
        """The run with this ``commit`` and ``date`` (a merged record names its parts so),
        other than ``besides``."""
        for name, r in self.runs.items():
            if name != besides and r.get("commit") == commit and r.get("date") == date:
                return name
        raise BenchDocsError(
            f"no run of commit {commit} dated {date} under {RUNS}; a merged record cites it. "
            "File it with scripts/bench-records add"
        )


def day(record: Mapping[str, Any]) -> str:
    """``2026-11-29`` from the record's ISO date (UTC)."""
    return when(record)[:10]


def run_cell(doc: Doc, entry: Mapping[str, Any]) -> str:
    """``[`abc1234` 2026-12-01](…/runs/…json)``: an index entry's commit and day, linked to
    its run."""
    if not entry.get("run"):
        return NA
    href = doc.href(f"{RUNS}/{entry['run']}")
    return f"[`{entry['commit']}` {day(entry)}]({href})"


def num(v: Any, digits: int = 4) -> str:
    """A measured value as a cell: ``—`` when absent, floats to ``digits`` significant digits.

    >>> num(0.626239), num(None), num(7), num(True)
    ('0.6262', '—', '7', 'yes')
    """
    if v is None:
        return NA
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    if isinstance(v, list | tuple):
        return " / ".join(num(x, digits) for x in v)
    if isinstance(v, dict):
        return "; ".join(f"{k}: {num(x, digits)}" for k, x in v.items())
    return str(v)


def secs(v: float | None, places: int = 3) -> str:
    """``0.626 s``; ``—`` when absent."""
    return NA if v is None else f"{v:.{places}f} s"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub markdown table (no trailing newline).

    >>> print(table(["a", "b"], [["1", "2"]]))
    | a | b |
    | --- | --- |
    | 1 | 2 |
    """
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for row in rows:
        if len(row) != len(header):
            raise BenchDocsError(f"a row of {len(row)} cells under {len(header)} columns: {row}")
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)


def when(record: dict) -> str:
    """``2026-11-29 12:10 UTC`` from the record's ISO date."""
    d = dt.datetime.fromisoformat(record["date"]).astimezone(dt.timezone.utc)
    return d.strftime("%Y-%m-%d %H:%M UTC")


def machine(record: dict) -> str:
    """The GPU, CPUs, RAM and torch a record names (the GPU check records fewer)."""
    hw = record.get("hardware", {})
    gpu = hw.get("gpu") or hw.get("name") or "no GPU"
    if hw.get("count", 1) > 1:
        gpu = f"{hw['count']}× {gpu}"
    parts = [gpu + (f" ({hw['gpu_mem_gib']} GiB)" if "gpu_mem_gib" in hw else "")]
    if "cpus" in hw:
        parts.append(f"{hw['cpus']} vCPU")
    if "ram_gib" in hw:
        parts.append(f"{hw['ram_gib']} GiB RAM")
    if "torch" in hw:
        parts.append(f"torch {hw['torch']}")
    return ", ".join(parts)


def commit_flags(record: dict) -> str:
    """What a reader must know about a record's commit, as text ('' when nothing).

    >>> commit_flags({"commit": "abc1234", "dirty": True, "changed_files": [" M a.py"]})
    ' **The tree differed from `abc1234` (1 changed file).**'
    >>> commit_flags({"commit": "dfd3d51-dirty"})
    ' **Commit not recorded: the record says `dfd3d51-dirty`.**'
    """
    c = record.get("commit")
    if not isinstance(c, str) or not _HASH.fullmatch(c):
        return f" **Commit not recorded: the record says `{c}`.**"
    out = ""
    if record.get("dirty") is True:
        n = len(record.get("changed_files") or [])
        files = f" ({n} changed file{'s' if n != 1 else ''})" if n else ""
        out += f" **The tree differed from `{c}`{files}.**"
    if "commit_recorded_on_device" in record:
        out += (
            f" (The record's own field read `{record['commit_recorded_on_device']}`: the"
            " device's stale `.git`; corrected to the commit passed to the call"
            + (", see its `commit_note`" if "commit_note" in record else "")
            + ".)"
        )
    return out


def provenance(doc: Doc, name: str, label: str = "JSON") -> str:
    """``JSON: [bench/x.json](...): date, commit `abc`, machine.`` plus any commit flag."""
    r = doc.rec(name)
    return f"{label}: {doc.link(name)}: {when(r)}, commit `{r.get('commit')}`, {machine(r)}.{commit_flags(r)}"


def _mark(met: bool | None, value: Any) -> str:
    if met is None:
        return "not run" if value is None else "no threshold"
    return "met" if met else "**missed**"


def _cell(x: Mapping[str, Any]) -> str:
    """One record's target as a cell: the value (or, older records, their detail) and mark."""
    shown = x.get("detail") if x.get("op") is None and x.get("detail") else num(x.get("value"))
    return f"{shown} ({_mark(x.get('met'), x.get('value'))})"


def _latest(e: Mapping[str, Any]) -> str:
    if e.get("run") is None:
        return "not measured yet"
    if "threshold_now" not in e:  # (an older record's detail is in its run's column)
        return f"{num(e.get('value'))} ({_mark(e.get('met'), e.get('value'))})"
    then = f"{e['op']} {num(e['threshold'])}"
    return (
        f"{num(e['value'])} ({_mark(e.get('met_now'), e['value'])}; its run held it to {then}: "
        f"{_mark(e.get('met'), e['value'])})"
    )


def targets_table(
    doc: Doc,
    bench: str,
    names: Sequence[str] = (),
    headers: Sequence[str] | None = None,
    *,
    columns: bool = True,
) -> str:
    """The targets of ``bench`` as they stand in the index: today's threshold, the latest
    measured value with its verdict, and the run (commit, day) that measured it.

    With ``names`` (runs the text around the block discusses) the rows are those runs'
    targets, and each run gets a column of its own before the latest figure (unless
    ``columns`` is false: the rows only). Records
    carry targets as ``{name: {value, threshold, op, met}}`` (older ones as a list of
    ``{target, measured, met, detail}``); a target a run does not name is ``—`` there.
    """
    try:
        latest = doc.index["benches"][bench]["targets"]
    except KeyError:
        raise BenchDocsError(
            f"the index has no bench {bench!r}; file its runs with scripts/bench-records add"
        ) from None
    recs = [record_targets(doc.rec(n)) for n in names]
    keys = list(dict.fromkeys(k for t in recs for k in t)) if names else list(latest)
    headers = list(headers or [f"`{doc.rec(n)['commit']}` {day(doc.rec(n))}" for n in names])
    if not columns:
        recs, headers = [], []
    rows, bounded = [], False
    for key in keys:
        e = latest.get(key, {})
        op, threshold = e.get("op_now", e.get("op")), e.get("threshold_now", e.get("threshold"))
        bounded |= op is not None
        bound = "" if op is None else f"{op} {num(threshold)}"
        cells = [_cell(t[key]) if key in t else NA for t in recs]
        rows.append(
            [f"`{key}`" if op else key, bound, *cells, _latest(e) if e else NA, run_cell(doc, e)]
        )
    head = ["target", "threshold", *headers, "latest measured", "measured in"]
    if not bounded:  # older records only: their targets carry no threshold of their own
        head, rows = [h for i, h in enumerate(head) if i != 1], [r[:1] + r[2:] for r in rows]
    return table(head, rows)
