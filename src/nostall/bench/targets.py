"""The targets every benchmark report carries: ``{name: {"value", "threshold", "op", "met"}}``.

``op`` is ``"<="`` or ``">="``; ``met`` is ``None`` when the figure was not measured in
that report (its part did not run or failed), never ``True``. Each bench's
``evaluate_targets`` builds them with :class:`Targets`; :func:`table` prints them.

Example::

    >>> t = Targets()
    >>> t.add("switch_s", 0.61, "<=", 0.68)
    >>> t.add("speedup", None, ">=", 10.0)
    >>> t["switch_s"]
    {'value': 0.61, 'threshold': 0.68, 'op': '<=', 'met': True}
    >>> t["speedup"]["met"] is None
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["OPS", "Targets", "table"]

OPS = ("<=", ">=")


class Targets(dict[str, dict[str, Any]]):
    """A report's targets, in the order they were added (a plain ``dict`` to JSON)."""

    def add(self, name: str, value: Any, op: str, threshold: float) -> None:
        """Record ``value`` against ``threshold``: met when ``value <op> threshold``."""
        if op not in OPS:
            raise ValueError(f"target {name!r}: op {op!r}; use one of {', '.join(OPS)}")
        met = (
            None
            if value is None
            else bool(value <= threshold if op == "<=" else value >= threshold)
        )
        self[name] = {"value": value, "threshold": threshold, "op": op, "met": met}


def table(targets: dict[str, dict], *, title: str = "targets") -> Table:
    """One row per target: the measured value, the threshold and whether it was met."""
    from rich.table import Table

    out = Table(title=title, title_justify="left")
    for col in ("target", "value", "threshold", "met"):
        out.add_column(col, justify="left" if col == "target" else "right")
    for name, t in targets.items():
        v = t["value"]
        mark = {True: "[green]met[/green]", False: "[red]MISSED[/red]", None: "not run"}[t["met"]]
        value = "—" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
        out.add_row(name, value, f"{t['op']} {t['threshold']}", mark)
    return out
