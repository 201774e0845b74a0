"""What a component's calls take, block by block: the cost model's compute times.

A :class:`BlockTimer` hooks a module and its blocks for its first few calls (events on
the calling stream on a GPU, the CPU's clock elsewhere) and then takes its hooks off:
the blocks' medians and the period from one call's start to the next are what
:func:`nostall.stream.cost.plan` predicts with, and what ``nostall switch --explain``
reports beside the prediction; the order the first call ran the blocks in is the order
the next plan streams them in (a UNet's mid block runs ``resnets.0, attentions.0,
resnets.1``, not as registered). Reading the figures waits for the events recorded.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

__all__ = ["BlockTimer"]


class BlockTimer:
    """Times ``root``'s first ``calls`` calls and each of ``blocks`` (name → module) in
    them; :meth:`figures` once they ran."""

    def __init__(
        self,
        root: nn.Module,
        blocks: Mapping[str, nn.Module],
        device: torch.device,
        *,
        calls: int = 3,
    ):
        self.device = device
        self.calls = calls
        self.starts: list[Any] = []
        self.marks: dict[str, list[tuple[Any, Any]]] = {n: [] for n in blocks}
        self.order: list[str] = []  # the blocks in the order the first call ran them
        self._hooks: list[Any] = [root.register_forward_pre_hook(self._call)]
        for name, m in blocks.items():
            self._watch(name, m)

    def _mark(self) -> Any:
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    @torch.compiler.disable
    def _call(self, module: nn.Module, args: Any) -> None:
        self.starts.append(self._mark())
        if len(self.starts) > self.calls:  # the last start closes the last call's period
            self.remove()

    def _watch(self, name: str, m: nn.Module) -> None:
        begun: list[Any] = []

        @torch.compiler.disable
        def before(mod: nn.Module, args: Any) -> None:
            begun.append(self._mark())
            if len(self.starts) == 1:
                self.order.append(name)

        @torch.compiler.disable
        def after(mod: nn.Module, args: Any, out: Any) -> None:
            if begun:
                self.marks[name].append((begun.pop(), self._mark()))

        self._hooks += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _seconds(self, a: Any, b: Any) -> float:
        if self.device.type == "cuda":
            b.synchronize()
            return a.elapsed_time(b) / 1000.0
        return b - a

    def figures(self) -> dict[str, Any] | None:
        """``{"period_s", "block_s": {name: seconds}}``, medians over the calls after the
        first (a cold ring, first launches); ``None`` until two calls began."""
        if len(self.starts) < 3 and not (len(self.starts) == 2 and self.calls == 1):
            return None
        starts = self.starts[1:] if len(self.starts) > 2 else self.starts
        periods = [self._seconds(a, b) for a, b in itertools.pairwise(starts)]
        blocks = {}
        for name, marks in self.marks.items():
            kept = marks[1:] if len(marks) > 1 else marks
            times = sorted(self._seconds(a, b) for a, b in kept)
            blocks[name] = times[len(times) // 2] if times else 0.0
        periods.sort()
        return {"period_s": periods[len(periods) // 2], "block_s": blocks, "order": self.order}
