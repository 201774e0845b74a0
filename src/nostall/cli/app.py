"""The ``nostall`` Typer app, its console, and the option helpers every command shares.

Each command group lives in its own module (:mod:`nostall.cli.load`, :mod:`~nostall.cli.switch`,
:mod:`~nostall.cli.video`, :mod:`~nostall.cli.quant`, :mod:`~nostall.cli.serve`,
:mod:`~nostall.cli.bench`, :mod:`~nostall.cli.demo`, :mod:`~nostall.cli.synthetic`,
:mod:`~nostall.cli.shm`) and
registers its commands on :data:`app` or :data:`bench_app`; importing :mod:`nostall.cli`
imports them all. This module imports none of them, and nothing heavy (torch loads on the
first command that needs it), so ``nostall --help`` stays fast.

Bad option values are usage errors: one message naming the option, the value and the fix,
exit status 2, no traceback. Typed library errors (:class:`~nostall.NostallError`) that
escape a command are printed the same way by :func:`main`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from nostall.errors import ArgumentError, DeviceError, NostallError, SinkError
from nostall.logs import Once

__all__ = [
    "BENCH_OUT",
    "DTYPES",
    "app",
    "bench_app",
    "check_choices",
    "check_output",
    "console",
    "default_device",
    "device_option",
    "gigabytes",
    "in_range",
    "main",
    "parse_dtype",
    "setup_logging",
    "usage_errors",
]

app = typer.Typer(
    help="Keep GPUs busy in diffusion inference: fast checkpoint loading, stall-free video output.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks against the peers, written as JSON.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

# Wide enough for the phase tables when piped to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 150)

BENCH_OUT = "bench-out"  # ignored by git: a run writes here unless --out says otherwise

# The floating dtypes a checkpoint can be cast to; the long names are accepted too.
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def _print_version(value: bool) -> None:
    if value:
        from nostall import __version__

        print(f"nostall {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_print_version,
        help="Print nostall's version and exit.",
    ),
) -> None:
    pass


def default_device() -> str:
    """``"cuda"`` when PyTorch sees a GPU, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_device(value: str | None) -> str:
    """A ``--device`` value as given, once it names a device this machine has (the
    default when left out)."""
    if value is None:
        return default_device()
    from nostall.transfer.loader import resolve_device

    try:
        resolve_device(value)
    except DeviceError as e:
        raise typer.BadParameter(str(e)) from e
    return value


def device_option(
    help: str = "cpu or cuda[:N] (default: cuda when available).",
) -> Any:
    """A ``--device`` option checked at parse time: ``cuda`` on a machine without a GPU is
    a usage error before anything runs."""
    return typer.Option(None, help=help, callback=_check_device)


def parse_dtype(name: str | None, hint: str = "--dtype"):
    """``bf16``/``fp16``/``fp32``/``fp64`` (or the long names) as a ``torch.dtype``;
    ``None`` stays ``None``. Anything else is a usage error naming the choices."""
    if name is None:
        return None
    import torch

    key = DTYPES.get(name.lower(), name.lower())
    if key not in DTYPES.values():
        raise typer.BadParameter(
            f"{name!r} is not a cast target; use one of {', '.join(DTYPES)} (floating "
            f"tensors are cast; integer tensors keep their dtype)",
            param_hint=hint,
        )
    return getattr(torch, key)


@contextlib.contextmanager
def usage_errors(hint: str | None = None) -> Iterator[None]:
    """Report the library's refusal of an option value (an :class:`~nostall.ArgumentError`,
    :class:`~nostall.SinkError` or :class:`~nostall.DeviceError`) as a usage error."""
    try:
        yield
    except (ArgumentError, SinkError, DeviceError) as e:
        raise typer.BadParameter(str(e), param_hint=hint) from e


def check_choices(values: Iterable[str], allowed: Iterable[str], hint: str) -> tuple[str, ...]:
    """``values`` as a tuple, each one of ``allowed``; a usage error naming the first
    value that is not, and the choices."""
    values, allowed = tuple(values), tuple(allowed)
    for v in values:
        if v not in allowed:
            raise typer.BadParameter(f"{v!r} is not one of {', '.join(allowed)}", param_hint=hint)
    return values


def check_output(path: str, *, hint: str, overwrite: bool) -> None:
    """Refuse, before anything runs, an output file at ``path`` that exists (unless
    ``overwrite``) or that is a folder, and one whose folder is a file."""
    if os.path.isdir(path):
        raise typer.BadParameter(
            f"{path!r} is a folder, but a file is written there; give a file path",
            param_hint=hint,
        )
    if os.path.lexists(path) and not overwrite:
        raise typer.BadParameter(
            f"{path!r} already exists; pass --overwrite to replace it, or choose another path",
            param_hint=hint,
        )
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):  # missing folders are created when writing
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise typer.BadParameter(
            f"{parent!r} is a file, so {path!r} cannot be written below it", param_hint=hint
        )


def in_range(low: float | None = None, high: float | None = None) -> Callable:
    """A Typer option callback: the number given, if it is within ``low..high`` (an end
    left ``None`` is open), else a usage error that names the value and the range."""

    def check(value: float | None) -> float | None:
        if value is None or ((low is None or value >= low) and (high is None or value <= high)):
            return value
        if low is not None and high is not None:
            span = f"a number in {low}..{high}"
        else:
            span = f"at least {low}" if low is not None else f"at most {high}"
        raise typer.BadParameter(f"{value} is out of range; give {span}")

    return check


def gigabytes(value: float | None, hint: str) -> int | None:
    """A budget given in GB as bytes (``None`` stays ``None``: the library's default)."""
    if value is None:
        return None
    if not value > 0:
        raise typer.BadParameter(f"must be a positive number of GB, got {value}", param_hint=hint)
    return int(value * 1e9)


def setup_logging() -> None:
    """Warnings on stderr, each distinct one once: Python warnings that the filters let
    through (shown once per text, whichever line raised them) and log records through the
    root logger. A root logger that already has handlers (a host program's) is left as
    it is."""
    shown: set[tuple[type, str]] = set()
    show = warnings.showwarning

    def show_once(message, category, filename, lineno, file=None, line=None) -> None:
        if (category, str(message)) not in shown:
            shown.add((category, str(message)))
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_once
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(Once())  # libraries repeat theirs per pipeline, component or call
    root.addHandler(handler)
    root.setLevel(logging.WARNING)


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread: it unwinds the command as Ctrl-C does (every
    writer's ``except BaseException`` removes its partial file), and click, which turns
    a KeyboardInterrupt into "Aborted!", lets it through."""


def _terminate(sig: int, frame: Any) -> None:
    raise _Terminated


def main() -> None:
    """The ``nostall`` console script. SIGTERM ends a command as Ctrl-C does (nothing
    half-written is left), with exit status 143; the servers install their own handlers
    while they run (they drain first)."""
    setup_logging()
    signal.signal(signal.SIGTERM, _terminate)
    try:
        app()
    except NostallError as e:
        # (escaped: a message's own brackets, z[i:i+1], are not markup)
        console.print(f"[red]error:[/red] {type(e).__name__}: {escape(str(e))}", highlight=False)
        sys.exit(2)
    except _Terminated:
        pass
    else:
        return
    # Past the handler, the exception and the frames it unwound are freed: an object only
    # they held is finalized now (a frame sink that SIGTERM caught between its creation
    # and its owner's `try` removes its temporary).
    console.print("stopped by SIGTERM", highlight=False)
    # Everything the command owned is closed by now, and exit handlers run; what is
    # skipped is tearing down the interpreter's modules, which took 1.4-2.4 s with torch
    # and diffusers loaded (measured on 2 cores): time an orchestrator's grace period
    # does not have.
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.SIGTERM)
