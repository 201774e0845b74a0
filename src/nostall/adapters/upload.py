"""A fuse's LoRA factors on the GPU: each kept LoRA's one pinned block copied once per
change, in chunks on a side stream, while the fuse's multiply-adds run on the caller's
stream, each waiting only for the chunk that holds its factors.

A LoRA kept by the shelf has its factors packed in one pinned block (``Lora.flat``); a
rank-64 FLUX LoRA is 523 MB, 9.5 ms over the link, about as long as the 418 fused
multiply-adds it feeds, so the two overlap instead of adding up. A LoRA read each time
(not kept) has no block: its factors are copied one by one on the caller's stream.
"""

from __future__ import annotations

from typing import Any

import torch

from nostall.adapters.lora import Lora

__all__ = ["CHUNK_BYTES", "Uploads", "device_views"]

CHUNK_BYTES = 64 << 20  # a chunk's copy: ~1.2 ms at link speed, an event after each


def device_views(
    lora: Lora, flat: torch.Tensor, ends: list[tuple[int, Any]] | None = None
) -> dict[int, tuple[torch.Tensor, Any]]:
    """``id(factor) → (its view in flat, the event of the chunk that holds it)`` for
    every factor of ``lora``, where ``flat`` is a copy of ``lora.flat`` (same layout);
    ``ends``: ``[(chunk end offset, event)]`` in order (``None``: no events)."""
    assert lora.flat is not None
    start = lora.flat.data_ptr()
    out: dict[int, tuple[torch.Tensor, Any]] = {}
    for x in lora.layers:
        for t in (x.down, x.up, x.bias):
            if t is None:
                continue
            off = t.data_ptr() - start
            end = off + t.nbytes
            event = next((e for b, e in ends if b >= end), None) if ends else None
            out[id(t)] = (flat[off:end].view(t.dtype).view(t.shape), event)
    return out


class Uploads:
    """The factors of ``loras`` on each CUDA device a fuse asks for, uploaded at the
    first ask (one side stream per device, from ``stream_for``). :meth:`close` makes the
    caller's stream wait for every copy and waits for them itself: the device copies
    may be freed and the pinned blocks reused after it."""

    def __init__(self, loras: list[Lora], stream_for: Any):
        self.loras = [lora for lora in loras if lora.flat is not None]
        self.stream_for = stream_for
        self._views: dict[tuple[int, torch.device], tuple[torch.Tensor, Any]] = {}
        self._waited: set[int] = set()
        self._streams: dict[torch.device, Any] = {}
        self._keep: list[torch.Tensor] = []  # the device copies, alive until close

    def factor(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` (a factor) on ``device``, ready for the caller's stream."""
        if device.type != "cuda":
            return t.to(device)
        if device not in self._streams:
            self._upload(device)
        got = self._views.get((id(t), device))
        if got is None:  # a LoRA without a block: copied on the caller's stream
            return t.to(device, non_blocking=True)
        view, event = got
        if event is not None and id(event) not in self._waited:
            torch.cuda.current_stream(device).wait_event(event)  # its chunk has landed
            self._waited.add(id(event))
        return view

    def _upload(self, device: torch.device) -> None:
        side = self._streams[device] = self.stream_for(device)
        caller = torch.cuda.current_stream(device)
        for lora in self.loras:
            flat = lora.flat
            assert flat is not None
            copy = torch.empty(flat.numel(), dtype=torch.uint8, device=device)  # caller's
            side.wait_stream(caller)  # (the copy's memory may have been the caller's)
            ends: list[tuple[int, Any]] = []
            with torch.cuda.stream(side):
                for a in range(0, flat.numel(), CHUNK_BYTES):
                    b = min(a + CHUNK_BYTES, flat.numel())
                    copy[a:b].copy_(flat[a:b], non_blocking=True)  # pinned: asynchronous
                    event = torch.cuda.Event()
                    event.record(side)
                    ends.append((b, event))
            self._keep.append(copy)
            for key, got in device_views(lora, copy, ends).items():
                self._views[(key, device)] = got

    def close(self) -> None:
        """The caller's stream waits for every copy (a chunk no factor waited for
        included): the device copies can go back to the allocator."""
        for device, side in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(side)
            side.synchronize()  # the pinned blocks are the shelf's to reuse again
        self._keep.clear()
        self._views.clear()
