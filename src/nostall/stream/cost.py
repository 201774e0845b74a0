"""The cost model of partial residency: which blocks stream, and what a call then costs.

Pure: byte counts, a link rate and per-block compute seconds in, a :class:`Plan` out;
no torch, no clock. :mod:`nostall.stream.ring` runs what it plans, and its prediction is
checked against the measured call (``cost_model_step_error``).

**The ring's rule** (what :func:`simulate` replays). The streamed blocks, in the order a
call runs them, use ring buffers ``0, 1, …, depth-1, 0, 1, …``: block ``k`` always uses
buffer ``k % depth``. When block ``k`` has computed, its buffer is free for the next
block that uses it: ``k + depth`` in the same call, or, near the end of the call, block
``k % depth`` of the next call (so the next call's first streamed blocks arrive while
this one's last blocks compute). The copy engine serves copies in the order they are
issued, at the link rate. A block computes once the block before it has and, when
streamed, once its copy has landed. With ``depth`` or fewer streamed blocks, each keeps
its buffer: after the first call nothing moves.

**The choice** (:func:`plan`). A component gets ``budget`` device bytes for its rest,
its resident blocks and the ring (``depth`` buffers of the largest streamed block).
Blocks are streamed largest first (they free the most bytes per block), spread evenly
over the call among blocks of their size (a streamed block's copy hides behind the
compute of the resident blocks before it). Each ring depth offered is tried (one
buffer serialises each copy with the compute before it: the choice of a budget too
tight for two); with compute times known the plan predicted fastest wins, else the one
moving the fewest bytes per call, then the deepest ring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Plan", "plan", "simulate", "spread"]


@dataclass(frozen=True)
class Plan:
    """What stays and what streams for one component (see the module).

    ``streamed``: indexes of the streamed blocks (execution order); ``depth``: ring
    buffers; ``slot_bytes``: one buffer; ``resident_bytes``: the rest and the resident
    blocks; ``device_bytes``: that plus the ring; ``streamed_bytes``: what crosses the
    link per call (after the first); ``predicted_call_s``: a call's seconds in steady
    state (``None`` without compute times)."""

    streamed: tuple[int, ...]
    depth: int
    slot_bytes: int
    resident_bytes: int
    device_bytes: int
    streamed_bytes: int
    predicted_call_s: float | None = None

    @property
    def resident(self) -> bool:
        """Nothing streams: the whole component is on the device."""
        return not self.streamed

    def as_dict(self) -> dict:
        return {
            "streamed_blocks": len(self.streamed),
            "streamed": list(self.streamed),
            "depth": self.depth,
            "slot_bytes": self.slot_bytes,
            "resident_bytes": self.resident_bytes,
            "device_bytes": self.device_bytes,
            "streamed_bytes": self.streamed_bytes,
            "predicted_call_s": self.predicted_call_s,
        }


def spread(positions: Sequence[int], n: int) -> list[int]:
    """``n`` of ``positions`` (ascending), spread as evenly as they allow.

    >>> spread([0, 1, 2, 3, 4, 5, 6, 7], 2)
    [2, 6]
    """
    m = len(positions)
    if n >= m:
        return list(positions)
    if n <= 0:
        return []
    # the k-th of n evenly spaced marks over m places: the middle of its share
    return [positions[(2 * k + 1) * m // (2 * n)] for k in range(n)]


def _sharing(streamed: Sequence[int], depth: int) -> list[int]:
    """The streamed blocks whose buffer another streamed block uses too (they are copied
    every call; a buffer only one block uses keeps it)."""
    s = len(streamed)
    return [b for k, b in enumerate(sorted(streamed)) if k >= depth or k + depth < s]


def _candidates(block_bytes: Sequence[int]) -> list[list[int]]:
    """For 0, 1, … streamed blocks, which ones: largest size first, each size's
    blocks spread evenly over the call."""
    sizes = sorted(set(block_bytes), reverse=True)
    out: list[list[int]] = [[]]
    taken: list[int] = []
    for size in sizes:
        where = [i for i, b in enumerate(block_bytes) if b == size]
        for n in range(1, len(where) + 1):
            out.append(sorted(taken + spread(where, n)))
        taken += where
    return out


def simulate(
    block_bytes: Sequence[int],
    streamed: Sequence[int],
    depth: int,
    *,
    link_bytes_s: float,
    compute_s: Sequence[float],
    between_s: float = 0.0,
) -> float:
    """Seconds of one call in steady state (the second of two back to back, with
    ``between_s`` of other work between them) under the ring's rule (see the module):
    blocks computing ``compute_s`` each, the streamed ones' bytes over a link of
    ``link_bytes_s``."""
    if len(compute_s) != len(block_bytes):
        raise ValueError("one compute time per block")
    if depth < 1 or link_bytes_s <= 0:
        raise ValueError("depth >= 1 and a link rate > 0")
    order = sorted(streamed)
    where = {b: k for k, b in enumerate(order)}  # block -> streamed index
    s = len(order)
    if s <= depth:  # each keeps its buffer: nothing moves after the first call
        return float(sum(compute_s)) + between_s
    copy_free = 0.0
    landed: dict[int, float] = {}  # streamed index -> when its bytes have landed
    for k in range(depth):  # the first call's first blocks, issued at once
        copy_free += block_bytes[order[k]] / link_bytes_s
        landed[k] = copy_free
    t = 0.0
    starts = []
    for _call in range(2):
        starts.append(t)
        nxt: dict[int, float] = {}
        for i, c in enumerate(compute_s):
            k = where.get(i)
            if k is not None:
                t = max(t, landed[k])
            t += c
            if k is None:
                continue
            # its buffer is free: the next block to use it is issued now
            after = k + depth if k + depth < s else k % depth
            if after == k:  # the only block of its buffer: it stays
                nxt[k] = 0.0
                continue
            start = max(copy_free, t)
            copy_free = start + block_bytes[order[after]] / link_bytes_s
            (landed if k + depth < s else nxt)[after] = copy_free
        landed = nxt
        t += between_s
    return t - starts[1]


def plan(
    block_bytes: Sequence[int],
    rest_bytes: int,
    budget: int,
    *,
    link_bytes_s: float,
    compute_s: Sequence[float] | None = None,
    depths: Sequence[int] = (1, 2, 3),
    between_s: float = 0.0,
) -> Plan | None:
    """What to stream so that the component fits ``budget`` device bytes (see the
    module); ``None`` when it cannot (its rest and a ring of its largest block do not
    fit even with every block streamed)."""
    best: tuple[tuple, Plan] | None = None
    total = sum(block_bytes)
    for streamed in _candidates(block_bytes):
        out = sum(block_bytes[i] for i in streamed)
        resident = rest_bytes + total - out
        for depth in sorted(set(depths)) if streamed else [0]:
            slot = max((block_bytes[i] for i in streamed), default=0)
            device = resident + depth * slot
            if device > budget:
                continue
            moved = sum(block_bytes[i] for i in _sharing(streamed, depth))
            predicted = None
            if compute_s is not None:
                predicted = simulate(
                    block_bytes,
                    streamed,
                    max(depth, 1),
                    link_bytes_s=link_bytes_s,
                    compute_s=compute_s,
                    between_s=between_s,
                )
            p = Plan(tuple(streamed), depth, slot, resident, device, moved, predicted)
            # unknown compute: the fewest bytes moved, then the fewest blocks streamed,
            # then the deepest ring (the most overlap) that fits
            n = len(streamed)
            key = (predicted, moved, n, device) if predicted is not None else (moved, n, -depth)
            if best is None or key < best[0]:
                best = (key, p)
    return None if best is None else best[1]
