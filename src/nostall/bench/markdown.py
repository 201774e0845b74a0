"""Markdown pieces that the generated tables of the docs share: cells, tables, provenance lines.

Reads records as plain dicts (JSON only, no torch). A :class:`Doc` knows where the
document sits, so a link to a record works from ``README.md`` and from ``docs/``.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nostall.errors import ArgumentError

__all__ = [
    "NA",
    "Doc",
    "commit_flags",
    "machine",
    "num",
    "provenance",
    "secs",
    "table",
    "targets_table",
    "when",
]

_HASH = re.compile(r"[0-9a-f]{7,64}")
NA = "—"


@dataclass(frozen=True)
class Doc:
    """The records, and the path from the document being rendered to ``docs/bench/``."""

    records: Mapping[str, dict]
    bench_link: str  # "bench/" from docs/BENCHMARKS.md, "docs/bench/" from README.md

    def rec(self, name: str) -> dict:
        """The record ``docs/bench/<name>`` (``history/...`` for older ones)."""
        try:
            return self.records[name]
        except KeyError:
            raise ArgumentError(
                f"no record docs/bench/{name}; the docs cite it. Restore it, or point the "
                f"block at a record that exists ({', '.join(sorted(self.records))})"
            ) from None

    def link(self, name: str) -> str:
        return f"[`{self.bench_link}{name}`]({self.bench_link}{name})"


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
            raise ArgumentError(f"a row of {len(row)} cells under {len(header)} columns: {row}")
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


def targets_table(doc: Doc, names: Sequence[str], headers: Sequence[str] | None = None) -> str:
    """The targets of one or more records, one column each.

    Records carry targets as ``{name: {value, threshold, op, met}}`` (or, older ones, as a
    list of ``{target, measured, met[, detail]}``); a target missing from a record is ``—``.
    """
    recs = [doc.rec(n) for n in names]
    headers = list(headers or [f"`{r.get('commit')}`" for r in recs])
    rows: dict[str, list[str]] = {}
    bounds: dict[str, str] = {}
    for i, r in enumerate(recs):
        t = r.get("targets") or {}
        items = (
            [(k, v) for k, v in t.items()] if isinstance(t, dict) else [(x["target"], x) for x in t]
        )
        for key, x in items:
            row = rows.setdefault(key, [NA] * len(recs))
            if "op" in x:
                bounds[key] = f"{x['op']} {num(x['threshold'])}"
                row[i] = f"{num(x['value'])} ({_mark(x['met'], x['value'])})"
            else:
                shown = x.get("detail") or num(x.get("measured"))
                row[i] = f"{shown} ({_mark(x['met'], x.get('measured'))})"
    header = ["target", *(["threshold"] if bounds else []), *headers]
    body = [
        [f"`{k}`" if k in bounds else k, *([bounds.get(k, "")] if bounds else []), *cells]
        for k, cells in rows.items()
    ]
    return table(header, body)
