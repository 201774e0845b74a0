"""Serving: the generation worker's HTTP API over the model cache (``nostall serve``).

Import :mod:`nostall.serve.app` / :mod:`nostall.serve.worker` directly; they need the
``serve`` extra (FastAPI, uvicorn, prometheus-client).
"""
