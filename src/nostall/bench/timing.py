"""The benchmarks' clock: wait for the device, then read the time.

A CUDA call returns before its kernels have run, so a time read right after it measures
the launch, not the work. Every timed region in :mod:`nostall.bench` therefore starts and
ends with :func:`sync` (or :func:`sync_all` when several GPUs work at once); on a CPU
both are no-ops. :func:`timed` is the two together around one call.

Example::

    >>> import torch
    >>> seconds, out = timed(torch.device("cpu"), sum, [1, 2, 3])
    >>> out, seconds >= 0
    (6, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

__all__ = ["sync", "sync_all", "timed"]

T = TypeVar("T")


def sync(device: torch.device | str) -> None:
    """Wait until ``device`` has run every kernel queued on it (nothing to wait for on a CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_all(devices: Iterable[torch.device | str] | None = None) -> None:
    """:func:`sync` each of ``devices``; ``None``: every CUDA device this process sees."""
    if devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [torch.device("cuda", i) for i in range(n)]
    for d in devices:
        sync(d)


def timed(
    device: torch.device | str | Sequence[torch.device | str] | None,
    fn: Callable[..., T],
    /,
    *args: Any,
    **kwargs: Any,
) -> tuple[float, T]:
    """Seconds of ``fn(*args, **kwargs)`` with ``device`` synchronised before and after, and
    what it returned.

    ``device`` is one device, several (all synchronised: work spread over GPUs), or
    ``None`` for every CUDA device this process sees. Both are positional-only, so
    ``fn``'s own ``device=`` keyword passes through to it.
    """
    if device is None or isinstance(device, list | tuple):
        sync_all(device)
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        sync_all(device)
    else:
        sync(device)
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(device)
    return time.perf_counter() - t, out
