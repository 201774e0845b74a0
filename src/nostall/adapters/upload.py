"""A fuse's LoRA factors on the GPU: each kept LoRA's one pinned block copied once per
change, in chunks on a side stream, while the fuse's multiply-adds run on the caller's
stream, each waiting only for the chunk that holds its factors.

A LoRA kept by the shelf has its factors packed in one pinned block (``Lora.flat``); a
rank-64 FLUX LoRA is 523 MB, 9.5 ms over the link, about as long as the 418 fused
multiply-adds it feeds, so the two overlap instead of adding up. A LoRA read each time
(not kept) has no block: its factors are copied one by one on the caller's stream.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from nostall.adapters.lora import Lora

__all__ = ["CHUNK_BYTES", "Uploads"]

CHUNK_BYTES = 64 << 20  # a chunk's copy: ~1.2 ms at link speed, an event after each


@dataclass
class _Copy:
    start: int  # the host block's address
    size: int
    device: torch.Tensor  # uint8, the block's copy on the GPU
    ends: list[int]  # each chunk's end offset, in order
    events: list[Any]  # each chunk's event, recorded on the side stream after its copy


class Uploads:
    """The factors of ``loras`` on each CUDA device a fuse asks for, uploaded at the
    first ask (one side stream per device, from ``stream_for``). :meth:`close` makes the
    caller's stream wait for every copy and waits for them itself: the device copies
    may be freed and the pinned blocks reused after it."""

    def __init__(self, loras: list[Lora], stream_for: Any):
        self.loras = [lora for lora in loras if lora.flat is not None]
        self.stream_for = stream_for
        self._copies: dict[torch.device, list[_Copy]] = {}
        self._streams: dict[torch.device, Any] = {}
        self._waited: set[int] = set()

    def locate(self, t: torch.Tensor, device: torch.device) -> tuple[int, Any] | None:
        """Where factor ``t`` is on ``device`` (a CUDA device): ``(address, (lora, chunk))``
        (the key orders the chunks as they land), or ``None`` for a factor of a LoRA
        without a block. The caller waits for the chunk (:meth:`wait`) before reading."""
        copies = self._copies.get(device)
        if copies is None:
            copies = self._upload(device)
        ptr = t.data_ptr()
        for i, c in enumerate(copies):
            if c.start <= ptr < c.start + c.size:
                off = ptr - c.start
                return c.device.data_ptr() + off, (i, bisect.bisect_left(c.ends, off + t.nbytes))
        return None

    def device_base(self, device: torch.device, index: int) -> int:
        """The device address of LoRA ``index``'s block copy (of :attr:`loras`)."""
        copies = self._copies.get(device)
        if copies is None:
            copies = self._upload(device)
        return copies[index].device.data_ptr()

    def wait(self, device: torch.device, key: tuple[int, int]) -> None:
        """The caller's stream waits until chunk ``key`` (from :meth:`locate`) landed."""
        event = self._copies[device][key[0]].events[key[1]]
        if id(event) not in self._waited:
            torch.cuda.current_stream(device).wait_event(event)
            self._waited.add(id(event))

    def factor(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` (a factor) on ``device``, ready for the caller's stream."""
        if device.type != "cuda":
            return t.to(device)
        got = self.locate(t, device)
        if got is None:  # a LoRA without a block: copied on the caller's stream
            return t.to(device, non_blocking=True)
        address, key = got
        self.wait(device, key)
        c = self._copies[device][key[0]]
        off = address - c.device.data_ptr()
        return c.device[off : off + t.nbytes].view(t.dtype).view(t.shape)

    def _upload(self, device: torch.device) -> list[_Copy]:
        side = self._streams[device] = self.stream_for(device)
        caller = torch.cuda.current_stream(device)
        copies = self._copies[device] = []
        for lora in self.loras:
            flat = lora.flat
            assert flat is not None
            copy = torch.empty(flat.numel(), dtype=torch.uint8, device=device)  # caller's
            side.wait_stream(caller)  # (the copy's memory may have been the caller's)
            ends, events = [], []
            with torch.cuda.stream(side):
                for a in range(0, flat.numel(), CHUNK_BYTES):
                    b = min(a + CHUNK_BYTES, flat.numel())
                    copy[a:b].copy_(flat[a:b], non_blocking=True)  # pinned: asynchronous
                    event = torch.cuda.Event()
                    event.record(side)
                    ends.append(b)
                    events.append(event)
            copies.append(_Copy(flat.data_ptr(), flat.numel(), copy, ends, events))
        return copies

    def close(self) -> None:
        """The caller's stream waits for every copy (a chunk no factor waited for
        included), and so does this thread: the device copies can go back to the
        allocator, the pinned blocks to the shelf."""
        for device, side in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(side)
            side.synchronize()
        self._copies.clear()
