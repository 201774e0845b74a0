"""The two commands: ``scripts/bench-records`` (file runs, regenerate the index) and
``scripts/render-benchmarks`` (rewrite or check the documents' blocks).

Recording a run, from the repository root::

    scripts/bench-records add bench-out/switch.json   # → docs/bench/runs/switch-<commit>-<day>.json
    scripts/render-benchmarks                         # the tables, from the runs and the index

``add`` regenerates the index itself; ``scripts/bench-records index`` does it alone (after
removing a run by hand, or to refresh ``src_changed`` against a newer HEAD).
"""

from __future__ import annotations

import argparse
import sys

from benchdocs import BenchDocsError

__all__ = ["bench_records", "render_benchmarks"]


def _fail(e: BenchDocsError) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2


def bench_records(argv: list[str] | None = None) -> int:
    """``scripts/bench-records add FILE... [--bench NAME]`` | ``scripts/bench-records index``."""
    from benchdocs.index import write_index
    from benchdocs.runs import file_run

    parser = argparse.ArgumentParser(
        prog="scripts/bench-records",
        description="File benchmark reports as runs under docs/bench/runs/ and regenerate "
        "docs/bench/index.json.",
    )
    parser.add_argument("--root", default=".", help="the repository (default: .)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add", help="file reports under their run names, then re-index")
    add.add_argument("files", nargs="+", help="JSON reports written by nostall bench --out")
    add.add_argument(
        "--bench", help="the bench, for a record that does not name it (older gpu-checks)"
    )
    sub.add_parser("index", help="regenerate docs/bench/index.json from the runs")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "add":
            for path in args.files:
                where, new = file_run(path, args.root, bench=args.bench)
                print(f"{'filed' if new else 'already filed'}: {path} -> {where}")
        print(f"indexed: {write_index(args.root)}")
    except BenchDocsError as e:
        return _fail(e)
    return 0


def render_benchmarks(argv: list[str] | None = None) -> int:
    """``scripts/render-benchmarks [--check]``: 0 when the documents are (now) up to date,
    1 when ``--check`` found a difference (printed as a diff)."""
    from benchdocs.render import check, write_documents

    parser = argparse.ArgumentParser(
        prog="scripts/render-benchmarks",
        description="Rewrite the <!-- bench:NAME --> blocks of README.md and docs/*.md from "
        "docs/bench/runs/ and docs/bench/index.json.",
    )
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a diff")
    parser.add_argument("--root", default=".", help="the repository (default: .)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            diff = check(args.root)
            sys.stdout.writelines(diff)
            if diff:
                print(
                    "\nthe blocks differ from the records: run scripts/render-benchmarks",
                    file=sys.stderr,
                )
            return 1 if diff else 0
        for name in write_documents(args.root):
            print(f"rendered {name}")
    except BenchDocsError as e:
        return _fail(e)
    return 0
