"""Render the benchmark tables of README.md and docs/BENCHMARKS.md from the JSON records.

A document marks each generated part with ``<!-- bench:NAME -->`` … ``<!-- /bench -->``
(a block on its own lines, or inline inside a sentence); :mod:`nostall.bench.blocks`
(docs/BENCHMARKS.md) and :mod:`nostall.bench.headlines` (README.md) say what each ``NAME``
shows. Everything outside the markers is left as written.

``scripts/render-benchmarks`` rewrites the documents; ``--check`` (what CI runs, through
``tests/bench/test_render.py``) only compares and prints a diff. Reads JSON only: no torch.

Example::

    >>> from nostall.bench.markdown import Doc
    >>> doc = Doc({"gpu-check.json": {"date": "2026-12-01T15:14:27+00:00"}}, "bench/")
    >>> render_text("Latest: <!-- bench:x --><!-- /bench -->.", doc, {"x": lambda d: "42"})
    'Latest: <!-- bench:x -->42<!-- /bench -->.'
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from nostall.bench.blocks import BLOCKS as BENCHMARKS_BLOCKS
from nostall.bench.headlines import BLOCKS as README_BLOCKS
from nostall.bench.markdown import Doc
from nostall.errors import ArgumentError

__all__ = ["BLOCKS", "DOCUMENTS", "check", "load_records", "render_documents", "render_text"]

# Each document, and the path from it to docs/bench/.
DOCUMENTS = {"README.md": "docs/bench/", "docs/BENCHMARKS.md": "bench/"}
# Block names are unique across both documents.
BLOCKS = {**BENCHMARKS_BLOCKS, **README_BLOCKS}
_BLOCK = re.compile(r"<!-- bench:(?P<name>[a-z0-9-]+) -->(?P<body>.*?)<!-- /bench -->", re.S)
_OPEN = re.compile(r"<!-- bench:([a-z0-9-]*) -->")


def load_records(bench: str | os.PathLike[str]) -> dict[str, dict]:
    """Every record under ``bench`` (``docs/bench``): ``{"load.json": …, "history/…": …}``.

    ``diag/`` holds diagnostics, not benchmark records, and is not read.
    """
    root = Path(bench)
    out: dict[str, dict] = {}
    for path in sorted([*root.glob("*.json"), *root.glob("history/*.json")]):
        name = path.relative_to(root).as_posix()
        try:
            out[name] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ArgumentError(
                f"{path}: not a readable JSON record ({e}); fix or restore it"
            ) from e
    return out


def render_text(text: str, doc: Doc, blocks: Mapping[str, Callable[[Doc], str]] = BLOCKS) -> str:
    """``text`` with every marked block replaced by what ``blocks`` renders for it.

    A block written on its own lines stays on its own lines; an inline one stays inline.
    An unknown name or an unclosed marker raises :class:`~nostall.ArgumentError`.
    """
    opened = len(_OPEN.findall(text))
    found = list(_BLOCK.finditer(text))
    if opened != len(found):
        raise ArgumentError(
            f"{opened} '<!-- bench:NAME -->' markers but {len(found)} closed blocks; close each "
            "with '<!-- /bench -->' and do not nest them"
        )

    def replace(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in blocks:
            raise ArgumentError(
                f"unknown block '<!-- bench:{name} -->'; the blocks are {', '.join(sorted(blocks))}"
            )
        body = blocks[name](doc).strip("\n")
        if m["body"].startswith("\n"):  # a block on its own lines
            body = f"\n{body}\n"
        return f"<!-- bench:{name} -->{body}<!-- /bench -->"

    return _BLOCK.sub(replace, text)


def render_documents(root: str | os.PathLike[str]) -> dict[str, tuple[str, str]]:
    """``{document: (as written, as rendered)}`` for each of :data:`DOCUMENTS` under ``root``."""
    root = Path(root)
    records = load_records(root / "docs" / "bench")
    out = {}
    for name, link in DOCUMENTS.items():
        text = (root / name).read_text()
        out[name] = (text, render_text(text, Doc(records, link)))
    return out


def check(root: str | os.PathLike[str]) -> list[str]:
    """The unified diff between each document and its rendering (empty: up to date)."""
    lines: list[str] = []
    for name, (old, new) in render_documents(root).items():
        lines += difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            f"{name} (committed)",
            f"{name} (rendered from docs/bench/*.json)",
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/render-benchmarks",
        description="Rewrite the benchmark tables of README.md and docs/BENCHMARKS.md "
        "from docs/bench/*.json.",
    )
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a diff")
    parser.add_argument("--root", default=".", help="the repository (default: .)")
    args = parser.parse_args(argv)
    if args.check:
        diff = check(args.root)
        sys.stdout.writelines(diff)
        if diff:
            print(
                "\nthe tables differ from the records: run scripts/render-benchmarks",
                file=sys.stderr,
            )
        return 1 if diff else 0
    for name, (old, new) in render_documents(args.root).items():
        if new != old:
            path = Path(args.root) / name
            tmp = path.with_name(f".{path.name}.partial")
            tmp.write_text(new)
            os.replace(tmp, path)  # a reader never sees half a document
            print(f"rendered {name}")
    return 0
