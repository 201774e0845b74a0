"""What every benchmark record says about itself: the commit, the machine, where it is written.

Every bench (``load``, ``decode``, ``switch``, ``serve``, ``fp8`` and the GPU check)
starts its report with :func:`header`, so a record names the commit it measured and
whether the tree differed from it:

* ``commit``: a commit hash (short or full), never decorated (no ``-dirty``);
  ``None`` only where no source below gives one;
* ``dirty``: ``True`` when the tree that ran differed from ``commit``, ``False``
  when it did not, ``None`` when that could not be told;
* ``changed_files``: the differing files, ``git status --porcelain`` lines, where known;
* ``commit_source``: where the commit came from.

The commit is taken from, in order:

1. ``$NOSTALL_COMMIT``;
2. a ``.commit`` file at the repository root (or the working directory);
3. ``git`` in the repository the package was imported from.

Benchmarks run on a GPU machine over a *copy* of the working tree whose ``.git`` may
be stale, so the first two are what the machine that launched the run knew. Their
text is a hash, optionally followed by ``-dirty`` and by ``git status --porcelain``
lines, one per changed file; write it, before the device call, with::

    { git rev-parse --short HEAD; git status --porcelain -uno; } > .commit

A ``.commit`` with the hash alone says nothing about the tree: ``dirty`` is then
taken from ``git`` if the local ``HEAD`` is that commit, else ``None``. A ``.commit``
naming an ancestor of the local ``HEAD`` is a leftover and is ignored.

Outputs: :func:`check_new_output` refuses, before an hour-long run, a path that
already holds a record; :func:`write_report` writes atomically and never replaces a
record that appeared meanwhile.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nostall.errors import ArgumentError

if TYPE_CHECKING:
    import torch

__all__ = [
    "COMMIT_ENV",
    "Provenance",
    "check_new_output",
    "check_run",
    "commit",
    "hardware",
    "header",
    "parse_commit",
    "provenance",
    "write_report",
]

COMMIT_ENV = "NOSTALL_COMMIT"
COMMIT_FILE = ".commit"
# What a record's ``commit`` may be: an abbreviated or full SHA-1 or SHA-256 hash.
HASH = re.compile(r"[0-9a-f]{7,64}")
_DIRTY_SUFFIXES = ("-dirty", "+dirty")
# src/nostall/bench/record.py -> the repository holding src/
_REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Provenance:
    """Which commit a record measured, and whether the tree that ran differed from it."""

    commit: str | None
    dirty: bool | None
    changed_files: tuple[str, ...] = ()
    source: str = "none"

    def as_dict(self) -> dict[str, Any]:
        """The record's fields: ``commit``, ``dirty``, ``changed_files``, ``commit_source``."""
        return {
            "commit": self.commit,
            "dirty": self.dirty,
            "changed_files": list(self.changed_files),
            "commit_source": self.source,
        }


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _git_changes(root: Path) -> list[str] | None:
    """Tracked files that differ from ``HEAD``, and untracked ones under ``src/``."""
    tracked = _git(root, "status", "--porcelain", "-uno")
    if tracked is None:
        return None
    # An untracked module changes what runs; untracked outputs elsewhere do not.
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--", "src") or ""
    return [line for line in tracked.splitlines() if line.strip()] + [
        f"?? {name}" for name in untracked.splitlines() if name.strip()
    ]


def parse_commit(text: str, source: str) -> Provenance | None:
    """Read a commit given as text (``$NOSTALL_COMMIT``, ``.commit``); ``None`` if not a hash.

    The first word is the hash, optionally suffixed ``-dirty``; further lines are
    ``git status --porcelain`` lines, one per changed file.

    Example::

        >>> parse_commit("31e9f1f", "NOSTALL_COMMIT")
        Provenance(commit='31e9f1f', dirty=None, changed_files=(), source='NOSTALL_COMMIT')
        >>> parse_commit("31e9f1f\\n M src/nostall/api.py\\n", ".commit").dirty
        True
        >>> p = parse_commit("dfd3d51-dirty", ".commit")
        >>> p.commit, p.dirty
        ('dfd3d51', True)
        >>> parse_commit("unknown", "NOSTALL_COMMIT") is None
        True
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    ref = lines[0].strip().lower()
    dirty: bool | None = None
    for suffix in _DIRTY_SUFFIXES:
        if ref.endswith(suffix):
            ref, dirty = ref[: -len(suffix)], True
    if not HASH.fullmatch(ref):
        return None
    changed = tuple(line.rstrip() for line in lines[1:])
    if changed:
        dirty = True
    return Provenance(ref, dirty, changed, source)


def _given(root: Path) -> Provenance | None:
    env = os.environ.get(COMMIT_ENV)
    if env:
        p = parse_commit(env, COMMIT_ENV)
        if p is not None:
            return p
    for folder in dict.fromkeys((root, Path.cwd())):
        try:
            text = (folder / COMMIT_FILE).read_text()
        except OSError:
            continue
        p = parse_commit(text, COMMIT_FILE)
        if p is not None:
            return p
    return None


def provenance(root: str | os.PathLike[str] | None = None) -> Provenance:
    """The commit this process runs, and whether the tree differs from it (see the module).

    ``root`` is the repository (default: the one this package was imported from).
    """
    repo = Path(root) if root is not None else _REPO
    given = _given(repo)
    head = (_git(repo, "rev-parse", "HEAD") or "").strip() or None
    at_head = bool(given and head and head.startswith(given.commit))
    if (
        given is not None
        and given.source == COMMIT_FILE
        and head
        and not at_head
        and _git(repo, "merge-base", "--is-ancestor", given.commit, "HEAD") is not None
    ):
        # A .commit left behind by an earlier device call: this checkout has moved on
        # past it. (On the GPU machine the copy's stale .git never has the newer commit.)
        given = None
    if given is not None:
        if given.dirty is None and at_head:
            # The given commit is this checkout's HEAD: git can tell the tree's state.
            changes = _git_changes(repo)
            if changes is not None:
                return Provenance(given.commit, bool(changes), tuple(changes), given.source)
        return given
    if head is None:
        return Provenance(None, None)
    short = (_git(repo, "rev-parse", "--short", "HEAD") or head[:7]).strip()
    changes = _git_changes(repo)
    return Provenance(
        short, None if changes is None else bool(changes), tuple(changes or ()), "git"
    )


def commit() -> str | None:
    """The commit hash a record names (see :func:`provenance`); never ``-dirty``."""
    return provenance().commit


def hardware(dev: torch.device | None = None) -> dict[str, Any]:
    """Python, torch, CPUs, RAM, platform, and the GPU of ``dev`` when it is CUDA."""
    import torch

    hw: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    try:
        with open("/proc/meminfo") as f:
            hw["ram_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    if dev is not None and dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        hw.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return hw


def header(
    benchmark: str, dev: torch.device | None = None, *, machine: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The first fields of every record: name, UTC date, provenance, hardware.

    ``machine`` replaces what :func:`hardware` reports for ``dev`` (the GPU check names
    every GPU of the machine instead).

    Example::

        >>> h = header("load")
        >>> list(h)
        ['benchmark', 'date', 'commit', 'dirty', 'changed_files', 'commit_source', 'hardware']
    """
    return {
        "benchmark": benchmark,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **provenance().as_dict(),
        "hardware": hardware(dev) if machine is None else machine,
    }


def check_run(size: str, sizes: Any, repeat: int, parts: Any, known: Any) -> None:
    """A benchmark run's common arguments: ``size`` one of ``sizes``, at least one timed
    run, every part one of ``known``; else :class:`~nostall.errors.ArgumentError`."""
    from nostall.errors import ArgumentError

    if size not in sizes:
        raise ArgumentError(f"size={size!r}; choose one of {', '.join(sizes)}")
    if repeat < 1:
        raise ArgumentError(f"repeat={repeat}; time at least one run")
    unknown = [p for p in parts if p not in known]
    if unknown:
        raise ArgumentError(f"parts {unknown}; choose from {', '.join(known)}")


def check_new_output(path: str, *, overwrite: bool) -> None:
    """Raise :class:`~nostall.ArgumentError` if ``path`` exists and ``overwrite`` is off.

    Called before a run (which may take an hour) so that an earlier report is never
    replaced by accident.

    Example::

        >>> import os, tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = os.path.join(tmp.name, "load.json")
        >>> check_new_output(path, overwrite=False)   # nothing there yet
        >>> write_report({"benchmark": "load"}, path)
        >>> check_new_output(path, overwrite=False)
        Traceback (most recent call last):
        nostall.errors.ArgumentError: ...load.json already exists; ...
        >>> tmp.cleanup()
    """
    if not overwrite and os.path.lexists(path):
        raise ArgumentError(
            f"{path} already exists; benchmarks do not write over a recorded result. "
            f"Choose another --out, or pass --overwrite to replace it"
        )


def write_report(report: dict, path: str, *, overwrite: bool = True) -> None:
    """Write ``report`` as JSON to ``path``, atomically (a reader never sees half a file).

    With ``overwrite=False`` an existing ``path`` is left alone and
    :class:`~nostall.ArgumentError` is raised (the report stays in ``path.partial``).
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if path appeared during the run, unlike os.replace
    except FileExistsError as e:
        raise ArgumentError(
            f"{path} appeared while the benchmark ran; the report was kept in {tmp}. Move "
            f"it where you want it, or run again with --overwrite"
        ) from e
    except OSError:  # a file system without hard links: check, then rename
        check_new_output(path, overwrite=False)
        os.replace(tmp, path)
        return
    os.unlink(tmp)
