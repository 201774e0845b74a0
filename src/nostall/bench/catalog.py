"""``nostall bench catalog``: a catalog larger than the GPU, served to deadlines, raced
against the peers a competent team would run (issue #31).

The catalog (:data:`CATALOG`): FLUX.1-dev, SDXL and two SDXL fine-tunes (their own UNet,
SDXL's text encoders and VAE), SD3-medium (FLUX's T5-XXL and VAE weights), 56.8 GB
distinct at full size; at tiny size the same five layouts. Every system gets the same
device budget for weights (``budgets_gb``; 44 GB, a 48 GB card, is the headline, and
80 GB is reported beside); at tiny size each budget is scaled by the tiny catalog's bytes
over the full one's, so the same share of the catalog fits.

The systems, in one process, on one device, interleaved (round 1: nostall, then the
peers; round 2: the peers, then nostall; ...), every figure a median over the rounds:

* ``nostall``: the worker (``Worker(gpu_budget=...)``) behind its own app, requests
  carrying their ``slo_ms``;
* ``lru-pinned`` and ``lru-pageable``: :class:`~nostall.bench.serve_peer_lru.LruPeer`
  (plain diffusers, as many pipelines on the device as the budget holds, least recently
  used leaving), its CPU copies page-locked, then the same copies pageable; no deadlines
  (a diffusers server has none): first come, first served.

The stream: request popularity Zipf(``alpha``) over the catalog (:data:`CATALOG`'s order:
SDXL the most asked for) or a replayed trace (:func:`~nostall.bench.workload.read_trace`),
Poisson arrivals at ``load`` times nostall's measured capacity (requests per second over
a closed-loop calibration run of the stream's first requests, one at a time), plus one
burst (``burst_x`` times the rate for a tenth of the stream). Each request's SLO is its
model's warm latency (alone, its pipeline resident, measured on nostall) times
``slo_scale`` (3.0, as vLLM-Omni's and SGLang's diffusion benchmarks define it).

Every image is held to the first pinned peer pass's image for the same request (bit for
bit). After the first budget's rounds, the preemption part: a long FLUX job (1024², 28
steps at full size) run straight, then again with a short SDXL request sent a quarter of
the way in: is the long one paused at a step for it (:mod:`nostall.serve.preempt`), does
the short one meet its SLO, is the long one's image the straight one's?

``host_budget_gb`` (scaled like the device budgets at tiny size): the CPU memory each
system may keep copies in, smaller than the catalog in the configuration where some
switches read the store: nostall's host tier (``Worker(host_budget=...)``) and the peer's
CPU copies (least recently used ones dropped and read again with ``from_pretrained``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from nostall.bench import catalog_drive as drive
from nostall.bench.workload import Arrival, draw, read_trace, scale_to_rate
from nostall.errors import ArgumentError

__all__ = ["CATALOG", "SYSTEMS", "evaluate_targets", "run_catalog_bench", "tables"]

CATALOG = ("sdxl", "flux", "sdxl-b", "sd3", "sdxl-c")  # by popularity: Zipf ranks
SYSTEMS = ("nostall", "lru-pinned", "lru-pageable")
_FULL_CATALOG_BYTES = 56_755_251_244  # synthetic.full.footprint(CATALOG)["distinct_bytes"]
# the preemption part: a long FLUX job (side, steps) paused for a short SDXL one
_LONG = {"tiny": (128, 150), "full": (1024, 28)}
_SIZES = {
    "tiny": {"requests": 24, "res": 32, "steps": 2},
    "full": {"requests": 48, "res": 512, "steps": 8},
}
_CALIBRATION = 12  # requests of the closed-loop capacity run
_WARM_SEED = 1_000_000  # warm-up seeds the stream never uses


def _write_store(
    work: str, size: str, device: str, elsewhere: dict[str, str], log: Callable[[str], None]
) -> str:
    from nostall.synthetic import write_store
    from nostall.synthetic.full import write_full_store

    folder = os.path.join(work, f"catalog-{size}")
    if size == "full":  # the room checked first, shared components linked
        write_full_store(folder, CATALOG, device=device, progress=log, elsewhere=elsewhere)
    elif elsewhere:
        raise ArgumentError("elsewhere places real-size weight files; use it with size='full'")
    else:
        write_store(folder, CATALOG, size=size, device=device, progress=log)
    return folder


def _catalog_bytes(store: str) -> int:
    """The distinct bytes of the catalog's weights (one copy of each shared file)."""
    seen, total = set(), 0
    for name in CATALOG:
        for root, _, files in os.walk(os.path.join(store, name), followlinks=True):
            for f in files:
                if f.endswith(".safetensors"):
                    path = os.path.realpath(os.path.join(root, f))
                    st = os.stat(path)
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
    return total


class _Nostall:
    """The worker behind its app, opened per pass."""

    name = "nostall"
    send_slo = True

    def __init__(self, store: str, device: str, budget: int, max_queue: int, host: int | None):
        self.store, self.device, self.budget, self.max_queue = store, device, budget, max_queue
        self.host = host
        self.stack: contextlib.ExitStack | None = None
        self.worker: Any = None

    def open(self) -> str:
        from nostall.serve.app import create_app
        from nostall.serve.local import BackgroundServer
        from nostall.serve.worker import Worker

        self.stack = contextlib.ExitStack()
        self.worker = Worker(
            self.store,
            device=self.device,
            gpu_budget=self.budget,
            max_queue=self.max_queue,
            **({} if self.host is None else {"host_budget": self.host}),
        )
        return self.stack.enter_context(BackgroundServer(create_app(self.worker))).url

    def status(self) -> dict[str, Any]:
        s = self.worker.status()
        return {k: s.get(k) for k in ("gpu", "host", "budget", "switch_s", "tier_rates_gbps")}

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.stack = self.worker = None
        gc.collect()


class _Peer:
    """The LRU diffusers peer behind the bench's peer app; one boot serves both of its
    systems (pinned, then the same copies pageable)."""

    send_slo = False

    def __init__(self, store: str, device: str, budget: int, host: int | None):
        from nostall.bench.serve_peer_lru import LruPeer

        folders = {n: os.path.join(store, n) for n in CATALOG}
        self.peer = LruPeer(
            folders, device=device, budget_bytes=budget, pinned=False, host_budget_bytes=host
        )
        self.stack: contextlib.ExitStack | None = None
        self.name = "lru-pageable"

    def load(self) -> float:
        return self.peer.load()

    def open(self, system: str) -> str:
        """Serve as ``system``: ``lru-pinned`` (page-locked copies where the device is a
        GPU; on a CPU there is nothing to pin and the copies stay as they are, said in
        the pass's ``pinned``) or ``lru-pageable``."""
        from nostall.bench.serve_peer import create_peer_app
        from nostall.serve.local import BackgroundServer

        self.peer.set_pinned(system == "lru-pinned" and self.peer.device.type == "cuda")
        self.name = system
        self.stack = contextlib.ExitStack()
        return self.stack.enter_context(BackgroundServer(create_peer_app(self.peer))).url

    def status(self) -> dict[str, Any]:
        return {"resident_bytes": self.peer.resident_bytes(), "pinned": self.peer.pinned}

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.stack = None

    def shut(self) -> None:
        self.close()
        self.peer.close()


def _warm(url: str, res: int, steps: int, twice: bool) -> dict[str, Any]:
    """Each catalog model once (its first run: compile, cuDNN's choices, its host copy),
    and with ``twice`` once more at once: that second latency is the model's warm latency
    (alone, its pipeline resident)."""
    warm = {}
    for i, name in enumerate(CATALOG):
        for again in (False, True) if twice else (False,):
            a = Arrival(0.0, name)
            r = drive.send(
                url, [a], res=res, steps=steps, slo_s={}, send_slo=False, seed=_WARM_SEED + i
            )
            got = r["answers"][0]
            if got.get("status") != 200:
                raise ArgumentError(
                    f"warm-up of {name} answered {got.get('status')}: {got.get('error')}"
                )
            if again:
                warm[name] = got["latency_s"]
    return warm


def _stream(
    trace: list[Arrival] | None,
    requests: int,
    alpha: float,
    rate: float,
    burst_x: float,
    seed: int,
) -> list[Arrival]:
    """``requests`` arrivals at ``rate``: the trace's first (read up front), or drawn."""
    if trace:
        return scale_to_rate(trace[:requests], rate)
    span = requests / rate
    return draw(
        CATALOG,
        requests,
        rate=rate,
        alpha=alpha,
        seed=seed,
        burst_at_s=0.4 * span,
        burst_s=0.1 * span,
        burst_x=burst_x,
    )


def _images(answers: list[dict]) -> dict[tuple[str, int], np.ndarray]:
    from nostall.bench.references import decode

    return {(a["model"], a["seed"]): decode(a["b64"]) for a in answers if a.get("status") == 200}


def _compare(images: dict, refs: dict) -> dict[str, Any]:
    shared = sorted(set(images) & set(refs))
    unequal = [k for k in shared if not np.array_equal(images[k], refs[k])]
    diff = max((int(np.abs(images[k].astype(int) - refs[k]).max()) for k in unequal), default=0)
    return {"compared": len(shared), "unequal": len(unequal), "max_abs_diff": diff}


def _budget_run(
    store: str,
    budget: int,
    cfg: dict[str, Any],
    log: Callable[[str], None],
    progress: Callable[[dict[str, Any]], None] = lambda out: None,
) -> dict[str, Any]:
    """Every system over one stream at one device budget, ``cfg["rounds"]`` rounds;
    ``progress(out)`` after each pass (``out`` as far as it goes)."""
    res, steps = cfg["res"], cfg["steps"]
    out: dict[str, Any] = {"budget_bytes": budget, "passes": {s: [] for s in cfg["systems"]}}
    nostall = _Nostall(store, cfg["device"], budget, cfg["max_queue"], cfg["host_bytes"])
    peer = None
    refs: dict | None = None
    try:
        # calibration on nostall: the warm latencies (the SLOs) and the capacity (the rate)
        url = nostall.open()
        t = time.perf_counter()
        warm = _warm(url, res, steps, twice=True)
        out["warm_up_s"] = {"nostall": time.perf_counter() - t}
        slo = {m: cfg["slo_scale"] * s for m, s in warm.items()}
        probe = _stream(cfg["arrivals"], _CALIBRATION, cfg["alpha"], 1.0, 1.0, cfg["seed"] + 1)
        closed = [Arrival(0.0, a.model) for a in probe]
        t = time.perf_counter()
        for k, a in enumerate(closed):  # one at a time, back to back
            drive.send(
                url, [a], res=res, steps=steps, slo_s={}, send_slo=False, seed=_WARM_SEED + 100 + k
            )
        capacity = len(closed) / (time.perf_counter() - t)
        rate = cfg["load"] * capacity
        stream = _stream(
            cfg["arrivals"], cfg["requests"], cfg["alpha"], rate, cfg["burst_x"], cfg["seed"]
        )
        out.update(
            warm_latency_s=warm,
            slo_s=slo,
            capacity_per_s=capacity,
            rate_per_s=rate,
            stream=[[a.at_s, a.model] for a in stream],
        )
        log(
            f"budget {budget / 1e9:.2f} GB: warm latencies "
            + ", ".join(f"{m} {s:.2f} s" for m, s in warm.items())
            + f"; capacity {capacity:.2f} req/s, the stream at {rate:.2f} req/s"
        )
        peers = [s for s in cfg["systems"] if s != "nostall"]
        for r in range(cfg["rounds"]):
            order = ["nostall", "peers"] if r % 2 == 0 else ["peers", "nostall"]
            for which in order:
                if which == "nostall" and "nostall" in cfg["systems"]:
                    if peer is not None:  # one system's CPU copies in memory at a time
                        peer.shut()
                        peer = None
                    if nostall.worker is None:
                        url = nostall.open()
                        _warm(url, res, steps, twice=False)
                    p = _pass(nostall, url, stream, slo, res, steps, log, r)
                    nostall.close()
                    out["passes"]["nostall"].append(p)
                    progress(out)
                elif which == "peers" and peers:
                    nostall.close()
                    if peer is None:
                        peer = _Peer(store, cfg["device"], budget, cfg["host_bytes"])
                        out["peer_load_s"] = peer.load()
                        warmed = False
                    for name in peers:
                        url = peer.open(name)
                        if not warmed:  # its first runs (later passes find it warm)
                            _warm(url, res, steps, twice=False)
                            warmed = True
                        p = _pass(peer, url, stream, slo, res, steps, log, r)
                        peer.close()
                        if refs is None and name == "lru-pinned":
                            refs = p.pop("_images")
                        out["passes"][name].append(p)
                        progress(out)
        if refs is None and out["passes"].get("lru-pageable"):
            refs = out["passes"]["lru-pageable"][0].get("_images")
    finally:
        nostall.close()
        if peer is not None:
            peer.shut()
    for passes in out["passes"].values():
        for p in passes:
            images = p.pop("_images", None)
            p["images"] = _compare(images, refs) if images is not None and refs else None
    out["medians"] = {s: _medians(ps) for s, ps in out["passes"].items() if ps}
    if cfg.pop("preempt_now", False) and "nostall" in cfg["systems"]:
        out["preemption"] = _preempt_part(store, budget, cfg, slo, log)
    return out


def _preempt_part(
    store: str, budget: int, cfg: dict[str, Any], slo: dict[str, float], log
) -> dict[str, Any]:
    """nostall alone: a long FLUX job run straight, then again with a short SDXL job (its
    SLO the stream's) sent once the long one is under way: is the long one paused for it,
    and is its image the straight one's, bit for bit?"""
    import threading

    side, steps = _LONG[cfg["size"]]
    long = Arrival(0.0, "flux", steps=steps)
    nostall = _Nostall(store, cfg["device"], budget, cfg["max_queue"], cfg["host_bytes"])
    try:
        url = nostall.open()
        _warm(url, cfg["res"], cfg["steps"], twice=False)
        straight = drive.send(url, [long], res=side, steps=steps, slo_s={}, send_slo=False, seed=7)
        got: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: got.update(
                drive.send(url, [long], res=side, steps=steps, slo_s={}, send_slo=False, seed=7)
            )
        )
        t.start()
        while nostall.worker.status()["running"] is None and t.is_alive():
            time.sleep(0.01)
        time.sleep(0.25 * straight["answers"][0]["latency_s"])  # a quarter of the way in
        short = drive.send(
            url,
            [Arrival(0.0, "sdxl")],
            res=cfg["res"],
            steps=cfg["steps"],
            slo_s=slo,
            send_slo=True,
            seed=8,
        )["answers"][0]
        t.join()
    finally:
        nostall.close()
    a, b = straight["answers"][0], got["answers"][0]
    by = (b.get("nostall") or {}).get("preempted_by") or []
    equal = a.get("status") == b.get("status") == 200 and bool(
        np.array_equal(_images([a])[("flux", 7)], _images([b])[("flux", 7)])
    )
    out = {
        "long": {
            "side": side,
            "steps": steps,
            "straight_s": a["latency_s"],
            "paused_s": b["latency_s"],
        },
        "short": {
            "status": short.get("status"),
            "latency_s": short["latency_s"],
            "slo_s": short["slo_s"],
        },
        "preempted_by": by,
        "preempted": bool(by),
        "equal": equal,
    }
    log(
        f"  preemption: FLUX {side}px {steps} steps {a['latency_s']:.2f} s straight, "
        f"{b['latency_s']:.2f} s paused for {[x['model'] for x in by]}; the short job "
        f"{short['latency_s']:.2f} s (SLO {short['slo_s']:.2f} s); images equal: {equal}"
    )
    return out


def _pass(system, url, stream, slo, res, steps, log, r) -> dict[str, Any]:
    result = drive.send(url, stream, res=res, steps=steps, slo_s=slo, send_slo=system.send_slo)
    fig = drive.figures(result)
    fig["status"] = system.status()
    fig["_images"] = _images(result["answers"])
    log(
        f"  round {r + 1} {system.name}: {fig['answered_200']}/{fig['requests']} answered, "
        f"SLO met {fig['slo_attainment']:.0%}, waited for weights {fig['weights_stall_s']:.2f} s "
        f"({fig['switches']} switches), p99 {fig['latency_p99_s'] or 0:.2f} s, "
        f"{fig['wall_s']:.1f} s"
    )
    return fig


_MEDIAN_KEYS = (
    "slo_attainment",
    "goodput_per_s",
    "throughput_per_s",
    "latency_p50_s",
    "latency_p99_s",
    "weights_stall_s",
    "switches",
    "gpu_busy_share",
    "wall_s",
    "lost",
)


def _medians(passes: list[dict]) -> dict[str, Any]:
    out = {}
    for k in _MEDIAN_KEYS:
        xs = [p[k] for p in passes if p.get(k) is not None]
        out[k] = float(np.median(xs)) if xs else None
    return out


def run_catalog_bench(
    *,
    models: str | None = None,
    size: str = "tiny",
    device: str = "cuda",
    budgets_gb: tuple[float, ...] = (44.0, 80.0),
    systems: tuple[str, ...] = SYSTEMS,
    alpha: float = 1.0,
    load: float = 0.7,
    requests: int | None = None,
    rounds: int = 2,
    burst_x: float = 4.0,
    slo_scale: float = 3.0,
    max_queue: int = 16,
    host_budget_gb: float | None = None,
    res: int | None = None,
    steps: int | None = None,
    trace: str | None = None,
    seed: int = 0,
    work: str | None = None,
    elsewhere: dict[str, str] | None = None,
    preempt: bool = True,
    log: Callable[[str], None] = print,
    save: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """The benchmark (see the module); the report with its ``targets``. ``models``: a
    store holding the catalog (default: written under ``work``, ``elsewhere`` placing
    roles' weight files on other filesystems as ``nostall synthetic --elsewhere`` does).
    ``save`` is given the report after each budget (a later one cut short loses nothing);
    ``preempt``: run the preemption part after the first budget's rounds."""
    from nostall.bench.record import header
    from nostall.transfer.loader import resolve_device

    if size not in _SIZES:
        raise ArgumentError(f"size={size!r}; choose one of {', '.join(_SIZES)}")
    bad = sorted(set(systems) - set(SYSTEMS))
    if bad or not systems:
        raise ArgumentError(f"systems must be some of {SYSTEMS}, got {tuple(systems)!r}")
    if not budgets_gb or any(not b > 0 for b in budgets_gb):
        raise ArgumentError(f"budgets_gb={budgets_gb!r}: give device budgets > 0 GB")
    if host_budget_gb is not None and not host_budget_gb > 0:
        raise ArgumentError(f"host_budget_gb={host_budget_gb!r}: give a budget > 0 GB, or None")
    if not 0 < load <= 2:
        raise ArgumentError(f"load={load!r}: give a share of the capacity in (0, 2]")
    # a trace file is read (and refused, naming its row) before a store is written
    n = requests or _SIZES[size]["requests"]
    arrivals = read_trace(trace, CATALOG, limit=max(n, _CALIBRATION)) if trace else None
    work = work or ("/tmp/nostall-bench/catalog" if size == "full" else tempfile.mkdtemp())
    os.makedirs(work, exist_ok=True)
    store = models or _write_store(work, size, device, dict(elsewhere or {}), log)
    missing = [n for n in CATALOG if not os.path.isfile(os.path.join(store, n, "model_index.json"))]
    if missing:
        raise ArgumentError(
            f"{store}: the catalog's pipelines {missing} are not there; leave the store out "
            "to have it written, or write them with nostall synthetic"
        )
    catalog = _catalog_bytes(store)
    scale = 1.0 if size == "full" else catalog / _FULL_CATALOG_BYTES
    defaults = _SIZES[size]
    cfg = {
        "device": device,
        "systems": tuple(systems),
        "alpha": alpha,
        "load": load,
        "requests": requests or defaults["requests"],
        "rounds": rounds,
        "burst_x": burst_x,
        "slo_scale": slo_scale,
        "max_queue": max_queue,
        "host_budget_gb": host_budget_gb,
        "res": res or defaults["res"],
        "steps": steps or defaults["steps"],
        "trace": trace,
        "seed": seed,
        "size": size,
        "preempt": preempt,
    }
    report = {
        **header("catalog", resolve_device(device)),
        "size": size,
        "store": os.path.abspath(store),
        "catalog": list(CATALOG),
        "catalog_bytes": catalog,
        "config": {**cfg, "budgets_gb": list(budgets_gb), "budget_scale": scale},
        "budgets": {},
    }
    cfg["arrivals"] = arrivals
    cfg["host_bytes"] = None if host_budget_gb is None else int(host_budget_gb * 1e9 * scale)
    for i, gb in enumerate(budgets_gb):
        budget = int(gb * 1e9 * scale)
        cfg["preempt_now"] = preempt and i == 0
        key = f"{gb:g}"

        def partial(out: dict[str, Any], key: str = key) -> None:
            if save is None:
                return
            passes = {
                name: [{k: v for k, v in p.items() if k != "_images"} for p in ps]
                for name, ps in out["passes"].items()
            }
            medians = {name: _medians(ps) for name, ps in passes.items() if ps}
            run = {**out, "passes": passes, "medians": medians, "complete": False}
            cut = {**report, "budgets": {**report["budgets"], key: run}}
            save({**cut, "targets": evaluate_targets(cut)})

        report["budgets"][key] = _budget_run(store, budget, cfg, log, partial)
        report["budgets"][key]["complete"] = True
        report["targets"] = evaluate_targets(report)
        if save is not None:
            save(report)
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def evaluate_targets(report: dict) -> dict[str, dict]:
    """Issue #31's targets at the headline budget (the first), medians of the rounds."""
    from nostall.bench.targets import Targets

    t = Targets()
    runs = list(report["budgets"].values())
    m = runs[0]["medians"] if runs else {}
    ours, pinned = m.get("nostall", {}), m.get("lru-pinned", {})
    t.add(
        "catalog_weights_stall_vs_pinned_lru",
        _ratio(ours.get("weights_stall_s"), pinned.get("weights_stall_s")),
        "<=",
        0.3,
    )
    t.add("catalog_slo_attainment", ours.get("slo_attainment"), ">=", 0.95)
    t.add(
        "catalog_slo_attainment_vs_pinned_lru",
        _ratio(ours.get("slo_attainment"), pinned.get("slo_attainment")),
        ">=",
        1.3,
    )
    t.add(
        "catalog_throughput_vs_pinned_lru",
        _ratio(ours.get("goodput_per_s"), pinned.get("goodput_per_s")),
        ">=",
        1.5,
    )
    t.add(
        "catalog_p99_s_vs_pinned_lru",
        _ratio(ours.get("latency_p99_s"), pinned.get("latency_p99_s")),
        "<=",
        0.6,
    )
    checks = [
        p["images"]
        for run in runs
        for s, ps in run["passes"].items()
        if s == "nostall"
        for p in ps
        if p.get("images")
    ]
    equal = None if not checks else int(all(c["unequal"] == 0 and c["compared"] for c in checks))
    t.add("catalog_images_equal_peer", equal, ">=", 1)
    pre = runs[0].get("preemption") if runs else None
    t.add(
        "preempted_image_equals_straight",
        None if pre is None else int(pre["preempted"] and pre["equal"]),
        ">=",
        1,
    )
    lost = [p["lost"] for run in runs for p in run["passes"].get("nostall", [])]
    t.add("burst_requests_lost", sum(lost) if lost else None, "<=", 0)
    return t


def tables(report: dict) -> list:
    """Per budget, each system's medians; then the targets."""
    from rich.table import Table

    from nostall.bench import targets

    out = []
    for gb, run in report["budgets"].items():
        tab = Table(
            title=f"{gb} GB device budget ({run['budget_bytes'] / 1e9:.3g} GB here), "
            f"{run.get('rate_per_s', 0):.2f} req/s, medians of {report['config']['rounds']} rounds",
            title_justify="left",
        )
        cols = (
            "system",
            "SLO met",
            "goodput/s",
            "p50 s",
            "p99 s",
            "waited for weights s",
            "switches",
            "GPU busy",
            "lost",
        )
        for c in cols:
            tab.add_column(c, justify="left" if c == "system" else "right")
        for name, m in run["medians"].items():
            tab.add_row(
                name,
                f"{m['slo_attainment']:.0%}" if m["slo_attainment"] is not None else "—",
                f"{m['goodput_per_s'] or 0:.3f}",
                f"{m['latency_p50_s'] or 0:.2f}",
                f"{m['latency_p99_s'] or 0:.2f}",
                f"{m['weights_stall_s'] or 0:.2f}",
                f"{m['switches'] or 0:.0f}",
                f"{m['gpu_busy_share'] or 0:.1%}",
                f"{m['lost'] or 0:.0f}",
            )
        out.append(tab)
    out.append(targets.table(report["targets"]))
    return out
