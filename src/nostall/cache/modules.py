"""Persistent modules: built once on ``meta``, then pointed at device slots.

An instance is one module object of one architecture. Its parameters are views into
the device tier; binding it to a slot points them there (``adopt``: new ``Parameter``
objects over the slot's bytes, no copy). Two facts keep switches cheap:

* a component that goes back to the offset it had (the device tier places it there
  when that range is free) finds its instance's views still right: nothing to bind;
* a same-architecture switch copies the new weights into the slot the instance
  already views: its parameters, and any graph ``torch.compile`` captured over them,
  stay as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from nostall.assemble import (
    adopt,
    as_stored_dtypes,
    build_empty,
    resolve_model_class,
    target_dtypes,
)
from nostall.cache.device import Slot
from nostall.quant.modules import install_fp8, prepare_fp8
from nostall.store.catalog import ComponentEntry
from nostall.transfer.plan import LoadPlan

__all__ = ["Instance", "Instances", "build_instance"]


@dataclass(eq=False)
class Instance:
    """One module of architecture ``arch``.

    ``digest``: the content its parameters hold (or will once the copies end);
    ``slot``: its slot in the device tier while resident; ``offset``: the slot offset
    its parameter views point at (kept after eviction: if the content comes back
    there, the views are right again).
    """

    arch: str
    module: nn.Module
    targets: dict[str, torch.dtype] | None
    digest: str | None = None
    slot: Slot | None = None
    offset: int | None = None
    build_s: float = field(default=0.0)
    fp8: bool = False  # FP8 weights: adopted with their scales (nostall.quant.modules)
    partly: bool = False  # its views are a partial layout's (not the whole one's)
    # a paused call's module while its pipeline is parked: kept for ``digest`` alone (no
    # other component is copied into it or given it), so the call goes on with it
    parked: bool = False
    partial: Any = None  # resident in part: its layout and ring (cache.partial.Partial)

    def bind(
        self,
        tensors: dict[str, torch.Tensor],
        slot: Slot,
        c: ComponentEntry,
        device: torch.device,
        *,
        partial: Any = None,
    ) -> float:
        """Point the parameters at ``tensors`` (views of ``slot``); returns the seconds it
        took (zero when they already point there). ``partial``: the slot's partial
        layout (the streamed blocks' tensors view its ring buffers)."""
        self.slot, self.digest = slot, c.digest
        self.partial = partial
        if self.offset == slot.offset and partial is None and not self.partly:
            return 0.0
        self.partly = partial is not None
        t = time.perf_counter()
        scales: dict[str, torch.Tensor] = {}
        if self.fp8:
            # Metadata only: no tensor is read here (the copies may still be running).
            metadata = {k: v for f in c.checkpoint.files for k, v in f.metadata.items()}
            tensors, scales = prepare_fp8(tensors, metadata, path=c.folder)
        adopt(self.module, tensors, device=device, strict=True, path=c.folder)
        if scales:
            # Nothing may be read here: a layer needing its FP8 weight dequantized is refused.
            install_fp8(self.module, scales, path=c.folder, dequantize_kept=False)
        self.offset = slot.offset
        return time.perf_counter() - t


def build_instance(c: ComponentEntry, dtype: torch.dtype | None) -> Instance:
    """Build ``c``'s module on ``meta`` (no init, no weights) and its per-tensor dtypes."""
    t = time.perf_counter()
    cls = resolve_model_class(c.folder)
    module = build_empty(cls, c.folder, dtype=dtype)
    if dtype is not None:
        targets = target_dtypes(module, dtype)
    else:  # as stored, but what diffusers keeps in float32 (as_stored_dtypes)
        targets = as_stored_dtypes(module, {e.name: e.dtype for _, e in c.checkpoint.entries()})
    fp8 = {e.name for _, e in c.checkpoint.entries() if e.dtype.startswith("F8")}
    if fp8:
        # FP8 weights keep their dtype; their scales arrive as float32, cast on the way
        # in, so installing them later reads nothing while the copies run.
        targets = {k: v for k, v in (targets or {}).items() if k not in fp8}
        for _, e in c.checkpoint.entries():
            if e.name.endswith("_scale") and e.dtype != "F32":
                targets[e.name] = torch.float32
    inst = Instance(c.arch or c.digest, module, targets, fp8=bool(fp8))
    inst.build_s = time.perf_counter() - t
    return inst


class Instances:
    """Every module built so far, by architecture, and each component's load plan;
    which instance views which slot. The owner locks.

    ``dtype``: as :func:`build_instance`; ``mirror_file``: the plans' host layout for
    a CPU device (:class:`~nostall.transfer.plan.LoadPlan`).
    """

    def __init__(self, dtype: torch.dtype | None, *, mirror_file: bool):
        self.dtype = dtype
        self.mirror_file = mirror_file
        self._by_arch: dict[str, list[Instance]] = {}
        self._plans: dict[str, LoadPlan] = {}
        # what a component's calls took when it last streamed (its next plan's compute)
        self.timings: dict[str, dict[str, Any]] = {}

    def plan(self, c: ComponentEntry) -> tuple[LoadPlan, float]:
        """``c``'s load plan, and the seconds its first call spent beyond building the
        module (which the module's ``build_s`` reports)."""
        plan = self._plans.get(c.digest)
        if plan is not None:
            return plan, 0.0
        t = time.perf_counter()
        insts = self._by_arch.get(c.arch or c.digest)
        if not insts:
            insts = self._by_arch[c.arch or c.digest] = [build_instance(c, self.dtype)]
        plan = self._plans[c.digest] = LoadPlan(
            c.checkpoint, insts[0].targets, mirror_file=self.mirror_file
        )
        return plan, time.perf_counter() - t - insts[0].build_s

    def template(self, c: ComponentEntry) -> Instance:
        """An instance of ``c``'s architecture (after :meth:`plan`): its module and
        dtypes describe every instance of it."""
        return self._by_arch[c.arch or c.digest][0]

    def streaming(self) -> set[str]:
        """The digests resident in part (their rings read the host tier's copies)."""
        return {
            i.digest for insts in self._by_arch.values() for i in insts if i.partial is not None
        }

    def planned(self, digest: str) -> LoadPlan | None:
        return self._plans.get(digest)

    def clear(self) -> None:
        """Forget every module (their parameters view the device tier: a module kept
        here keeps the whole tier's memory) and every plan; rings stop streaming."""
        for insts in self._by_arch.values():
            for inst in insts:
                if inst.partial is not None:
                    inst.partial.stop()
                    inst.partial = None
        self._by_arch.clear()
        self._plans.clear()

    def idle(self, c: ComponentEntry, evictable: Callable[[Slot], bool]) -> list[Instance]:
        """Resident instances of ``c``'s architecture whose slots may be taken."""
        return [
            i
            for i in self._by_arch[c.arch or c.digest]
            if i.slot is not None
            and i.slot.ready
            and not i.parked
            and i.partial is None  # (its slot holds a part: no whole component fits)
            and evictable(i.slot)
        ]

    def take(self, c: ComponentEntry, slot: Slot) -> Instance:
        """An instance of ``c``'s architecture for the new ``slot``: preferably one that
        already views ``c`` or that offset (nothing to re-point), else any free one, else
        a new one."""
        insts = self._by_arch[c.arch or c.digest]
        free = [i for i in insts if i.slot is None and (not i.parked or i.digest == c.digest)]
        # (a parked one first: the paused call goes on with that very module)
        mine = sorted((i for i in free if i.digest == c.digest), key=lambda i: not i.parked)
        inst = next(iter(mine), None) or next((i for i in free if i.offset == slot.offset), None)
        if inst is None:
            inst = free[0] if free else build_instance(c, self.dtype)
            if inst not in insts:
                insts.append(inst)
        inst.slot = slot
        return inst

    def parked_for(self, c: ComponentEntry) -> bool:
        """Whether a module is kept aside for ``c`` (it must come back into that one)."""
        return any(i.parked and i.digest == c.digest for i in self._by_arch[c.arch or c.digest])

    def viewing(self, digest: str) -> Instance | None:
        """The instance whose slot holds ``digest`` (``None``: not on the device)."""
        for insts in self._by_arch.values():
            for inst in insts:
                if inst.digest == digest and inst.slot is not None:
                    return inst
        return None

    def holding(self, c: ComponentEntry) -> Instance:
        """The instance whose slot holds ``c``."""
        return next(i for i in self._by_arch[c.arch or c.digest] if i.digest == c.digest and i.slot)

    def unbind(self, slot: Slot) -> list[Any]:
        """``slot`` left the device tier: no instance views it any more (a ring streaming
        into it stops). Returns the events its next copies must wait for."""
        events: list[Any] = []
        for insts in self._by_arch.values():
            for inst in insts:
                if inst.slot is slot:
                    inst.slot = None
                    if inst.partial is not None:
                        measured = inst.partial.measured()
                        if measured is not None:
                            self.timings[inst.digest] = measured
                        events += inst.partial.stop()
                        inst.partial = None
        return events

    def booted(self) -> None:
        """Building paid at boot is not reported by the first switch."""
        for insts in self._by_arch.values():
            for inst in insts:
                inst.build_s = 0.0
