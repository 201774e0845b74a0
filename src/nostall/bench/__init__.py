"""Reproducible benchmarks against the peers; each writes JSON that docs/BENCHMARKS.md cites."""
