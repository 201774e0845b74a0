"""What a switch did: per component, the tier that served it and what each phase cost.

The words are the seed's: **read** (disk → host memory), **copy** (host → device),
**build** (module construction on ``meta`` and re-pointing parameters). A component
found on the device costs nothing; one in the host tier costs a copy; one on disk
costs a read and a copy, overlapped chunk by chunk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CacheStats", "ComponentSwitch", "SwitchReport", "human_bytes"]


def human_bytes(n: int) -> str:
    """``23.78 GB``, ``277.1 kB``: sizes in a table, readable at every scale."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class ComponentSwitch:
    """One component of one switch.

    Attributes:
        role: its name in the pipeline (``"transformer"``).
        class_name: the module's class.
        digest: the first 12 hex digits of its key (its content digest, or until that is
            known a digest of its files' identities: :mod:`nostall.store.catalog`).
        nbytes: its weights' bytes on the device.
        tier: where it came from: ``"gpu"`` (already there; ``"device"`` on a CPU cache),
            ``"host"`` (the pinned host tier), ``"disk"`` (read; the OS page cache may
            have served it).
        cached: for ``"disk"``, whether the bytes were kept in the host tier.
        in_place: copied into a resident module of the same architecture (its
            storage, and any compiled graph, unchanged).
        read_s: storage → host memory, reads overlapping the copies.
        copy_s: host → device on the copy stream (first to last copy).
        build_s: building the module (first time only) and pointing its parameters
            at the new memory.
        hashed: for ``"disk"``, whether the reads also hashed every byte (the first
            read of files the digest index did not know).
        streamed: resident in part (:mod:`nostall.cache.partial`): the bytes of its
            blocks streamed from the host tier on every call (0: resident whole).
    """

    role: str
    class_name: str
    digest: str
    nbytes: int
    tier: str
    cached: bool = False
    in_place: bool = False
    read_s: float = 0.0
    copy_s: float = 0.0
    build_s: float = 0.0
    hashed: bool = False
    streamed: int = 0

    @property
    def moved(self) -> int:
        return 0 if self.tier in ("gpu", "device") else self.nbytes


@dataclass(frozen=True)
class SwitchReport:
    """One switch to ``pipeline``: ``total_s`` from the call to a pipeline ready on the device.

    ``wait_s`` is the part spent waiting for room (pipelines in use elsewhere) or for a
    prefetch of the same pipeline to finish; ``evicted`` names the components (role
    and digest) that left the device tier to make room; ``left_out`` the roles the
    caller asked to leave out (``use(..., without=...)``). ``expert``: the switch (or
    prefetch) of one expert of a two-expert pipeline inside its ``use()`` block
    (:mod:`~nostall.cache.experts`), not a switch to the pipeline.
    """

    pipeline: str
    device: str
    total_s: float
    components: tuple[ComponentSwitch, ...]
    evicted: tuple[str, ...] = ()
    prefetch: bool = False
    wait_s: float = 0.0
    left_out: tuple[str, ...] = ()
    expert: bool = False

    @property
    def moved_bytes(self) -> int:
        return sum(c.moved for c in self.components)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.components)

    @property
    def gbps(self) -> float:
        return self.moved_bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def line(self) -> str:
        """One line for a log: ``switch to flux: 0.823 s, 33.74 GB moved (vae=host, …)``."""
        return (
            f"{'prefetch ' if self.prefetch else ''}switch to {self.pipeline}: "
            f"{self.total_s:.3f} s, {self.moved_bytes / 1e9:.2f} GB moved ("
            + ", ".join(f"{c.role}={c.tier}" for c in self.components)
            + ")"
        )

    def as_dict(self) -> dict:
        d = asdict(self)
        d["moved_bytes"] = self.moved_bytes
        d["gbps"] = self.gbps
        return d

    def table(self):
        """A ``rich`` table of the components (``nostall switch`` prints one per switch)."""
        from rich.table import Table

        title = (
            f"{'prefetch ' if self.prefetch else ''}switch → {self.pipeline} on {self.device}: "
            f"{self.total_s:.3f} s, moved {human_bytes(self.moved_bytes)} of {human_bytes(self.nbytes)}"
            + (f" ({self.gbps:.1f} GB/s)" if self.moved_bytes and self.gbps >= 0.1 else "")
        )
        table = Table(title=title, title_justify="left")
        for col in ("component", "class", "size", "tier", "read s", "copy s", "build s", "note"):
            table.add_column(
                col, justify="left" if col in ("component", "class", "tier", "note") else "right"
            )
        for c in self.components:
            note = []
            if c.in_place:
                note.append("in place")
            if c.streamed:
                note.append(f"resident in part: {human_bytes(c.streamed)} streamed per call")
            if c.tier == "disk":
                note.append("kept in host tier" if c.cached else "not admitted to host tier")
                if c.hashed:
                    note.append("hashed")
            table.add_row(
                c.role,
                c.class_name,
                human_bytes(c.nbytes),
                c.tier,
                f"{c.read_s:.3f}" if c.tier == "disk" else "-",
                f"{c.copy_s:.3f}" if c.moved else "-",
                f"{c.build_s:.3f}" if c.build_s else "-",
                ", ".join(note),
            )
        caption = []
        if self.left_out:
            caption.append(f"left out: {', '.join(self.left_out)}")
        if self.evicted:
            caption.append(f"evicted from the device: {', '.join(self.evicted)}")
        if caption:
            table.caption = "; ".join(caption)
        return table


@dataclass(frozen=True)
class CacheStats:
    """Bytes of distinct components resident per tier, and each known component's tier.

    Attributes:
        gpu_bytes: weights in the device tier (ready to run); on a CPU cache, the modules'
            own memory.
        host_bytes: weights in the pinned host tier (bytes as on disk).
        components: ``digest → {"tier", "roles", "pipelines", "bytes", "in_use"}`` for
            every component of every pipeline switched to so far; ``tier`` is the
            fastest that holds it: ``"gpu"``, ``"host"`` or ``"disk"``.
        lora_budget, lora_bytes: the host memory kept for LoRAs read, and what they
            take now (host_budget is the components' share).
        lora_base_bytes: the base copies of weights fused LoRAs changed, by where they
            are kept (``"cuda:0"``: beside the weights; ``"cpu"``: host memory).
    """

    device: str
    gpu_budget: int
    gpu_bytes: int
    host_budget: int
    host_bytes: int
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    lora_budget: int = 0
    lora_bytes: int = 0
    lora_base_bytes: dict[str, int] = field(default_factory=dict)


def collect_stats(cache: Any) -> CacheStats:
    """:meth:`ModelCache.stats <nostall.cache.ModelCache.stats>`, under its lock: each
    known component's tier, roles, pipelines, bytes and whether a block holds it."""
    host = cache._host.resident()
    ready = {d: s for d, s in cache._tier.slots.items() if s.ready}
    comps: dict[str, dict[str, Any]] = {}
    host_bytes = 0
    for d, roles in cache._roles.items():
        plan = cache._modules.planned(d)
        disk = plan.checkpoint.nbytes if plan is not None else 0
        if d in host:
            host_bytes += disk
        slot = ready.get(d)
        comps[d] = {
            "tier": "gpu" if slot else "host" if d in host else "disk",
            "roles": sorted({r for _, r in roles}),
            "pipelines": sorted({p for p, _ in roles}),
            "bytes": disk,
            "in_use": bool(slot and slot.uses),
        }
    return CacheStats(
        device=str(cache.device),
        gpu_budget=cache._tier.budget,
        gpu_bytes=sum(s.nbytes for s in ready.values()),
        host_budget=cache._host.budget,
        host_bytes=host_bytes,
        components=comps,
        lora_budget=cache._shelf.budget,
        lora_bytes=cache._shelf.nbytes(),
        lora_base_bytes=cache._fusions.base_bytes(),
    )
