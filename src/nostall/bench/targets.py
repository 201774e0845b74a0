"""The targets every benchmark report carries, ``{name: {"value", "threshold", "op",
"met"}}`` (``met``: ``None`` when not run), as a table."""

from __future__ import annotations

from rich.table import Table

__all__ = ["table"]


def table(targets: dict[str, dict], *, title: str = "targets") -> Table:
    """One row per target: the measured value, the threshold and whether it was met."""
    out = Table(title=title, title_justify="left")
    for col in ("target", "value", "threshold", "met"):
        out.add_column(col, justify="left" if col == "target" else "right")
    for name, t in targets.items():
        v = t["value"]
        mark = {True: "[green]met[/green]", False: "[red]MISSED[/red]", None: "not run"}[t["met"]]
        value = "—" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
        out.add_row(name, value, f"{t['op']} {t['threshold']}", mark)
    return out
