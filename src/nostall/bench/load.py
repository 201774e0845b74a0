"""``nostall bench load``: FLUX-size checkpoint → GPU, nostall against its peers.

Three scenarios, all methods in the same run:

* **cold**: the page cache is dropped before each method (needs root); every drop is
  announced on the console before it happens (it evicts every cached file on the
  machine, not only ours) and listed in the report's ``page_cache_drops``;
* **page-cache hit**: the file is in the OS cache (a worker restarted);
* **memory-cache hit**: the bytes are already in nostall's pinned pool; only the
  host→device copy remains (peers have no such cache).

Beside them, the run measures its own limits: the link (pinned 4 GiB H2D) and
the disk (sequential cold read with ``dd``, buffered and ``O_DIRECT``). Every
method's tensors are compared with the reference (``safetensors.load_file`` of
the same file) and the comparison is recorded.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nostall.bench.peers import PEERS, Method, missing_requirement
from nostall.bench.record import check_new_output, header, write_report
from nostall.bench.timing import sync
from nostall.errors import ArgumentError
from nostall.memory.pool import PinnedPool
from nostall.synthetic import make_checkpoint
from nostall.transfer.loader import Loader, resolve_device

# check_new_output and write_report live in nostall.bench.record; named here for the
# callers that import them from this module.
__all__ = ["Record", "check_new_output", "run_load_bench", "write_report"]

SCENARIOS = ("cold", "page-cache", "memory-cache")


@dataclass
class Record:
    """One method in one scenario. ``seconds`` is the best run; ``runs`` all of them."""

    method: str
    scenario: str
    seconds: float | None
    gbps: float | None
    runs: list[float] = field(default_factory=list)
    equal: bool | None = None
    note: str = ""
    phases: dict[str, float] = field(default_factory=dict)


_DROP_COMMAND = "sync; echo 3 > /proc/sys/vm/drop_caches"


def drop_caches() -> str | None:
    """Drop the OS page cache; return why not when it cannot (not root, read-only /proc).

    Evicts every cached file on the machine. Callers announce it first (see
    :func:`run_load_bench`).
    """
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"cannot drop the page cache ({e.strerror}); run as root for cold numbers"


def _drop_now() -> str | None:
    # Looked up when called (run_load_bench's drop_caches flag shadows the name there).
    return drop_caches()


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _state(obj: Any) -> dict[str, torch.Tensor]:
    return obj.state_dict() if isinstance(obj, torch.nn.Module) else obj


def _equal(got: Any, ref: dict[str, torch.Tensor]) -> bool:
    sd = _state(got)
    if sd.keys() != ref.keys():
        return False
    for k, r in ref.items():
        t = sd[k]
        if t.dtype != r.dtype or t.shape != r.shape or t.device != r.device:
            return False
        # bit-level comparison (NaN-safe; fp8 has no torch.equal kernel everywhere)
        if not torch.equal(t.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)):
            return False
    return True


def link_limit(device: torch.device, nbytes: int = 4 << 30, repeat: int = 3) -> float | None:
    """Best pinned H2D rate in GB/s for one ``nbytes`` copy."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    del src, dst
    _free(device)
    return nbytes / best / 1e9


def pool_copy_rate(pool: PinnedPool, device: torch.device, nbytes: int = 4 << 30) -> float | None:
    """Best H2D rate in GB/s from a pool block (one copy per registration)."""
    if device.type != "cuda":
        return None
    nbytes = min(nbytes, pool.capacity // 2)
    block = pool.allocate(nbytes)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    try:
        for _ in range(3):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            for a, b in block.split(0, nbytes):
                dst[a:b].copy_(block.tensor[a:b], non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t)
    finally:
        block.release()
    del dst
    _free(device)
    return nbytes / best / 1e9


def expected_bytes(preset: str) -> int:
    """The checkpoint's size before it is written (to size the pool at start-up)."""
    from diffusers import FluxTransformer2DModel

    from nostall.synthetic import PRESETS

    with torch.device("meta"):
        model = FluxTransformer2DModel(**PRESETS[preset])
    return sum(p.numel() * 2 for p in model.state_dict().values()) + (1 << 20)


def disk_limit(
    path: str, *, direct: bool, drop: Callable[[str], str | None]
) -> tuple[float, float] | None:
    """Cold sequential read of ``path`` with ``dd`` (16 MiB blocks): (seconds, GB/s).

    ``drop(before)`` drops the page cache first (and says so); ``None`` if it cannot.
    """
    if drop(f"dd {'O_DIRECT' if direct else 'buffered'} read") is not None:
        return None
    cmd = ["dd", f"if={path}", "of=/dev/null", "bs=16M"] + (["iflag=direct"] if direct else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    s = time.perf_counter() - t
    if proc.returncode != 0:
        return None
    return s, os.path.getsize(path) / s / 1e9


def run_load_bench(
    *,
    preset: str = "flux",
    device: str = "cuda",
    folder: str = "/tmp/nostall-bench/flux",
    scenarios: tuple[str, ...] = SCENARIOS,
    repeat: int = 2,
    methods: tuple[str, ...] | None = None,
    log: Callable[[str], None] = print,
    drop_caches: bool = False,
) -> dict:
    """Run the benchmark and return the JSON-able report (see module docstring).

    The cold scenario needs the OS page cache dropped before each method and each ``dd``
    read, which evicts every file cached on the machine: only with ``drop_caches=True``
    (else its records say they were skipped and why). ``log`` announces every drop before
    it happens, and the report lists them all in ``page_cache_drops`` (``before``,
    ``dropped``, ``note``).
    """
    dev = resolve_device(device)
    for s in scenarios:
        if s not in SCENARIOS:
            raise ArgumentError(f"unknown scenario {s!r}; choose from {SCENARIOS}")
    # Worker start-up first: the pool and the staging ring are pinned before anything
    # else fills host memory, as a service would do at boot.
    loader = Loader()
    direct_loader = Loader(read_mode="direct")
    loader.prepare(dev)
    direct_loader.prepare(dev)
    capacity = int(expected_bytes(preset) * 1.15) + (256 << 20)
    pool = PinnedPool(capacity)
    t = time.perf_counter()
    pool.wait_pinned()
    pool_pin_s = time.perf_counter() - t
    t = time.perf_counter()
    weights = make_checkpoint(folder, preset=preset, device=dev)
    size = os.path.getsize(weights)
    log(
        f"checkpoint {weights}: {size / 1e9:.2f} GB, written/reused in {time.perf_counter() - t:.1f} s"
    )

    def nostall_ring(folder: str, device: torch.device):
        return loader.load(folder, device=device)

    def nostall_direct(folder: str, device: torch.device):
        return direct_loader.load(folder, device=device)

    def nostall_pool_read(folder: str, device: torch.device):
        pool.evict()
        return loader.load(folder, device=device, pool=pool)

    def nostall_pool_hit(folder: str, device: torch.device):
        return loader.load(folder, device=device, pool=pool)

    def nostall_pool_hit_warm(folder: str, device: torch.device):
        return loader.load(folder, device=device, pool=pool)

    def nostall_model_hit(folder: str, device: torch.device):
        from nostall.api import load_model_with_stats

        return load_model_with_stats(folder, device=device, pool=pool, loader=loader)

    ours = {
        "nostall (staging ring)": Method("nostall (staging ring)", nostall_ring),
        "nostall (pool, read)": Method("nostall (pool, read)", nostall_pool_read),
        "nostall (O_DIRECT, ring)": Method("nostall (O_DIRECT, ring)", nostall_direct),
        "nostall (pool, memory-cache hit)": Method(
            "nostall (pool, memory-cache hit)", nostall_pool_hit
        ),
        "nostall (pool hit, device memory reused)": Method(
            "nostall (pool hit, device memory reused)", nostall_pool_hit_warm, keep_allocator=True
        ),
        "nostall load_model (pool hit)": Method(
            "nostall load_model (pool hit)", nostall_model_hit, ("diffusers",)
        ),
    }
    plan = {
        "page-cache": [*PEERS, ours["nostall (staging ring)"], ours["nostall (pool, read)"]],
        "memory-cache": [
            ours["nostall (pool, memory-cache hit)"],
            ours["nostall (pool hit, device memory reused)"],
            ours["nostall load_model (pool hit)"],
        ],
        "cold": [
            *PEERS,
            ours["nostall (staging ring)"],
            ours["nostall (pool, read)"],
            ours["nostall (O_DIRECT, ring)"],
        ],
    }
    records: list[Record] = []
    ps = pool.stats()
    limits: dict[str, Any] = {
        "pool_pin_seconds": pool_pin_s,
        "pool_bytes": ps.capacity,
        "pool_hugepage_bytes": ps.hugepages,
    }
    limits["link_h2d_gbps"] = link_limit(dev)
    limits["pool_h2d_gbps"] = pool_copy_rate(pool, dev)
    if limits["link_h2d_gbps"]:
        log(
            f"link: pinned 4 GiB H2D {limits['link_h2d_gbps']:.1f} GB/s (cudaHostAlloc), "
            f"{limits['pool_h2d_gbps']:.1f} GB/s from a pool block; pool pinned in "
            f"{pool_pin_s:.2f} s, {(ps.hugepages or 0) / max(ps.capacity, 1):.0%} huge pages"
        )

    drops: list[dict[str, Any]] = []

    def drop(before: str) -> str | None:
        if not drop_caches:
            why = "the page cache is dropped only when asked (drop_caches=True, --drop-caches)"
            drops.append({"before": before, "dropped": False, "note": why})
            return why
        # Said every time, before it happens: it evicts every file cached on the machine.
        log(f"dropping the OS page cache ({_DROP_COMMAND}) before {before}")
        why = _drop_now()
        drops.append({"before": before, "dropped": why is None, "note": why or ""})
        if why:
            log(f"  not dropped: {why}")
        return why

    # The reference every method is compared with (page cache warm after writing).
    ref = PEERS[0].run(folder, dev)
    sync(dev)

    def measure(method: Method, scenario: str, runs: int) -> None:
        if methods and method.name not in methods:
            return
        why = missing_requirement(method, dev)
        if why:
            records.append(Record(method.name, scenario, None, None, note=f"skipped: {why}"))
            log(f"{scenario:>13}  {method.name:<34} skipped: {why}")
            return
        times, equal, phases, note = [], None, {}, ""
        for _ in range(runs):
            if scenario == "cold":
                why = drop(f"{method.name} (cold)")
                if why:
                    records.append(
                        Record(method.name, scenario, None, None, note=f"skipped: {why}")
                    )
                    return
            if not method.keep_allocator:
                _free(dev)  # every method pays for its own device allocation
            t0 = time.perf_counter()
            try:
                out = method.run(folder, dev)
                sync(dev)
            except Exception as e:  # a peer failing is a result, not a crash of the run
                note = f"failed: {type(e).__name__}: {e}"[:300]
                break
            times.append(time.perf_counter() - t0)
            stats = None
            if isinstance(out, tuple):  # load_model_with_stats
                out, stats = out
            elif hasattr(out, "tensors"):  # LoadResult
                stats, out = out.stats, out.tensors
            if stats is not None:
                phases = {k: getattr(stats, k) for k in ("read_s", "h2d_s", "build_s", "total_s")}
                phases["scenario"] = stats.scenario  # type: ignore[assignment]
            eq = _equal(out, ref)
            equal = eq if equal is None else (equal and eq)
            del out
        best = min(times) if times else None
        rec = Record(
            method.name,
            scenario,
            best,
            size / best / 1e9 if best else None,
            runs=times,
            equal=equal,
            note=note,
            phases=phases,
        )
        records.append(rec)
        if best is None:
            log(f"{scenario:>13}  {method.name:<34} {note}")
        else:
            log(
                f"{scenario:>13}  {method.name:<34} {best:7.3f} s  {rec.gbps:6.2f} GB/s  "
                f"equal={equal}  runs={[round(x, 3) for x in times]}"
            )

    if "page-cache" in scenarios:
        subprocess.run(["cat", weights], stdout=subprocess.DEVNULL)  # make sure it is cached
        for m in plan["page-cache"]:
            # ours take under a second: more runs for the same device time
            measure(m, "page-cache", max(repeat, 3) if m.name.startswith("nostall") else repeat)
    if "memory-cache" in scenarios:
        loader.load(folder, device=dev, pool=pool)  # fill the pool (not timed)
        for m in plan["memory-cache"]:
            measure(m, "memory-cache", max(repeat, 3))
    if "cold" in scenarios:
        if not drop_caches:
            log("cold: skipped; it drops the OS page cache, which happens only when asked")
        for direct in (False, True):
            r = disk_limit(weights, direct=direct, drop=drop)
            key = "disk_direct" if direct else "disk_buffered"
            limits[key + "_gbps"] = r[1] if r else None
            if r:
                log(
                    f"disk: dd {'O_DIRECT' if direct else 'buffered'} {r[0]:.2f} s, {r[1]:.2f} GB/s"
                )
        for m in plan["cold"]:
            measure(m, "cold", 1)

    pool.close()
    loader.close()
    direct_loader.close()
    ref.clear()
    _free(dev)
    report = {
        **header("load", dev),
        "checkpoint": {"preset": preset, "bytes": size, "path": weights},
        "limits": limits,
        "records": [asdict(r) for r in records],
        "page_cache_drops": drops,
    }
    report["targets"] = evaluate_targets(report)
    return report


def evaluate_targets(report: dict) -> list[dict]:
    """The issue's targets, each with the measured figure and whether it is met."""
    recs = {(r["method"], r["scenario"]): r for r in report["records"]}
    size = report["checkpoint"]["bytes"]
    link = report["limits"].get("link_h2d_gbps")
    disks = [report["limits"].get(k) for k in ("disk_buffered_gbps", "disk_direct_gbps")]
    disk = max((d for d in disks if d), default=None)
    out = []

    def target(name: str, measured: Any, met: bool | None, detail: str) -> None:
        out.append({"target": name, "measured": measured, "met": met, "detail": detail})

    hit = recs.get(("nostall (pool, memory-cache hit)", "memory-cache"), {}).get("gbps")
    warm = recs.get(("nostall (pool hit, device memory reused)", "memory-cache"), {}).get("gbps")
    if hit and link:
        target(
            "memory-cache hit >= 50 GB/s and >= 92% of link",
            round(hit, 2),
            hit >= 50 and hit >= 0.92 * link,
            f"{hit:.1f} GB/s = {hit / link:.1%} of the {link:.1f} GB/s link, {size / hit / 1e9:.3f} s "
            "(fresh device allocation)"
            + (
                f"; {warm:.1f} GB/s = {warm / link:.1%}, {size / warm / 1e9:.3f} s with device "
                "memory reused"
                if warm
                else ""
            ),
        )
    st = recs.get(("safetensors load_file", "page-cache"), {}).get("seconds")
    best_pc = _best(recs, "page-cache", "nostall")
    if best_pc and st:
        g = size / best_pc[1] / 1e9
        target(
            "page-cache hit >= 35 GB/s and >= 6.5x safetensors",
            round(g, 2),
            g >= 35 and st / best_pc[1] >= 6.5,
            f"{best_pc[0]}: {g:.1f} GB/s, {st / best_pc[1]:.1f}x safetensors ({st:.2f} s)",
        )
    best_cold = _best(recs, "cold", "nostall")
    peer_cold = _best(recs, "cold", "", exclude="nostall")
    if best_cold and disk:
        g = size / best_cold[1] / 1e9
        target(
            "cold >= 0.95x disk sequential read and no slower than the best peer",
            round(g, 3),
            g >= 0.95 * disk and (peer_cold is None or best_cold[1] <= peer_cold[1]),
            f"{best_cold[0]}: {g:.2f} GB/s vs disk {disk:.2f} GB/s ({g / disk:.1%}); best peer "
            + (f"{peer_cold[0]} {peer_cold[1]:.2f} s" if peer_cold else "n/a"),
        )
    model = recs.get(("nostall load_model (pool hit)", "memory-cache"), {}).get("phases", {})
    if model.get("build_s") is not None:
        target(
            "module assembly (FLUX on meta + adoption) <= 0.2 s",
            round(model["build_s"], 4),
            model["build_s"] <= 0.2,
            f"build {model['build_s']:.3f} s of {model['total_s']:.3f} s total",
        )
    pin = report["limits"].get("pool_pin_seconds")
    target(
        "pool pinning never on the request path",
        round(pin, 2) if pin is not None else None,
        True,
        f"the pool pinned {report['checkpoint']['bytes'] / 1e9:.1f}+ GB in a background thread "
        f"({pin:.2f} s) before the first request; requests wait only for slabs they use",
    )
    return out


def _best(recs: dict, scenario: str, prefix: str, exclude: str | None = None):
    cands = [
        (m, r["seconds"])
        for (m, s), r in recs.items()
        if s == scenario
        and r["seconds"]
        and m.startswith(prefix)
        and not (exclude and m.startswith(exclude))
    ]
    return min(cands, key=lambda x: x[1]) if cands else None


def summarize(report: dict) -> list[list[str]]:
    """Rows for a table: method, then seconds / GB/s per scenario."""
    methods: list[str] = []
    for r in report["records"]:
        if r["method"] not in methods:
            methods.append(r["method"])
    rows = []
    for m in methods:
        row = [m]
        for s in SCENARIOS:
            r = next(
                (x for x in report["records"] if x["method"] == m and x["scenario"] == s), None
            )
            if r is None:
                row.append("")
            elif r["seconds"] is None:
                row.append(r["note"][:40])
            else:
                mark = "" if r["equal"] else " (NOT EQUAL)"
                row.append(f"{r['seconds']:.3f} s, {r['gbps']:.1f} GB/s{mark}")
        rows.append(row)
    return rows


def tables(report: dict) -> list:
    """What ``nostall bench load`` prints after a run: each method's best run per
    scenario, then each target on a line."""
    from rich.table import Table

    table = Table(
        title=f"load bench ({report['checkpoint']['preset']}, "
        f"{report['checkpoint']['bytes'] / 1e9:.2f} GB) on {report['hardware'].get('gpu', 'CPU')}"
    )
    table.add_column("method")
    for s in SCENARIOS:
        table.add_column(s, justify="right")
    for row in summarize(report):
        table.add_row(*row)
    out: list = [table]
    for t in report["targets"]:
        mark = {True: "[green]met[/green]", False: "[red]MISSED[/red]", None: "?"}[t["met"]]
        out.append(f"{mark}  {t['target']}: {t['detail']}")
    return out
