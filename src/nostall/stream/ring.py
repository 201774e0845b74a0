"""The ring: streamed blocks' weights copied into a few device buffers just ahead of use.

A :class:`BlockRing` serves the streamed blocks of one module (execution order ``0 …
S-1``) through ``depth`` device buffers: block ``k``'s parameters view buffer ``k %
depth`` for good (they are pointed there once, when the module is bound, so no
parameter changes between calls and a compiled block keeps its graph), and its bytes
are copied there before it runs. :mod:`nostall.stream.cost` states the rule and
predicts its time:

* before block ``k`` runs (a forward pre-hook), the compute stream waits for the event
  its copy recorded (a wait on the GPU, never on the CPU);
* after it ran (a forward hook), an event on the compute stream marks its buffer free,
  and the copy of the next block that uses the buffer is issued on the copy stream
  behind that event: block ``k + depth``, or near the end of the call the next call's
  block ``k % depth``, which therefore lands while this call finishes.

A block found not loaded when it is about to run (the first call, a call cut short by
an error, a module that runs its blocks in another order) is copied there and then,
behind everything queued on the compute stream so far: slower, never wrong. No block
allocates: the buffers are the caller's (a slot of the cache's device tier).

Under ``torch.compile`` the hooks run eagerly (``torch.compiler.disable``): a compiled
module breaks its graph at each streamed block's edges, and a block compiled on its own
(regional compilation, as diffusers' ``compile_repeated_blocks``) stays one graph, kept
from call to call since its parameters never move. ``fullgraph=True`` over a module
whose blocks stream is refused by torch (a graph break it cannot make).

The streams are an object of their own (:class:`CudaStreams`, :class:`CpuStreams`,
or a test's fake that records what was ordered after what).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

__all__ = ["BlockRing", "CpuStreams", "CudaStreams"]

Copies = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (device destination, host source)


class CudaStreams:
    """Copies on a copy stream of the ring's own; waits and events on the calling
    thread's current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy = torch.cuda.Stream(device)

    def issue(self, copies: Copies, after: list[Any]) -> Any:
        """Copy ``copies`` once the events ``after`` have happened; the event that
        marks them done."""
        with torch.cuda.stream(self.copy):
            for event in after:
                self.copy.wait_event(event)
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            return self.copy.record_event()

    def wait(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def mark(self) -> Any:
        return torch.cuda.current_stream(self.device).record_event()


class CpuStreams:
    """The CPU's: every copy done when issued, nothing to wait for."""

    def issue(self, copies: Copies, after: list[Any]) -> Any:
        for dst, src in copies:
            dst.copy_(src)
        return None

    def wait(self, event: Any) -> None:
        pass

    def mark(self) -> Any:
        return None


class BlockRing:
    """Streams ``blocks`` (their modules, in execution order) through ``depth``
    buffers (see the module). ``copies[k]``: the ``(destination, source)`` pairs that
    fill block ``k``'s buffer (destinations: views of buffer ``k % depth``; sources:
    host memory that stays readable while the ring is installed)."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        copies: Sequence[Copies],
        depth: int,
        streams: Any,
    ):
        if len(blocks) != len(copies):
            raise ValueError("one list of copies per streamed block")
        if depth < 1:
            raise ValueError("a ring of at least one buffer")
        self.blocks = list(blocks)
        self.copies = [list(c) for c in copies]
        self._nbytes = [sum(d.numel() * d.element_size() for d, _ in c) for c in self.copies]
        self.depth = depth
        self.streams = streams
        self.loaded: list[int | None] = [None] * depth  # the block each buffer holds
        self.landed: list[Any] = [None] * depth  # the event its copy recorded
        self.freed: list[Any] = [None] * depth  # the mark after its last block computed
        self.copied_bytes = 0
        self.misses = 0
        self._hooks: list[Any] = []
        # one call of the module at a time: its blocks share the buffers
        self._calls = threading.RLock()

    def install(self, root: nn.Module | None = None) -> None:
        """Hook the blocks (idempotent), and ``root`` (the module they are part of) so
        that calls of it from several threads run one at a time: they share the
        buffers. (Its kernels need not have ended: every copy waits for the events of
        the compute that used its buffer last.)"""
        if self._hooks:
            return
        if root is not None:
            self._hooks.append(root.register_forward_pre_hook(self._enter))
            self._hooks.append(root.register_forward_hook(self._leave, always_call=True))
        for k, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._before(k)))
            self._hooks.append(block.register_forward_hook(self._after(k)))

    @torch.compiler.disable
    def _enter(self, module: nn.Module, args: Any) -> None:
        self._calls.acquire()

    @torch.compiler.disable
    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._calls.release()

    def remove(self) -> None:
        """Unhook the blocks; their buffers count as holding nothing."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.loaded = [None] * self.depth
        self.landed = [None] * self.depth
        self.freed = [None] * self.depth

    def _issue(self, k: int, after: list[Any]) -> None:
        slot = k % self.depth
        self.landed[slot] = self.streams.issue(self.copies[k], after)
        self.loaded[slot] = k
        self.copied_bytes += self.nbytes_of(k)

    def nbytes_of(self, k: int) -> int:
        """The bytes block ``k``'s copies move."""
        return self._nbytes[k]

    def _before(self, k: int):
        @torch.compiler.disable  # (a compiled block stays one graph; the hook runs eagerly)
        def hook(module: nn.Module, args: Any) -> None:
            slot = k % self.depth
            if self.loaded[slot] != k:
                # not there (a first call, a call cut short, another order): copied now,
                # behind everything already queued on this stream and the compute that
                # used the buffer last (on whichever stream it ran)
                self.misses += 1
                mark = self.streams.mark()
                self._issue(k, self._after_use(slot, mark))
                if k == 0:  # a cold ring: the next buffers' blocks start coming too
                    for j in range(1, min(self.depth, len(self.blocks))):
                        if self.loaded[j % self.depth] != j:
                            self._issue(j, self._after_use(j % self.depth, mark))
            self.streams.wait(self.landed[slot])

        return hook

    def _after(self, k: int):
        @torch.compiler.disable
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            n = len(self.blocks)
            slot = k % self.depth
            self.freed[slot] = self.streams.mark()
            nxt = k + self.depth if k + self.depth < n else slot
            if nxt != k:  # (with depth or fewer blocks, each keeps its buffer)
                self._issue(nxt, [self.freed[slot]])

        return hook

    def _after_use(self, slot: int, mark: Any) -> list[Any]:
        return [e for e in (self.freed[slot], mark) if e is not None]
