"""``nostall bench stream`` (issue #32): a pipeline larger than the device budget, served
with its largest component resident in part, against diffusers' offloading, same run.

Parts: ``flux`` (FLUX.1-dev bf16, 1024², 28 steps) and ``wan`` (Wan 2.1 T2V-14B bf16,
832×480, 33 frames, 20 steps). Systems, interleaved round by round (A/B/A/B, medians;
this machine's speed drifts):

* ``resident``: nostall with the whole pipeline on the device (the reference: its
  images are diffusers' own, bit for bit, and its denoiser's blocks are timed);
* ``nostall``: :class:`~nostall.ModelCache` with the budget applied (less the
  activations the resident run peaked at): what does not fit streams
  (:mod:`nostall.cache.partial`), one run per budget;
* ``group-offload``: diffusers' ``apply_group_offloading`` on every model component
  (block level, ``use_stream=True``, ``record_stream=True``: its docs' fastest);
* ``sequential``: ``enable_sequential_cpu_offload``, run once at a few steps (it is
  minutes an image) and reported per step.

The cost model is checked where it matters: the denoiser's call period (one call's
start to the next) predicted by :func:`nostall.stream.cost.simulate` from the resident
run's per-block times, the plan and the host tier's measured link rate, against the
period measured under the budget.

At tiny size (a CPU, seconds) the budgets sit between the least the pipeline can be
served in and all of it (the tiny layouts' proportions are not the real ones'); a part
whose tiny pipeline cannot stream is reported as such.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from nostall.bench import stream_systems as sys_
from nostall.bench.targets import Targets
from nostall.errors import ArgumentError

__all__ = ["PARTS", "SYSTEMS", "evaluate_targets", "run_stream_bench", "tables"]

SYSTEMS = ("resident", "nostall", "group-offload", "sequential")
PARTS: dict[str, dict[str, dict[str, Any]]] = {
    "flux": {
        "full": {
            "layout": "flux",
            "kind": "image",
            "height": 1024,
            "width": 1024,
            "steps": 28,
            "max_sequence_length": 512,
        },
        "tiny": {
            "layout": "flux",
            "kind": "image",
            "height": 32,
            "width": 32,
            "steps": 4,
            "max_sequence_length": 16,
        },
    },
    "wan": {
        "full": {
            "layout": "wan-14b",
            "kind": "video",
            "height": 480,
            "width": 832,
            "frames": 33,
            "steps": 20,
        },
        "tiny": {
            "layout": "wan",
            "kind": "video",
            "height": 16,
            "width": 16,
            "frames": 5,
            "steps": 2,
        },
    },
}
_TINY_SHARES = {24.0: 0.2, 16.0: 0.05}  # tiny: how far above the least, toward all of it
_SEQUENTIAL_STEPS = 2
_MARGIN = 0.05  # of the activation peak, and 256 MiB: what nostall's budget leaves free


def _budget(gb: float, size: str, whole: int, least: int | None, act: int) -> int | None:
    if size == "full":
        return int(gb * 1e9 - act * (1 + _MARGIN) - (256 << 20))
    if least is None or least >= whole:
        return None
    share = _TINY_SHARES.get(gb, 0.2)
    return int(least + share * (whole - least))


def _part_run(part: str, cfg: dict, store: str, budgets_gb, dev, rounds, systems, log) -> dict:
    from nostall.cache import ModelCache
    from nostall.cache.partial import explain, least_pipeline_bytes

    name = cfg["layout"]
    folder = os.path.join(store, name)
    steps = cfg["steps"]
    out: dict[str, Any] = {"pipeline": name, "config": cfg, "passes": {}, "budgets": {}}
    shm = f"shared:bench-stream-{os.getpid()}"
    # the reference: everything resident
    resident = ModelCache(store, device=str(dev), host_budget=1 << 30, cache_dir=False)
    block, pipe = sys_.nostall_pipe(resident, name)
    den = pipe.transformer if getattr(pipe, "transformer", None) is not None else pipe.unet
    whole = resident.stats().gpu_bytes
    sys_.call(pipe, cfg, dev, 1)  # warm
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    probe = sys_.probe(den, dev)
    t = time.perf_counter()
    ref = sys_.call(pipe, cfg, dev, steps)
    out["passes"]["resident"] = [time.perf_counter() - t]
    act = (torch.cuda.max_memory_allocated(dev) - before) if dev.type == "cuda" else 0
    figures = probe.figures() or {"period_s": None, "block_s": {}}
    out["resident"] = {"weights_bytes": whole, "activation_bytes": act, **figures}
    probe.remove()
    least = least_pipeline_bytes(resident, name)
    out["least_bytes"] = least
    caches: dict[str, Any] = {}
    try:
        for gb in budgets_gb:
            b = _budget(gb, cfg.get("size", "full"), whole, least, act)
            key = f"{gb:g}"
            if b is None:
                out["budgets"][key] = {"skipped": "its tiny pipeline cannot stream"}
                continue
            c = ModelCache(
                store,
                device=str(dev),
                gpu_budget=b,
                host_budget=int(whole * 1.3) + (1 << 30),
                host_tier=shm if dev.type == "cuda" else None,
                cache_dir=False,
            )
            caches[key] = c
            out["budgets"][key] = {"device_budget_bytes": b, "budget_gb": gb}
        order = ["resident", *(f"nostall@{k}" for k in caches)]
        if "group-offload" in systems:
            order.append("group-offload")
        group = None
        for r in range(rounds):
            for system in order if r % 2 == 0 else order[::-1]:
                if system == "resident":
                    if r == 0:
                        continue  # (measured above)
                    t = time.perf_counter()
                    img = sys_.call(pipe, cfg, dev, steps)
                    out["passes"]["resident"].append(time.perf_counter() - t)
                elif system.startswith("nostall@"):
                    key = system.split("@")[1]
                    rec = out["budgets"][key]
                    c = caches[key]
                    with c.use(name) as p:
                        d = p.transformer if getattr(p, "transformer", None) is not None else p.unet
                        if r == 0:
                            sys_.call(p, cfg, dev, 1)  # warm (a cold ring: every block missed)
                        if dev.type == "cuda":
                            torch.cuda.reset_peak_memory_stats(dev)
                        base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
                        probe = sys_.probe(d, dev)
                        t = time.perf_counter()
                        img = sys_.call(p, cfg, dev, steps)
                        rec.setdefault("passes", []).append(time.perf_counter() - t)
                        fig = probe.figures() or {"period_s": None}
                        probe.remove()
                        if dev.type == "cuda":
                            peak = torch.cuda.max_memory_allocated(dev) - base
                            rec["peak_device_bytes"] = max(
                                rec.get("peak_device_bytes", 0), c.stats().gpu_budget + peak
                            )
                        rec.setdefault("period_s", []).append(fig["period_s"])
                        rec["plans"] = explain(c, name)
                        rec["equal"] = rec.get("equal", True) and bool(np.array_equal(img, ref))
                        rec["link_bytes_s"] = _link_rate(c)
                elif system == "group-offload":
                    if group is None:
                        group = sys_.diffusers_offloaded(folder, cfg["kind"], "group", dev)
                        sys_.call(group, cfg, dev, 1)  # warm
                    if dev.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(dev)
                    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
                    t = time.perf_counter()
                    sys_.call(group, cfg, dev, steps)
                    out["passes"].setdefault("group-offload", []).append(time.perf_counter() - t)
                    if dev.type == "cuda":  # (beside what the other systems hold meanwhile)
                        peak = torch.cuda.max_memory_allocated(dev) - base
                        out["group_peak_device_bytes"] = max(
                            out.get("group_peak_device_bytes", 0), peak
                        )
                log(f"{part} round {r + 1} {system}: done")
        sys_.release(group)
        group = None
        if "sequential" in systems and dev.type == "cuda":
            seq = sys_.diffusers_offloaded(folder, cfg["kind"], "sequential", dev)
            t = time.perf_counter()
            sys_.call(seq, cfg, dev, _SEQUENTIAL_STEPS)
            out["sequential"] = {
                "steps": _SEQUENTIAL_STEPS,
                "per_step_s": (time.perf_counter() - t) / _SEQUENTIAL_STEPS,
            }
            sys_.release(seq)
        elif "sequential" in systems:
            out["sequential"] = {"skipped": "enable_sequential_cpu_offload needs a GPU"}
    finally:
        for c in caches.values():
            c.close()
        block.__exit__(None, None, None)
        resident.close()
    for rec in out["budgets"].values():
        if "passes" in rec:
            rec["median_s"] = float(np.median(rec["passes"]))
            rec["predicted_period_s"] = _predicted(out["resident"], rec)
            periods = [p for p in rec["period_s"] if p]
            rec["measured_period_s"] = float(np.median(periods)) if periods else None
    out["medians"] = {s: float(np.median(v)) for s, v in out["passes"].items() if v}
    return out


def _link_rate(cache: Any) -> float:
    """The host tier's link rate its switches measured (bytes/s; the prior without)."""
    from nostall.cache.partial import LINK_BYTES_S

    rates = [
        c.nbytes / c.copy_s
        for r in cache.reports
        for c in r.components
        if c.tier == "host" and c.copy_s > 0
    ]
    return max(rates) if rates else LINK_BYTES_S


def _predicted(resident: dict, rec: dict) -> float | None:
    """The cost model's call period of the streamed denoiser (see the module)."""
    from nostall.stream.cost import simulate

    den = [p for p in rec.get("plans", []) if p["role"] in ("transformer", "unet")]
    period = resident.get("period_s")
    if not den or period is None:
        return None
    plan = den[0]
    names = plan["all_blocks"]
    compute = [resident["block_s"].get(n, 0.0) for n in names]
    return simulate(
        plan["block_bytes"],
        plan["streamed"],
        max(plan["depth"], 1),
        link_bytes_s=rec["link_bytes_s"],
        compute_s=compute,
        between_s=max(0.0, period - sum(compute)),
    )


def run_stream_bench(
    *,
    size: str = "full",
    device: str = "cuda",
    models: str | None = None,
    parts: tuple[str, ...] = ("flux", "wan"),
    budgets_gb: tuple[float, ...] = (24.0, 16.0),
    systems: tuple[str, ...] = SYSTEMS,
    rounds: int = 2,
    work: str | None = None,
    log: Callable[[str], None] = print,
    save: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """The benchmark (see the module); the report with its ``targets``. ``models``: a
    store holding the parts' pipelines (default: written under ``work``); ``save`` is
    given the report after each part."""
    from nostall.bench.record import header
    from nostall.synthetic import write_store
    from nostall.transfer.loader import resolve_device

    if size not in ("tiny", "full"):
        raise ArgumentError(f"size={size!r}; choose tiny or full")
    bad = sorted(set(parts) - set(PARTS))
    if bad or not parts:
        raise ArgumentError(f"parts must be some of {tuple(PARTS)}, got {tuple(parts)!r}")
    bad = sorted(set(systems) - set(SYSTEMS))
    if bad or "resident" not in systems or "nostall" not in systems:
        raise ArgumentError(f"systems: resident, nostall and any of {SYSTEMS[2:]}; got {systems}")
    if not budgets_gb or any(not b > 0 for b in budgets_gb):
        raise ArgumentError(f"budgets_gb={budgets_gb!r}: give device budgets > 0 GB")
    if rounds < 1:
        raise ArgumentError(f"rounds={rounds!r}: give at least 1")
    dev = resolve_device(device)
    work = work or ("/tmp/nostall-bench/stream" if size == "full" else tempfile.mkdtemp())
    report: dict[str, Any] = {
        **header("stream", dev),
        "size": size,
        "config": {
            "parts": list(parts),
            "budgets_gb": list(budgets_gb),
            "rounds": rounds,
            "systems": list(systems),
        },
        "parts": {},
    }
    store = models or work
    for part in parts:  # (all written first: a store is listed once per process)
        layout = PARTS[part][size]["layout"]
        if not os.path.isfile(os.path.join(store, layout, "model_index.json")):
            log(f"writing the {size} {layout} pipeline under {store}")
            write_store(store, (layout,), size=size, device=str(dev))
    for part in parts:
        cfg = {**PARTS[part][size], "size": size}
        report["parts"][part] = _part_run(part, cfg, store, budgets_gb, dev, rounds, systems, log)
        report["targets"] = evaluate_targets(report)
        if save is not None:
            save(report)
    report["targets"] = evaluate_targets(report)
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def evaluate_targets(report: dict) -> Targets:
    """The issue's targets from what ran (``None``: not measured)."""
    t = Targets()
    parts = report.get("parts", {})
    flux, wan = parts.get("flux", {}), parts.get("wan", {})

    def nostall_s(part: dict, gb: str) -> float | None:
        return part.get("budgets", {}).get(gb, {}).get("median_s")

    res = flux.get("medians", {}).get("resident")
    t.add("flux_24gb_vs_resident", _ratio(nostall_s(flux, "24"), res), "<=", 1.3)
    group = flux.get("medians", {}).get("group-offload")
    t.add("flux_24gb_vs_diffusers_group_offload", _ratio(group, nostall_s(flux, "24")), ">=", 1.5)
    wres = wan.get("medians", {}).get("resident")
    t.add("wan14b_24gb_vs_resident", _ratio(nostall_s(wan, "24"), wres), "<=", 1.05)
    runs = [r for p in parts.values() for r in p.get("budgets", {}).values() if "passes" in r]
    equal = [r["equal"] for r in runs]
    t.add("stream_images_equal_resident", int(all(equal)) if equal else None, ">=", 1)
    errors = [
        abs(r["predicted_period_s"] - r["measured_period_s"]) / r["measured_period_s"]
        for r in runs
        if r.get("predicted_period_s") and r.get("measured_period_s")
    ]
    t.add("cost_model_step_error", float(np.median(errors)) if errors else None, "<=", 0.1)
    peaks = [
        r["peak_device_bytes"] <= r["budget_gb"] * 1e9 for r in runs if "peak_device_bytes" in r
    ]
    t.add("stream_peak_device_bytes_within_budget", int(all(peaks)) if peaks else None, ">=", 1)
    return t


def tables(report: dict) -> list:
    """One table per part (a row per system and budget), then the targets."""
    from rich.table import Table

    from nostall.bench.targets import table
    from nostall.cache.report import human_bytes

    out = []
    for part, p in report.get("parts", {}).items():
        tab = Table(title=f"{part}: {p['pipeline']}", title_justify="left")
        for col in ("system", "budget", "median s", "vs resident", "streamed/call", "note"):
            tab.add_column(col, justify="left" if col in ("system", "note") else "right")
        res = p.get("medians", {}).get("resident")
        tab.add_row("resident", "-", f"{res:.3f}" if res else "-", "1.00", "0", "reference")
        for gb, r in p.get("budgets", {}).items():
            if "median_s" not in r:
                tab.add_row("nostall", f"{gb} GB", "-", "-", "-", r.get("skipped", ""))
                continue
            moved = human_bytes(sum(x["streamed_bytes"] for x in r.get("plans", [])))
            note = "equal" if r.get("equal") else "IMAGES DIFFER"
            if r.get("predicted_period_s") and r.get("measured_period_s"):
                note += f"; period {r['measured_period_s']:.3f} s, model {r['predicted_period_s']:.3f} s"
            ratio = _ratio(r["median_s"], res)
            shown = f"{ratio:.2f}" if ratio else "-"
            tab.add_row("nostall", f"{gb} GB", f"{r['median_s']:.3f}", shown, moved, note)
        group = p.get("medians", {}).get("group-offload")
        if group:
            tab.add_row("group-offload", "-", f"{group:.3f}", f"{group / res:.2f}", "all", "")
        seq = p.get("sequential", {})
        if "per_step_s" in seq:
            step = f"{seq['per_step_s']:.3f}/step"
            tab.add_row("sequential", "-", step, "-", "all", f"measured at {seq['steps']} steps")
        out.append(tab)
    out.append(table(report.get("targets", {})))
    return out
