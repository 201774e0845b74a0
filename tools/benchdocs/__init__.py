"""Publishing the benchmark records: runs filed under ``docs/bench/runs/``, their index, the
tables of the docs.

``nostall bench …`` measures on the user's hardware and writes one JSON record where
``--out`` says; it knows nothing of this repository's documents. This package (beside the
library, not installed with it; standard library only) is what makes a record part of
the docs:

* :mod:`benchdocs.runs`: where records live. Each run is its own immutable file,
  ``docs/bench/runs/<bench>-<commit>-<YYYY-MM-DD>[-N].json``; :func:`~benchdocs.runs.file_run`
  files a report under that name.
* :mod:`benchdocs.index`: ``docs/bench/index.json``, generated from the runs: per bench
  and per target the latest *measured* value and the run it came from, so a partial run
  never hides an earlier measurement; the headline figures likewise
  (:mod:`benchdocs.headlines`).
* :mod:`benchdocs.render`: every ``<!-- bench:NAME -->`` … ``<!-- /bench -->`` block of
  ``README.md`` and ``docs/*.md`` rewritten from the runs and the index
  (:mod:`benchdocs.blocks`, :mod:`benchdocs.readme`, :mod:`benchdocs.markdown`).

Commands (``scripts/bench-records``, ``scripts/render-benchmarks``) are
:mod:`benchdocs.commands`.
"""


class BenchDocsError(Exception):
    """A record, the index or a document is not what publishing needs; the message says
    which file and how to fix it."""


__all__ = ["BenchDocsError"]
