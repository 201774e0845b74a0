"""Reproducible benchmarks against the peers, on the user's hardware; each writes a JSON record."""
