"""Waiting on and polling CUDA events from any thread, without touching GPU 0.

``torch.cuda.Event.query()``, ``.synchronize()`` and ``.elapsed_time()`` call the CUDA
runtime without a device guard. On a thread whose current device is 0 (every thread's
default) the runtime then creates GPU 0's context, even in a process that only uses
``cuda:1`` (seen on our two-GPU machine: a load to ``cuda:1`` left a context on GPU 0).
These helpers make the event's own device current for the call.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["event_done", "on_device_of", "wait_event"]


def on_device_of(event: Any) -> contextlib.AbstractContextManager:
    """A context that makes ``event``'s device current (nothing for CPU stand-ins)."""
    device = getattr(event, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def wait_event(event: Any) -> None:
    """Block this thread until ``event`` has completed."""
    with on_device_of(event):
        event.synchronize()


def event_done(event: Any) -> bool:
    """Whether ``event`` has completed (never blocks)."""
    with on_device_of(event):
        return bool(event.query())
