"""Host → target copies: on a GPU's copy stream, or plain memory copies for CPU loads.

The compute stream keeps running whatever it runs; weights move on their own
stream, and the consumer's stream waits for them once (:meth:`CopyEngine.finish`).
One stream is enough: on our H200 a second H2D stream added no bandwidth
(54.9 vs 54.8 GB/s) because one copy engine already saturates the link.

:class:`Transfer` issues one load's copies as its chunks land in host memory,
following the :class:`~nostall.transfer.plan.LoadPlan`: unchanged bytes straight
into the target buffer, tensors that change dtype gathered into a scratch tensor
on the target device and cast by one kernel once complete.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from nostall.transfer.plan import Cast, Copy, LoadPlan, Slot

__all__ = ["CopyEngine", "HostCopy", "Transfer"]


class CopyEngine:
    """Issues non-blocking H2D copies (and casts) on one device's copy stream.

    Owned by a :class:`~nostall.transfer.loader.Loader`; one engine per device.
    Every copy returns the event recorded after it: the source host memory may
    be overwritten only once that event has completed.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def _on_stream(self) -> contextlib.ExitStack:
        # The device first: entered from a thread on GPU 0, torch.cuda.stream() alone
        # restores GPU 0's stream on exit with a cudaSetDevice(0), which creates GPU 0's
        # context in a process that only uses this GPU (seen on the two-GPU machine).
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def begin(self, after: list[Any] | None = None) -> Any:
        """Order the next copies and return a start mark.

        By default they run after everything queued so far on the current stream
        (a destination fresh from the caching allocator was allocated there). With
        ``after``, only after those events: a destination the caller manages (the model
        cache's device slots) needs no more, and the copies can overlap the current
        stream's work.
        """
        if after is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            for event in after:
                self.stream.wait_event(event)
        return self.mark()

    def mark(self) -> torch.cuda.Event:
        """An event recorded now on the copy stream (a timing mark, and a fence)."""
        # blocking: a thread waiting for it sleeps instead of spinning on a CPU that
        # the reader threads need.
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(self.stream)
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (host, page-locked for full speed) into ``dst`` (device); the
        source may be reused once a later :meth:`fence` has completed."""
        with self._on_stream():
            dst.copy_(src, non_blocking=True)

    def fence(self) -> torch.cuda.Event:
        """The event after everything issued so far (what a host buffer waits for)."""
        return self.mark()

    def scratch(self, nbytes: int) -> torch.Tensor:
        """Device bytes for gathering one tensor, allocated on the copy stream: freed
        after its cast, the caching allocator hands it only to later copy-stream work."""
        with self._on_stream():
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def cast(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the copy stream, after the copies that filled ``src``."""
        with self._on_stream():
            dst.copy_(src)

    def finish(self, start: Any, *, join: bool = True) -> tuple[float, Any]:
        """Wait for every copy issued so far; with ``join``, make the current stream wait
        on them too.

        Returns the seconds the copy stream spent from ``start`` (a :meth:`begin` mark)
        to its last copy or cast, and the event that marks that end: a thread that did
        not join (a prefetch, whose current stream is busy computing) hands it to the
        consumer, whose stream waits for it before reading the tensors.
        """
        end = self.mark()
        if join:
            # The caller's stream must see the copied bytes before it reads the tensors.
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        # Events are waited for on their own device: the runtime would otherwise wake
        # GPU 0's context in a process that only uses another GPU.
        with torch.cuda.device(self.device):
            end.synchronize()
            return start.elapsed_time(end) / 1e3, end

    def abort(self) -> None:
        """Wait for everything issued, so no copy still reads host memory given back."""
        self.stream.synchronize()


class HostCopy:
    """The CPU counterpart of :class:`CopyEngine`: copies run at once, on this thread.

    Used when a CPU load goes through a pool: the caller gets its own memory, never a
    view of the pool's cached bytes, so nothing it does can change what a later hit
    serves.
    """

    device = torch.device("cpu")

    def begin(self, after: list[Any] | None = None) -> float:
        return self.mark()

    def mark(self) -> float:
        return time.perf_counter()

    def fence(self) -> None:
        return None  # copies are done when they return

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def scratch(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def cast(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def finish(self, start: float, *, join: bool = True) -> tuple[float, None]:
        return time.perf_counter() - start, None

    def abort(self) -> None:
        pass


class Transfer:
    """The copies of one load into its flat target buffer ``flat`` (uint8).

    :meth:`land` is called on one thread, once per host range, as the range's bytes
    become readable; it returns the event of its last copy (``None`` on the CPU): the
    host range may be overwritten or given back once that event has completed.
    """

    def __init__(self, plan: LoadPlan, engine: CopyEngine | HostCopy, flat: torch.Tensor):
        self.plan, self.engine, self.flat = plan, engine, flat
        # slot offset -> (scratch bytes, bytes still missing)
        self._gather: dict[int, list[Any]] = {}
        self._start: Any = None
        self.done: Any = None  # after finish(): the event that marks the end of the copies

    def begin(self, after: list[Any] | None = None) -> None:
        self._start = self.engine.begin(after)

    def land(self, i: int, a: int, b: int, host: torch.Tensor) -> Any:
        """Copy file ``i``'s bytes ``[a, b)``, which are in ``host`` (uint8, ``b - a`` long)."""
        for p in self.plan.pieces(i, a, b):
            src = host[p.lo - a : p.hi - a]
            if isinstance(p, Copy):
                self.engine.copy(self.flat[p.offset : p.offset + p.hi - p.lo], src)
            else:
                self._gather_piece(p, src)
        # One event for the range: copies on one stream complete in order.
        return self.engine.fence()

    def _gather_piece(self, p: Cast, src: torch.Tensor) -> None:
        s: Slot = p.slot
        entry = self._gather.get(s.offset)
        if entry is None:
            entry = self._gather[s.offset] = [self.engine.scratch(s.end - s.begin), s.end - s.begin]
        scratch = entry[0]
        self.engine.copy(scratch[p.lo - s.begin : p.hi - s.begin], src)
        entry[1] -= p.hi - p.lo
        if entry[1] == 0:
            # Stream order: the cast runs after every copy into the scratch bytes.
            dst = self.flat[s.offset : s.offset + s.target_bytes].view(s.target).view(s.shape)
            self.engine.cast(dst, scratch.view(s.source).view(s.shape))
            del self._gather[s.offset]

    def finish(self, *, join: bool = True) -> float:
        """Wait for the copies; returns their seconds on the copy stream (see
        :meth:`CopyEngine.finish` for ``join``)."""
        if self._gather:
            missing = ", ".join(f"offset {k}" for k in list(self._gather)[:3])
            raise AssertionError(f"tensors never completed their gather: {missing}")
        seconds, self.done = self.engine.finish(self._start, join=join)
        return seconds

    def abort(self) -> None:
        self._gather.clear()
        self.engine.abort()
