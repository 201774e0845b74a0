"""Pinning an arena in the background: the pin thread's state, its teardown, the GPU that pins.

Shared by the process-local pool (:class:`~nostall.memory.pool.PinnedPool`) and the
host-wide one (:class:`~nostall.memory.shared.SharedPool`): both reserve their bytes as one
:class:`~nostall.memory.host.HostArena` and page-lock it slab by slab in a daemon thread, so
pinning (seconds for tens of gigabytes) never sits on a request's path.
"""

from __future__ import annotations

import logging
import threading

import torch

from nostall.errors import ArgumentError, DeviceError
from nostall.memory.host import HostArena

__all__ = ["Pinning", "device_index", "teardown"]

log = logging.getLogger(__name__)


class Pinning:
    """The background pin thread's state; shared with the pool, never holding it, so a
    dropped pool can be finalised while pinning is still running."""

    def __init__(self, arena: HostArena, register: bool, device: int | None):
        self.arena, self.register, self.device = arena, register, device
        self.cond = threading.Condition()
        self.upto = 0  # slabs [0, upto) are touched (and registered)
        self.error: BaseException | None = None
        self.stopped = False

    def run(self) -> None:
        try:
            if self.register and self.device is not None:
                # This thread's registrations go through this GPU's context, not GPU 0's.
                torch.cuda.set_device(self.device)
            for i in range(self.arena.num_segments):
                with self.cond:
                    if self.stopped:
                        return
                self.arena.pin_segment(i, register=self.register)
                with self.cond:
                    self.upto = i + 1
                    self.cond.notify_all()
        except BaseException as e:  # surfaced to whoever waits on pinning
            with self.cond:
                self.error = e
                self.cond.notify_all()
            log.exception("pinning the pool failed")

    def skip(self) -> None:
        """Count every slab as ready without touching it (a pool that does not pin)."""
        with self.cond:
            self.upto = self.arena.num_segments
            self.cond.notify_all()

    def wait(self, upto: int, timeout: float | None) -> bool:
        with self.cond:
            ok = self.cond.wait_for(
                lambda: self.upto >= upto or self.error is not None or self.stopped, timeout
            )
            if self.error is not None:
                raise DeviceError(
                    f"pinning the pool failed: {type(self.error).__name__}: {self.error}"
                ) from self.error
            return ok and self.upto >= upto

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


def teardown(pinning: Pinning, thread: threading.Thread | None, arena: HostArena) -> None:
    # Runs from close(), when a pool is garbage-collected, and at interpreter exit
    # (weakref.finalize): a daemon thread still inside cudaHostRegister while CUDA tears
    # down aborts the process ("terminate called without an active exception").
    pinning.stop()
    if thread is not None and thread is not threading.current_thread():
        thread.join()
    arena.close()


def device_index(device: str | torch.device | int | None) -> int | None:
    """The CUDA device index that registers the pool's memory (no context is created)."""
    if not torch.cuda.is_available():
        return None
    if device is None:
        return torch.cuda.current_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ArgumentError(f"device={device!r} is not a device; use 'cuda[:N]' or an index") from e
    if dev.type != "cuda":
        raise ArgumentError(f"device={device!r}: pinned memory is registered with a CUDA device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        raise DeviceError(
            f"device cuda:{index} does not exist; {torch.cuda.device_count()} GPU(s) visible"
        )
    return index
