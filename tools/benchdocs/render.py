"""Render the benchmark blocks of README.md and every ``docs/*.md`` from the runs and the index.

A document marks each generated part with ``<!-- bench:NAME -->`` … ``<!-- /bench -->``
(a block on its own lines, or inline inside a sentence); :mod:`benchdocs.blocks`,
:mod:`benchdocs.readme` and :mod:`benchdocs.headlines` say what each ``NAME`` shows.
Everything outside the markers is left as written, and a page may carry any block (the
README's sections moved into pages under ``docs/`` carry theirs); links are written
relative to the page.

``scripts/render-benchmarks`` rewrites the documents; ``--check`` (what CI runs, through
``tests/tools/test_render.py``) only compares and prints a diff. Reads JSON only.

Example::

    >>> from benchdocs.markdown import Doc
    >>> render_text("Latest: <!-- bench:x --><!-- /bench -->.", Doc({}), {"x": lambda d: "42"})
    'Latest: <!-- bench:x -->42<!-- /bench -->.'
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from benchdocs import BenchDocsError
from benchdocs.blocks import BLOCKS as BENCHMARKS_BLOCKS
from benchdocs.headlines import headlines_block
from benchdocs.index import read_index
from benchdocs.markdown import Doc
from benchdocs.readme import BLOCKS as README_BLOCKS
from benchdocs.runs import load_runs

__all__ = ["BLOCKS", "check", "documents", "render_documents", "render_text", "write_documents"]

# Block names are unique across the documents' kinds.
BLOCKS: dict[str, Callable[[Doc], str]] = {
    **BENCHMARKS_BLOCKS,
    **README_BLOCKS,
    "headlines": headlines_block,
}
_BLOCK = re.compile(r"<!-- bench:(?P<name>[a-z0-9-]+) -->(?P<body>.*?)<!-- /bench -->", re.S)
_OPEN = re.compile(r"<!-- bench:([a-z0-9-]*) -->")


def documents(root: str | os.PathLike[str]) -> list[str]:
    """The documents that may carry blocks: ``README.md`` and ``docs/*.md``, from ``root``."""
    root = Path(root)
    found = [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]
    return [p.relative_to(root).as_posix() for p in found]


def render_text(text: str, doc: Doc, blocks: Mapping[str, Callable[[Doc], str]] = BLOCKS) -> str:
    """``text`` with every marked block replaced by what ``blocks`` renders for it.

    A block written on its own lines stays on its own lines; an inline one stays inline.
    An unknown name or an unclosed marker raises :class:`~benchdocs.BenchDocsError`.
    """
    opened = len(_OPEN.findall(text))
    found = list(_BLOCK.finditer(text))
    if opened != len(found):
        raise BenchDocsError(
            f"{doc.path}: {opened} '<!-- bench:NAME -->' markers but {len(found)} closed "
            "blocks; close each with '<!-- /bench -->' and do not nest them"
        )

    def replace(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in blocks:
            raise BenchDocsError(
                f"{doc.path}: unknown block '<!-- bench:{name} -->'; the blocks are "
                f"{', '.join(sorted(blocks))}"
            )
        body = blocks[name](doc).strip("\n")
        if m["body"].startswith("\n"):  # a block on its own lines
            body = f"\n{body}\n"
        return f"<!-- bench:{name} -->{body}<!-- /bench -->"

    return _BLOCK.sub(replace, text)


def render_documents(root: str | os.PathLike[str]) -> dict[str, tuple[str, str]]:
    """``{document: (as written, as rendered)}`` for each of :func:`documents` under ``root``."""
    root = Path(root)
    runs = load_runs(root)
    index = read_index(root, runs)
    out = {}
    for name in documents(root):
        text = (root / name).read_text()
        out[name] = (text, render_text(text, Doc(runs, index, name)))
    return out


def check(root: str | os.PathLike[str]) -> list[str]:
    """The unified diff between each document and its rendering (empty: up to date)."""
    lines: list[str] = []
    for name, (old, new) in render_documents(root).items():
        lines += difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            f"{name} (committed)",
            f"{name} (rendered from docs/bench/)",
        )
    return lines


def write_documents(root: str | os.PathLike[str]) -> list[str]:
    """Rewrite the documents whose blocks differ from their rendering; their names."""
    done = []
    for name, (old, new) in render_documents(root).items():
        if new != old:
            path = Path(root) / name
            tmp = path.with_name(f".{path.name}.partial")
            tmp.write_text(new)
            os.replace(tmp, path)  # a reader never sees half a document
            done.append(name)
    return done
