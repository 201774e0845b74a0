"""LoRAs fused into the weights of resident modules, and the base restored bit for bit.

A fused LoRA costs nothing per step (the forward is the base's, with other weights) and
keeps a compiled graph valid: the weights change in place, their storage does not. For
each weight it changes, :class:`Fusions` keeps a copy of the base bytes, on the weight's
own device when it has room for them (``room``: the model cache keeps the activation
reserve free), else in host memory; switching to other LoRAs restores those bytes and
fuses the new ones (``W = W0 + Σ weight · scale · B @ A``), so the base comes back
exactly, whatever was fused before. A change ends with its stream synchronised: the
weights are whole for a caller on any stream, and the LoRA's host factors are free to
reuse.

Callers that run a module take its state with :meth:`Fusions.enter` and give it back
with :meth:`Fusions.leave`: a module whose users want other LoRAs waits until they have
left (two requests never mix adapters), and a module the model cache reloads from its
tiers is base again (:meth:`Fusions.reloaded`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from nostall.adapters import kernels
from nostall.adapters.kernels import (
    Item,
    Tables,
    fused_addmm,
    group_fits,
    group_tables,
    launch_group,
)
from nostall.adapters.lora import Lora, LoraLayer, submodule
from nostall.adapters.upload import Uploads

__all__ = ["Fusions", "Wanted"]

log = logging.getLogger(__name__)

# what one module should hold: ((lora path, lora identity, weight), ...) in order
Wanted = tuple[tuple[str, Any, float], ...]
_CHANGING: Any = (("<changing>", None, 0.0),)  # a state no caller wants


@dataclass(eq=False)
class _State:
    module: torch.nn.Module
    applied: Wanted = ()
    users: int = 0
    base: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)  # param -> base bytes
    subs: dict[str, Any] = field(default_factory=dict)  # layer name -> submodule, found once
    # bumped whenever the set of base copies changes: a launch plan is for one generation
    generation: int = 0
    plans: dict[tuple, _Plan] = field(default_factory=dict)


class Fusions:
    """The fused state of every module LoRAs were fused into. Thread-safe."""

    def __init__(
        self, wait_s: float = 600.0, room: Callable[[torch.device, int], bool] | None = None
    ):
        self.wait_s = wait_s
        # whether ``n`` more bytes of base copies may stay on a device (default: yes)
        self.room = room or (lambda device, n: True)
        self._side: dict[torch.device, Any] = {}  # a copy stream per GPU (Uploads)
        self._states: dict[int, _State] = {}
        self._cond = threading.Condition()

    def _state(self, module: torch.nn.Module) -> _State:
        st = self._states.get(id(module))
        if st is None or st.module is not module:
            st = self._states[id(module)] = _State(module)
        return st

    def enter(
        self, modules: dict[str, torch.nn.Module], loras: list[tuple[Lora, float]]
    ) -> list[torch.nn.Module]:
        """Make each of ``modules`` (role → module) hold exactly the layers of ``loras``
        (with their weights) for its role, and count the caller as a user of each; returns
        the modules to :meth:`leave`. Waits while other users hold a module in another
        state."""
        by_role: dict[str, list[tuple[LoraLayer, float]]] = {}
        wanted: dict[str, list[tuple[str, Any, float]]] = {}
        for lora, w in loras:
            for x in lora.layers:
                by_role.setdefault(x.role, []).append((x, w))
            for role in lora.roles:
                wanted.setdefault(role, []).append((lora.path, id(lora), float(w)))
        items = [(m, tuple(wanted.get(role, ())), role) for role, m in sorted(modules.items())]
        taken = self._take_all(items)
        entered = [st.module for st, _, _ in taken]
        uploads = Uploads([lora for lora, _ in loras], self._stream)
        try:
            for (st, want, change), (_, _, role) in zip(taken, items, strict=True):
                if change:
                    self._change(st, want, by_role.get(role, []), uploads)
        except BaseException:
            self.leave(entered)
            raise
        finally:
            uploads.close()
        return entered

    def _stream(self, device: torch.device) -> Any:
        with self._cond:
            if device not in self._side:
                self._side[device] = torch.cuda.Stream(device)
            return self._side[device]

    def _take_all(
        self, items: list[tuple[torch.nn.Module, Wanted, str]]
    ) -> list[tuple[_State, Wanted, bool]]:
        """Count the caller as a user of every module of ``items`` at once, once each is
        free or already as wanted (all or none: two callers wanting two shared modules in
        other states never hold one each and wait for the other); per module, whether
        the caller must change it (then no one else uses it until :meth:`_change` ends)."""
        with self._cond:
            states = [(self._state(m), want) for m, want, _ in items]
            if not self._cond.wait_for(
                lambda: all(st.users == 0 or st.applied == w for st, w in states),
                timeout=self.wait_s,
            ):
                from nostall.errors import BusyError

                busy = [type(st.module).__name__ for st, w in states if st.applied != w]
                raise BusyError(
                    f"{', '.join(busy)} stayed in use with other LoRAs for {self.wait_s:.0f} s"
                )
            out = []
            for st, want in states:
                st.users += 1
                change = st.applied != want
                if change:
                    st.applied = _CHANGING  # matches no one's wish: later callers wait
                out.append((st, want, change))
            return out

    def _change(
        self, st: _State, want: Wanted, layers: list[tuple[LoraLayer, float]], uploads: Uploads
    ) -> None:
        try:
            _fuse(st, layers, self.room, uploads, want)
            done = want
        except BaseException:
            done = _CHANGING if st.base else ()  # half fused: never matches, refused next
            raise
        finally:
            with self._cond:
                st.applied = done
                self._cond.notify_all()

    def leave(self, modules: Iterable[torch.nn.Module]) -> None:
        with self._cond:
            for m in modules:
                st = self._states.get(id(m))
                if st is not None and st.module is m and st.users > 0:
                    st.users -= 1
            self._cond.notify_all()

    def reloaded(self, modules: Iterable[torch.nn.Module]) -> None:
        """``modules`` were just given their base weights again (the cache copied them in
        from its tiers): nothing is fused in them now."""
        with self._cond:
            for m in modules:
                st = self._states.get(id(m))
                if st is not None and st.module is m:
                    st.applied, st.base = (), {}
                    st.generation += 1
                    st.plans.clear()

    def clear(self) -> None:
        with self._cond:
            self._states.clear()

    def base_bytes(self) -> dict[str, int]:
        """Bytes of base copies kept now, by where they are (``"cuda:0"``, ``"cpu"``)."""
        out: dict[str, int] = {}
        with self._cond:
            for st in self._states.values():
                for copy in st.base.values():
                    out[str(copy.device)] = out.get(str(copy.device), 0) + copy.nbytes
        return out


@torch.no_grad()
def _fuse(
    st: _State,
    layers: list[tuple[LoraLayer, float]],
    room: Callable[[torch.device, int], bool] = lambda device, n: True,
    uploads: Uploads | None = None,
    want: Wanted = (),
) -> None:
    """Make ``st.module``'s weights its base plus ``layers`` (the caller is the only
    user): a weight both the old and the new LoRAs touch is written once, from its base
    copy (``W = W0 + Σ weight · scale · B @ A``: one ``addmm`` from the copy into the
    weight, the next LoRA's added in place); a weight only the old ones touched gets its
    base bytes back. Every weight written has its base copy in ``st.base`` first, so a
    failure half way leaves nothing a later call cannot restore."""
    module = st.module
    key = _Plan.key(uploads, want) if uploads is not None else None
    plan = st.plans.get(key) if key is not None else None
    if plan is not None and plan.valid(st, uploads):
        # The same LoRAs onto the same weights, from the same base copies, as a fuse that
        # launched every weight: its launches again, the factors' new copy's address added.
        plan.run(uploads)
        _synchronize(plan.devices)
        return
    wanted: dict[torch.Tensor, list[tuple[LoraLayer, float]]] = {}
    biases: dict[torch.Tensor, list[tuple[LoraLayer, float]]] = {}
    for x, w in layers:
        sub = st.subs.get(x.module)
        if sub is None:
            sub = st.subs[x.module] = submodule(module, x.module)  # (check_fits found it)
        wanted.setdefault(sub.weight, []).append((x, w))
        if x.bias is not None and getattr(sub, "bias", None) is not None:
            biases.setdefault(sub.bias, []).append((x, w))
    touched = {p.device for p in (*wanted, *biases, *st.base)}
    new = [p for p in (*wanted, *biases) if p not in st.base]
    devices = {p.device for p in new}
    host = {d for d in devices if not room(d, sum(p.nbytes for p in new if p.device == d))}
    launches = _Launches(uploads) if uploads is not None else None  # the grouped kernel's
    alone = 0  # weights written one by one (no plan then)
    if new or any(p not in wanted and p not in biases for p in st.base):
        st.generation += 1  # the base copies change below: plans of the old set are void
        st.plans.clear()
    for param, parts in (*wanted.items(), *biases.items()):
        base = st.base.get(param)
        if base is None:
            # the base bytes, kept where there is room: beside the weight, or in host memory
            far = param.device in host
            base = param.detach().to("cpu", copy=True) if far else param.detach().clone()
            st.base[param] = base
        if param in biases and parts is biases[param]:
            param.copy_(base)
            for x, w in parts:
                param.add_(x.bias.to(param.device, param.dtype), alpha=w * x.scale)
            alone += 1
        elif launches is None or not _join(param, base, parts, uploads, launches):
            _write(param, base, parts, uploads)
            alone += 1
    if launches is not None:
        launches.finish()
    for param in [p for p in st.base if p not in wanted and p not in biases]:
        param.copy_(st.base.pop(param))
    if key is not None and launches is not None and launches.plannable() and not alone:
        if len(st.plans) >= 64:  # (LoRA sets in turn on one module: the oldest go)
            st.plans.pop(next(iter(st.plans)))
        st.plans[key] = _Plan.of(st, uploads, launches)
    _synchronize(touched)


def _synchronize(devices: Iterable[torch.device]) -> None:
    for dev in devices:
        if dev.type == "cuda":  # whole for callers on other streams; factors free again
            torch.cuda.current_stream(dev).synchronize()


def _join(
    param: torch.Tensor,
    base: torch.Tensor,
    parts: list[tuple[LoraLayer, float]],
    uploads: Uploads,
    launches: _Launches,
) -> bool:
    """Hand ``param = base + Σ …`` to ``launches`` if the grouped kernel can write it (a
    GPU linear weight whose factors came in one block); else ``False`` and nothing is
    done. Part ``i`` of every weight joins the launch of its chunk: the first parts read
    the base, later ones add in place, launched after every first part."""
    dev = param.device
    if dev.type != "cuda":
        return False
    found = []
    for x, w in parts:
        if x.down.ndim != 2 or not group_fits(param, x.up, x.down):
            return False
        up, down = uploads.locate(x.up, dev), uploads.locate(x.down, dev)
        if up is None or down is None:
            return False
        found.append((x, w, up, down))
    dst = param.data
    if base.device != dev:  # a base copy in host memory: copied back in, added to
        dst.copy_(base)
        base = dst
        launches.far = True
    for i, (x, w, (up, a), (down, b)) in enumerate(found):
        key = (i, *max(a, b), str(dst.dtype), str(dev))
        launches.add(
            key, (base if i == 0 else dst, up, down, w * x.scale, dst, x.rank), (param, base, parts)
        )
    return True


class _Launches:
    """The grouped kernel's launches of one fuse: the first parts of the weights whose
    factors end in one chunk go as soon as the next chunk's come (the GPU works while
    this thread walks the rest), later parts at :meth:`finish`, after every first part.
    Each launch waits for its chunk, and so for every earlier one (one copy stream). A
    kernel that cannot be built here is said once; the weights are then written one by
    one."""

    def __init__(self, uploads: Uploads):
        self.uploads = uploads
        self.groups: dict[tuple, list[tuple[Item, Any]]] = {}
        self.last: tuple | None = None
        self.launched = 0
        self.failed = False
        self.far = False  # a base copy came from host memory (copied in by this fuse)
        self.record: list[tuple[tuple, Tables]] = []  # what was launched, in order

    def plannable(self) -> bool:
        """Whether these launches alone wrote the weights, so they can be replayed."""
        return self.launched > 0 and not self.failed and not self.far and not self.groups

    def add(self, key: tuple, item: Item, weight: Any) -> None:
        if not self.failed and self.last not in (None, key) and self.last[0] == 0:
            self._run(self.last)
        if self.failed:  # (a weight's first part writes all its parts, one by one)
            if key[0] == 0:
                _write(*weight, self.uploads)
            return
        self.groups.setdefault(key, []).append((item, weight))
        self.last = key

    def finish(self) -> None:
        for key in sorted(self.groups, key=lambda k: k[:3]):
            if key in self.groups:
                self._run(key)

    def _run(self, key: tuple) -> None:
        group = self.groups.get(key)
        if group is None:
            return
        items = [item for item, _ in group]
        try:
            self.uploads.wait(items[0][0].device, key[1:3])
            tables = group_tables(items)  # (group_fits checked Triton; one dtype a key)
            if tables is None or not launch_group(tables):
                raise RuntimeError(f"the grouped kernel refused {len(items)} weights it fits")
        except Exception as e:
            if self.launched:  # weights written by launches: nothing to redo one by one
                raise
            log.warning(
                "the grouped LoRA kernel failed (%s: %s); fusing weight by weight",
                type(e).__name__,
                e,
            )
            kernels.disable()
            self.failed = True
            pending, self.groups = self.groups, {}
            for k, g in pending.items():
                if k[0] == 0:
                    for _, weight in g:
                        _write(*weight, self.uploads)
            return
        del self.groups[key]
        self.launched += 1
        self.record.append((key, tables))


@dataclass(eq=False)
class _Plan:
    """A fuse's grouped launches kept to be replayed: the same LoRAs (by identity) onto
    the same weights from the same base copies (one generation of them). The addresses
    of the factors are kept relative to their LoRA's block copy, which is a new one each
    switch; everything else (weights, base copies, shapes, scales) stays put."""

    loras: tuple[Any, ...]  # weak references to the Uploads' LoRAs, in order
    generation: int
    groups: list[tuple[tuple, Tables, torch.Tensor]]  # key, tables, relative addresses
    devices: frozenset[torch.device]

    @staticmethod
    def key(uploads: Uploads, want: Wanted) -> tuple | None:
        if not uploads.loras or not want:
            return None
        return (tuple(id(lora) for lora in uploads.loras), want)

    @classmethod
    def of(cls, st: _State, uploads: Uploads, launches: _Launches) -> _Plan:
        groups = []
        for key, tables in launches.record:
            device = tables.like.device
            rel = tables.ptrs.clone()
            rel[:, 1:3] -= uploads.device_base(device, key[1])
            groups.append((key, tables, rel))
        refs = tuple(weakref.ref(lora) for lora in uploads.loras)
        return cls(refs, st.generation, groups, frozenset(t.like.device for _, t, _ in groups))

    def valid(self, st: _State, uploads: Uploads) -> bool:
        return (
            st.generation == self.generation
            and len(self.loras) == len(uploads.loras)
            and all(ref() is lora for ref, lora in zip(self.loras, uploads.loras, strict=True))
        )

    def run(self, uploads: Uploads) -> None:
        for key, tables, rel in self.groups:
            device = tables.like.device
            ptrs = rel.clone()
            ptrs[:, 1:3] += uploads.device_base(device, key[1])
            uploads.wait(device, key[1:3])
            if not launch_group(tables, ptrs):
                raise RuntimeError("the grouped kernel refused a plan it launched before")


def _write(
    param: torch.Tensor,
    base: torch.Tensor,
    parts: list[tuple[LoraLayer, float]],
    uploads: Uploads | None = None,
) -> None:
    """``param = base + Σ weight · scale · up @ down``."""
    x, w = parts[0]
    if x.down.ndim == 2:  # a linear layer: fused multiply-adds in the weight's dtype
        dev, dt = param.device, param.dtype

        def to(t: torch.Tensor) -> torch.Tensor:  # (pinned factors: an async copy)
            if uploads is not None:
                return uploads.factor(t, dev).to(dt)
            return t.to(dev, non_blocking=True).to(dt)

        dst = param.data
        if base.device != dev:  # a base copy in host memory: copied back in, added to
            dst.copy_(base)
            base = dst
        up, down, alpha = to(x.up), to(x.down), w * x.scale
        if fused_addmm(base, up, down, alpha, dst):  # one pass over the weight
            pass
        elif base is dst:
            dst.addmm_(up, down, alpha=alpha)
        else:
            torch.addmm(base, up, down, alpha=alpha, out=dst)
        for x, w in parts[1:]:
            param.data.addmm_(to(x.up), to(x.down), alpha=w * x.scale)
        return
    # convolutions: summed in float32, rounded once
    acc = base.to(param.device, torch.float32, copy=True)
    for x, w in parts:
        acc += w * x.delta(device=acc.device)
    param.copy_(acc.to(param.dtype))
