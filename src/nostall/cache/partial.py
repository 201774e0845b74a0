"""Partial residency: a component larger than its share of the device tier, resident in
part, its other blocks streamed from the host tier through a ring each call.

When a pipeline cannot fit the device tier whole, its largest component made of
repeated blocks (:func:`~nostall.stream.blocks.find_blocks`) is given what the others
leave: :func:`partial_for` asks the cost model (:func:`nostall.stream.cost.plan`) which
blocks stream, and lays the component's slot out as its *resident part* (every tensor
but the streamed blocks', each at the alignment the whole layout gives it:
:class:`~nostall.transfer.plan.LoadPlan` with ``names``) followed by the ring's
buffers. Its bytes stay cached in the host tier (admitted whatever its request count,
and held while it streams): each streamed block is copied from there every call.

:class:`Partial` is that layout: the views the module adopts (resident tensors in the
slot; a streamed block's tensors in its ring buffer, for good), and, once the loads
have landed, the :class:`~nostall.stream.ring.BlockRing` that copies each streamed
block's bytes from the host block into its buffer ahead of its compute.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from nostall.cache.device import GRANULE
from nostall.cache.report import human_bytes
from nostall.errors import BudgetExceeded, UnsupportedError
from nostall.memory.host import round_up
from nostall.store.catalog import ComponentEntry
from nostall.stream import cost
from nostall.stream.blocks import find_blocks
from nostall.stream.ring import BlockRing, CpuStreams, CudaStreams
from nostall.stream.timing import BlockTimer
from nostall.transfer.plan import LoadPlan

__all__ = [
    "LINK_BYTES_S",
    "Partial",
    "explain",
    "host_refused",
    "least_pipeline_bytes",
    "no_loras_streamed",
    "partial_for",
    "streamed_in_switch",
]

log = logging.getLogger(__name__)

ALIGN = 256  # a ring buffer starts where a tensor of the whole layout could
_SAID: set[str] = set()  # components said to have no blocks
# module -> {(digest, mirror_file, order): _streamable's answer}; a module is one cache's
# instance of an architecture, so its dtypes are that cache's
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
LINK_BYTES_S = 50e9  # a prior of the host tier's link (H200 measured 52-55 GB/s)


@dataclass(eq=False)
class Partial:
    """One component's partial layout in its slot (see the module)."""

    plan: cost.Plan
    resident: frozenset[str]  # tensors in the resident part
    blocks: list[str]  # the streamed blocks' module names, execution order
    block_plans: list[LoadPlan]  # each one's tensors in its ring buffer
    resident_bytes: int  # the resident part, rounded up to ALIGN
    slot_bytes: int  # one ring buffer
    all_blocks: list[str] = field(default_factory=list)  # every block that can stream
    block_bytes: list[int] = field(default_factory=list)  # their bytes (plan.streamed: indexes)
    ring: BlockRing | None = None
    host: Any = None  # the host tier's block it streams from, held while it does
    events: list[Any] = field(default_factory=list)
    timer: BlockTimer | None = None  # its first calls, block by block

    def measured(self) -> dict[str, Any] | None:
        """What its first calls took (:meth:`BlockTimer.figures`), once known."""
        return self.timer.figures() if self.timer is not None else None

    @property
    def depth(self) -> int:
        return self.plan.depth

    @property
    def nbytes(self) -> int:
        """The slot's bytes: the resident part and the ring."""
        return self.resident_bytes + self.depth * self.slot_bytes

    @property
    def key(self) -> tuple:
        """Two partials with one key lay a slot out alike."""
        return (self.plan.streamed, self.depth)

    def _buffer(self, slot_view: torch.Tensor, k: int) -> torch.Tensor:
        at = self.resident_bytes + (k % self.depth) * self.slot_bytes
        return slot_view[at : at + self.slot_bytes]

    def ring_views(self, slot_view: torch.Tensor) -> dict[str, torch.Tensor]:
        """The streamed tensors as views of their blocks' ring buffers in ``slot_view``."""
        out: dict[str, torch.Tensor] = {}
        for k, bp in enumerate(self.block_plans):
            out.update(bp.views(self._buffer(slot_view, k)))
        return out

    def start(
        self, module: nn.Module, host: Any, slot_view: torch.Tensor, device: torch.device
    ) -> None:
        """Stream ``module``'s blocks from ``host`` (the host tier's block of the
        component's files, held from now on) into their buffers in ``slot_view``."""
        mods = dict(module.named_modules())
        copies = []
        for k, bp in enumerate(self.block_plans):
            buffer = self._buffer(slot_view, k)
            pairs = []
            for i, f in enumerate(bp.checkpoint.files):
                base = bp.host_base[i]
                for piece in bp.pieces(i, f.data_start, f.data_end):
                    lo, hi = base + piece.lo, base + piece.hi
                    # one copy never spans two page-lock registrations (CUDA refuses it)
                    for a, b in host.split(lo, hi):
                        at = piece.offset + a - lo
                        pairs.append((buffer[at : at + b - a], host.tensor[a:b]))
            copies.append(pairs)
        streams = CudaStreams(device) if device.type == "cuda" else CpuStreams()
        self.host = host
        self.ring = BlockRing([mods[n] for n in self.blocks], copies, self.depth, streams)
        self.ring.install(module)
        self.timer = BlockTimer(module, {n: mods[n] for n in self.all_blocks}, device)

    def stop(self) -> list[Any]:
        """Unhook the ring and let the host block go; the events the slot's next
        copies must wait for (the ring's copies still in flight)."""
        events = []
        if self.timer is not None:
            self.timer.remove()
        if self.ring is not None:
            events = [e for e in self.ring.landed if e is not None]
            self.ring.remove()
            self.ring = None
        if self.host is not None:
            for e in events:
                self.host.fence(e)
            self.host.release()
            self.host = None
        return events


def _streamable(
    c: ComponentEntry,
    module: nn.Module,
    targets: Any,
    mirror_file: bool,
    order: list[str] | None = None,
):
    """``c``'s blocks that can stream (every tensor in the checkpoint, none cast on the
    way in), each one's plan and bytes, and the bytes of the rest; ``None``: none can.
    ``order``: the blocks' names in the order a call ran them (they go in that order;
    any it does not name, after). Worked out once per module (its dtypes) and question:
    a switch asks several times, and FLUX has 57 blocks to plan."""
    memo = _MEMO.setdefault(module, {})
    key = (c.digest, mirror_file, tuple(order or ()))
    if key not in memo:
        memo[key] = _find_streamable(c, module, targets, mirror_file, order)
    return memo[key]


def _find_streamable(c, module, targets, mirror_file, order):
    names = {e.name for _, e in c.checkpoint.entries()}
    blocks, plans = [], []
    found = find_blocks(module)
    if order:
        at = {n: i for i, n in enumerate(order)}
        found.sort(key=lambda b: at.get(b.name, len(at)))
    if not found and c.digest not in _SAID:
        _SAID.add(c.digest)  # (once: whole-component residency only)
        log.info("%s: no repeated blocks: it is resident whole or not at all", c.folder)
    for b in found:
        if not b.params or not set(b.params) <= names:
            continue
        bp = LoadPlan(c.checkpoint, targets, mirror_file=mirror_file, names=frozenset(b.params))
        if bp.casts:  # (a cast is gathered on the way in: not one copy per block)
            continue
        blocks.append(b)
        plans.append(bp)
    if len(blocks) < 2:  # (one block through one buffer is the whole of it, resident)
        return None
    in_blocks = set().union(*(b.params for b in blocks))
    rest = LoadPlan(
        c.checkpoint, targets, mirror_file=mirror_file, names=frozenset(names - in_blocks)
    )
    sizes = [round_up(bp.target_bytes, ALIGN) for bp in plans]
    return names, blocks, plans, sizes, round_up(rest.target_bytes, ALIGN)


def least_bytes(c: ComponentEntry, module: nn.Module, targets: Any, *, mirror_file: bool):
    """The fewest device bytes ``c`` can be served in (every block streamed through one
    buffer), or ``None`` when it cannot stream."""
    found = _streamable(c, module, targets, mirror_file)
    return None if found is None else found[4] + max(found[3])


def largest_block(c: ComponentEntry, module: nn.Module, targets: Any, *, mirror_file: bool):
    """``(name, bytes)`` of ``c``'s largest block that can stream, or ``None``."""
    found = _streamable(c, module, targets, mirror_file)
    if found is None:
        return None
    k = max(range(len(found[3])), key=found[3].__getitem__)
    return found[1][k].name, found[3][k]


def partial_for(
    c: ComponentEntry,
    module: nn.Module,
    targets: Any,
    *,
    mirror_file: bool,
    budget: int,
    link_bytes_s: float = LINK_BYTES_S,
    measured: dict[str, Any] | None = None,
) -> Partial | None:
    """``c``'s partial layout in ``budget`` bytes (``module``: its instance, on any
    device; ``targets``: its tensors' dtypes), or ``None`` when no choice of streamed
    blocks fits (or it has no block that can stream: repeated blocks whose every tensor
    is in the checkpoint and keeps its stored dtype). ``measured``: what its calls took
    when it last streamed (:meth:`Partial.measured`): the plan predicted fastest wins,
    and says its call period."""
    found = _streamable(c, module, targets, mirror_file, (measured or {}).get("order"))
    if found is None:
        return None
    names, blocks, plans, sizes, rest = found
    compute, between = None, 0.0
    if measured is not None and all(b.name in measured["block_s"] for b in blocks):
        compute = [measured["block_s"][b.name] for b in blocks]
        between = max(0.0, measured["period_s"] - sum(compute))
    choice = cost.plan(
        sizes, rest, budget, link_bytes_s=link_bytes_s, compute_s=compute, between_s=between
    )
    if choice is None or choice.resident:
        return None
    streamed = set(choice.streamed)
    resident = frozenset(names - set().union(*(blocks[k].params for k in streamed)))
    kept = LoadPlan(c.checkpoint, targets, mirror_file=mirror_file, names=resident)
    part = Partial(
        choice,
        resident,
        [blocks[k].name for k in choice.streamed],
        [plans[k] for k in choice.streamed],
        round_up(kept.target_bytes, ALIGN),
        choice.slot_bytes,
        [b.name for b in blocks],
        list(sizes),
    )
    return part if part.nbytes <= budget else None


def streamed_in_switch(
    cache: Any, comps: list[ComponentEntry], missing: list[ComponentEntry]
) -> dict[str, Partial]:
    """Which of a switch's ``missing`` components stream, and how, when its pipeline
    (``comps``) cannot fit the device tier of ``cache`` (a
    :class:`~nostall.cache.ModelCache`, under its lock) whole (empty when it fits).

    First the components a request calls once (its text encoders, its VAE) stream all
    their blocks (largest first, while it does not fit): a byte they leave on the host
    is read once a request, a byte of the denoiser once a step. Then the largest other
    component streams what still does not fit, as the cost model chooses."""
    tier = cache._tier
    sizes = {}
    for c in comps:
        slot = tier.slots.get(c.digest)
        if slot is not None and slot.ready:
            sizes[c.digest] = slot.size
        else:
            sizes[c.digest] = tier.slot_size(cache._modules.planned(c.digest).target_bytes)
    total = sum(sizes.values())
    # what the caller's own use() blocks hold stays (as a Wan 2.2 block's other components
    # beside its expert); other callers' blocks end, and the switch may wait for them
    mine = cache._holds.mine()
    budget = tier.budget - sum(
        s.size for d, s in tier.slots.items() if d not in sizes and mine.get(d, 0)
    )
    if total <= budget:
        return {}
    mirror = cache.device.type == "cpu"
    parts: dict[str, Partial] = {}

    def part_of(c: ComponentEntry, budget: int) -> Partial | None:
        inst = cache._modules.template(c)
        return partial_for(
            c,
            inst.module,
            inst.targets,
            mirror_file=mirror,
            budget=budget,
            measured=cache._modules.timings.get(c.digest),
        )

    once = [c for c in missing if _once(c.role)]
    for c in sorted(once, key=lambda c: -sizes[c.digest]):
        if total <= budget:
            return parts
        inst = cache._modules.template(c)
        found = _streamable(c, inst.module, inst.targets, mirror)
        if found is None:
            continue
        part = part_of(c, found[4] + 2 * max(found[3]))  # all its blocks, two buffers
        if part is not None and part.nbytes + GRANULE < sizes[c.digest]:
            parts[c.digest] = part
            total += tier.slot_size(part.nbytes) - sizes[c.digest]
            sizes[c.digest] = tier.slot_size(part.nbytes)
    if total <= budget:
        return parts
    least: tuple[int, ComponentEntry] | None = None  # the smallest a part could be
    for c in sorted(missing, key=lambda c: -sizes[c.digest]):
        if c.digest in parts:
            continue
        room = budget - (total - sizes[c.digest]) - GRANULE  # (its slot is rounded up)
        part = part_of(c, room)
        if part is not None:
            return {**parts, c.digest: part}
        if least is None:
            inst = cache._modules.template(c)
            smallest = least_bytes(c, inst.module, inst.targets, mirror_file=mirror)
            if smallest is not None:
                least = (total - sizes[c.digest] + smallest, c)
    if total <= tier.budget:
        return {}  # (it fits once the caller's blocks end: the switch says they are in use)
    name = cache._describe(comps[0].digest).split("/")[0]
    how = "; none of its components has repeated blocks that could stream"
    if least is not None:
        inst = cache._modules.template(least[1])
        block, nbytes = largest_block(least[1], inst.module, inst.targets, mirror_file=mirror)
        what = cache._describe(least[1].digest)
        how = (
            f"; streaming {what}'s blocks, it needs at least {human_bytes(least[0])} (the rest "
            f"and one buffer of its largest block, {block}, {human_bytes(nbytes)})"
        )
    beside = "" if budget == tier.budget else f" ({human_bytes(budget)} beside what it holds)"
    raise BudgetExceeded(
        f"{name} needs {human_bytes(total)} on the device whole, more than the GPU tier's "
        f"{human_bytes(tier.budget)}{beside}{how}: raise gpu_budget, or load it in a smaller "
        "dtype",
        tier="gpu",
        requested=total,
        budget=tier.budget,
        in_use=0,
    )


def host_refused(what: str, plan: LoadPlan, budget: int) -> BudgetExceeded:
    """The error of a component that would stream from a host tier that cannot hold it."""
    return BudgetExceeded(
        f"{what} streams in part from the host tier, which cannot hold its "
        f"{human_bytes(plan.host_bytes)}: give a larger host_budget, or a device budget "
        "that holds it whole",
        tier="host",
        requested=plan.host_bytes,
        budget=budget,
        in_use=0,
    )


def least_pipeline_bytes(
    cache: Any,
    name: str,
    without: frozenset[str] = frozenset(),
    *,
    experts: tuple[str, str] | None = None,
) -> int | None:
    """The fewest device-tier bytes ``cache`` can serve pipeline ``name`` (less the
    roles in ``without``) in, as :func:`streamed_in_switch` would: its text encoders and
    VAE with every block streamed through two buffers, its largest other component that
    can stream through one, the rest whole; ``None`` when that other cannot stream.
    ``experts``: its two experts' roles (:func:`~nostall.cache.experts.expert_roles`),
    one at a time, its text encoders gone by then."""
    comps = cache.store.entry(name).distinct_weights(frozenset(without))
    if experts is not None:  # one expert at a time, the text encoders gone (cache.experts)
        comps = [c for c in comps if c.role != experts[1] and not c.role.startswith("text_")]
    mirror = cache.device.type == "cpu"
    with cache._lock:
        sizes = {}
        for c in comps:
            whole = cache._tier.slot_size(cache._modules.plan(c)[0].target_bytes)
            sizes[c.digest] = whole
            if _once(c.role):  # (all its blocks, two buffers: as the switch streams it)
                inst = cache._modules.template(c)
                found = _streamable(c, inst.module, inst.targets, mirror)
                if found is not None:
                    part = partial_for(
                        c,
                        inst.module,
                        inst.targets,
                        mirror_file=mirror,
                        budget=found[4] + 2 * max(found[3]),
                    )
                    if part is not None:
                        sizes[c.digest] = min(whole, cache._tier.slot_size(part.nbytes))
        total = sum(sizes.values())
        for c in sorted(comps, key=lambda c: -sizes[c.digest]):
            if _once(c.role):
                continue
            inst = cache._modules.template(c)
            least = least_bytes(c, inst.module, inst.targets, mirror_file=mirror)
            if least is not None:
                return total - sizes[c.digest] + least + GRANULE
    return None


def _once(role: str) -> bool:
    """A component a request calls once: its text encoders and its VAE (the denoiser, once
    a step)."""
    return role.startswith("text_encoder") or role == "vae"


def no_loras_streamed(cache: Any, name: str, digests: Any) -> None:
    """Refuse LoRAs on pipeline ``name`` while one of its components (``digests``)
    streams: its blocks are copied from the host tier's base weights every call, so a
    LoRA fused into them would be gone by the next."""
    with cache._lock:
        streamed = [d for d in digests if (i := cache._modules.viewing(d)) and i.partial]
    if streamed:
        raise UnsupportedError(
            f"{name}: LoRAs on a pipeline served resident in part ({cache._describe(streamed[0])} "
            "streams its blocks) are not served yet; give a device budget that holds it "
            "whole, or call it without loras"
        )


def explain(cache: Any, name: str) -> list[dict[str, Any]]:
    """For ``nostall switch --explain``: each component of pipeline ``name`` now on the
    device resident in part, with its plan (:meth:`cost.Plan.as_dict`), the streamed
    blocks' names and the ring's copies and misses so far."""
    out = []
    with cache._lock:
        for c in cache.store.entry(name).distinct_weights():
            inst = cache._modules.viewing(c.digest)
            if inst is None or inst.partial is None:
                continue
            part = inst.partial
            ring = part.ring
            out.append(
                {
                    "role": c.role,
                    **part.plan.as_dict(),
                    "blocks": list(part.blocks),
                    "all_blocks": list(part.all_blocks),
                    "block_bytes": list(part.block_bytes),
                    "copied_bytes": ring.copied_bytes if ring is not None else 0,
                    "misses": ring.misses if ring is not None else 0,
                    "measured_period_s": (part.measured() or {}).get("period_s"),
                }
            )
    return out
