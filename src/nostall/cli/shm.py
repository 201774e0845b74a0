"""``nostall shm``: list and remove the host's shared host-tier segments (``shared:NAME``).

A thin layer over :meth:`nostall.memory.SharedPool.segments` and
:meth:`~nostall.memory.SharedPool.destroy`. A segment's last worker removes it when it
closes, unless it was kept; these commands are for the others: kept segments, and the
files of workers that were killed.
"""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from nostall.cli.app import app, console

__all__ = ["keep", "ls", "rm", "shm_app"]

shm_app = typer.Typer(
    help="The host's shared host-tier segments (--host-tier shared:NAME), in $NOSTALL_SHM_DIR "
    "or /dev/shm.",
    no_args_is_help=True,
)
app.add_typer(shm_app, name="shm")

_ROOT_HELP = "The segments' folder (default: $NOSTALL_SHM_DIR, else /dev/shm)."


def _root(root: str | None) -> str:
    from nostall.memory.shared import default_root

    return root or default_root()


def _bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


@shm_app.command("ls")
def ls(root: str = typer.Option(None, "--root", help=_ROOT_HELP)) -> None:
    """List this host's segments: size, the RAM their pages take, entries, the processes
    that have each open, and whether it outlives its last process (kept)."""
    from nostall.errors import ArgumentError
    from nostall.memory import SharedPool

    folder = _root(root)
    try:
        segments = SharedPool.segments(root=folder)
    except ArgumentError as e:
        raise typer.BadParameter(str(e), param_hint="--root") from e
    if not segments:
        console.print(f"no shared pool segments under {folder}", highlight=False)
        return
    table = Table(title=f"shared pool segments under {folder}", title_justify="left")
    for col in ("name", "size", "in RAM", "entries", "open in (pid)", "kept"):
        table.add_column(col, justify="right" if col in ("size", "in RAM", "entries") else "left")
    for s in segments:
        table.add_row(
            s.name,
            _bytes(s.capacity),
            _bytes(s.allocated),
            "?" if s.entries is None else str(s.entries),
            ", ".join(p.partition("-")[0] for p in s.processes)
            or ("unknown processes" if s.in_use else "-"),
            "yes" if s.keep else "no",
        )
    console.print(table)


@shm_app.command("rm")
def rm(
    name: str = typer.Argument(..., help="The segment's name (shared:NAME)."),
    root: str = typer.Option(None, "--root", help=_ROOT_HELP),
    force: bool = typer.Option(
        False,
        "--force",
        help="Remove it even while processes have it open: they keep their mapping, and "
        "their next use of the tier fails.",
    ),
) -> None:
    """Remove a segment and its files; refused while a process has it open (unless
    --force)."""
    from nostall.errors import ArgumentError, BusyError
    from nostall.memory import SharedPool

    folder = _root(root)
    try:
        removed = SharedPool.destroy(name, root=folder, force=force)
    except ArgumentError as e:
        hint = "--root" if e.field == "root" else "NAME"
        raise typer.BadParameter(str(e), param_hint=hint) from e
    except BusyError as e:
        console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    if not removed:
        console.print(f"no shared pool segment {name!r} under {folder}", highlight=False)
        raise typer.Exit(1)
    console.print(f"removed the shared pool segment {name!r} under {folder}", highlight=False)


@shm_app.command("keep")
def keep(
    name: str = typer.Argument(..., help="The segment's name (shared:NAME)."),
    root: str = typer.Option(None, "--root", help=_ROOT_HELP),
    off: bool = typer.Option(
        False, "--off", help="Unmark it: its last worker removes it again when it stops."
    ),
) -> None:
    """Keep a segment after its last worker stops (it may not exist yet): restarted
    workers with --host-tier shared:NAME find their tier still warm. `nostall shm rm`
    removes it."""
    from nostall.errors import ArgumentError
    from nostall.memory import SharedPool

    folder = _root(root)
    try:
        SharedPool.set_keep(name, not off, root=folder)
    except ArgumentError as e:
        raise typer.BadParameter(
            str(e), param_hint="--root" if e.field == "root" else "NAME"
        ) from e
    what = "no longer kept" if off else "kept after its last worker stops"
    console.print(f"shared pool segment {name!r} under {folder}: {what}", highlight=False)
