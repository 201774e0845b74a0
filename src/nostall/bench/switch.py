"""``nostall bench switch``: whole-pipeline switches, nostall's model cache against the peers.

The store holds random-weight pipelines at real size (``full``: FLUX.1-dev layout
33.98 GB, a second FLUX sharing everything but its transformer, SDXL 6.94 GB in
fp16) or tiny ones (``tiny``, for CI). A short denoising run follows every switch,
so a switch counts only once the pipeline has actually computed.

Parts (``--part``), each appended to the report as soon as it ends:

* ``nostall``: flux → sdxl → flux → sdxl → flux with a device tier that holds one
  FLUX or one SDXL (never both), twice: the first pass reads the page cache, the
  second is served by the host tier (**memory hit**); then a whole FLUX and a whole
  SDXL from the host tier (device tier emptied first), and FLUX-b after FLUX (shared
  components).
* ``new-process``: a fresh process, cache prepared as a worker does at boot, switches
  to FLUX from the page cache.
* ``cold``: page cache dropped (announced), a fresh process switches to SDXL; the
  disk's sequential read rate is measured beside it.
* ``same-arch``: FLUX ↔ FLUX-b with ``compile_repeated_blocks`` on the transformer:
  the switch copies in place; step times before and after it.
* ``prefetch``: FLUX denoises while SDXL is prefetched; the visible switch to SDXL
  and FLUX's slowdown.
* ``peers``: diffusers ``from_pretrained`` + ``.to`` per switch, both pipelines
  resident in CPU RAM moved with ``.to``, diffusers group offloading with streams,
  and nostall's ``load_model`` per component with a pinned pool.
* ``identity``: what identifying components by all of their bytes costs: a fresh
  process switches to FLUX cold (page cache dropped, announced) with an empty digest
  index, so its reads also hash every byte, then again with the index that run filled
  (nothing hashed), twice each, alternating; then the same pair from the page cache.
* ``memory-hit``: a whole FLUX from the host tier (device tier emptied first), in bf16
  and, from its ``nostall quantize`` copy, in FP8 (transformer, T5 and CLIP; written
  beside the store once), best of three each.
* ``diffusers``: the peer of ``memory-hit``: diffusers ``from_pretrained`` + ``.to`` of
  the bf16 FLUX pipeline (page cache warm), twice.

Every cache of the benchmark keeps its digest index in ``<folder>/.digests``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from nostall.bench.switch_report import evaluate_targets, tables
from nostall.bench.timing import sync
from nostall.synthetic.run import denoise

__all__ = ["PARTS", "evaluate_targets", "run_switch_bench", "tables"]

PARTS = (
    "nostall",
    "new-process",
    "cold",
    "same-arch",
    "prefetch",
    "peers",
    "identity",
    "memory-hit",
    "diffusers",
)
SEQUENCE = ("flux", "sdxl", "flux", "sdxl", "flux")

# Per size: device tier (holds FLUX or SDXL, never both), host tier (holds both), a
# tier big enough for FLUX + SDXL (prefetch), the denoising run.
_SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "gpu_budget": 36 * 10**9,
        "one_flux_budget": 36 * 10**9,
        "host_budget": 72 * 10**9,
        "wide_gpu_budget": 48 * 10**9,
        "steps": 2,
        "res": 256,
        "prefetch_steps": 8,
        "prefetch_res": 512,
        # A serving resolution: at 256 px a compiled step is ~55 ms and varies by ±15%
        # run to run, more than the 5% the first-step target resolves.
        "arch_res": 1024,
        "repeats": 3,
        "prefetch_repeats": 7,
        "pipelines": ("flux", "flux-b", "sdxl"),
        "store_size": "full",
    },
    "tiny": {
        "gpu_budget": 2_000_000,
        "one_flux_budget": 800_000,
        "host_budget": 64 << 20,
        "wide_gpu_budget": 8 << 20,
        "steps": 2,
        "res": 32,
        "prefetch_steps": 2,
        "prefetch_res": 32,
        "arch_res": 32,
        "repeats": 2,
        "prefetch_repeats": 2,
        "pipelines": ("flux", "flux-b", "sdxl"),
        "store_size": "tiny",
    },
}


# A host of one H200 (128 GiB RAM, 64 GiB disk) holds the FLUX and SDXL stores in its
# page cache beside a 48 GB host tier, not a second 23.8 GB FLUX transformer as well:
# without flux-b, the same-architecture part and the shared-components step are skipped.
_SIZES["full-lean"] = {
    **_SIZES["full"],
    "host_budget": 48 * 10**9,
    "pipelines": ("flux", "sdxl"),
}
# FLUX alone (and its FP8 copy): the identity, memory-hit and diffusers parts.
_SIZES["full-flux"] = {**_SIZES["full"], "host_budget": 40 * 10**9, "pipelines": ("flux",)}


class _StepClock:
    """Each denoising step's own time: from the transformer's call (a forward pre-hook)
    to the end of the step (the pipeline's step callback), both synchronised."""

    def __init__(self, pipe: Any, dev: torch.device):
        self.dev, self.starts, self.ends = dev, [], []
        self._hook = pipe.transformer.register_forward_pre_hook(self._start)

    def _start(self, module, args):
        if len(self.starts) == len(self.ends):
            sync(self.dev)
            self.starts.append(time.perf_counter())

    def on_step(self, pipe, i, t, kwargs):
        sync(self.dev)
        self.ends.append(time.perf_counter())
        return kwargs

    def steps(self) -> list[float]:
        self._hook.remove()
        return [b - a for a, b in zip(self.starts, self.ends, strict=False)]


class _Bench:
    def __init__(
        self,
        folder: str,
        size: str,
        dev: torch.device,
        log: Callable[[str], None],
        drop_caches: bool = False,
    ):
        self.folder, self.size, self.dev, self.log = folder, size, dev, log
        self.drop_caches = drop_caches  # dropping evicts every file cached on the machine
        self.cfg = _SIZES[size]
        self.paths = {n: os.path.join(folder, n) for n in self.cfg["pipelines"]}
        self.digests = os.path.join(folder, ".digests")

    def cache(self, **kw):
        import nostall

        kw.setdefault("gpu_budget", self.cfg["gpu_budget"])
        kw.setdefault("host_budget", self.cfg["host_budget"])
        kw.setdefault("cache_dir", self.digests)
        root = kw.pop("root", self.folder)
        cache = nostall.ModelCache(root, device=self.dev, **kw)
        cache.prepare()
        return cache

    def best_host_switch(self, cache, name: str, repeat: int = 3):
        """The fastest of ``repeat`` switches of ``name`` with the GPU tier emptied first
        (the host tier holds it), and the last denoise's seconds."""
        best = None
        for _ in range(repeat):
            cache.evict("gpu")
            with cache.use(name) as pipe:
                report = cache.last_report
                if best is None or report.total_s < best.total_s:
                    best = report
                run_s = self.run(pipe, name)
        return best, run_s

    def run(self, pipe, name, **kw) -> float:
        kw.setdefault("steps", self.cfg["steps"])
        kw.setdefault("res", self.cfg["res"])
        return denoise(pipe, name, dev=self.dev, **kw)

    # ---- nostall -------------------------------------------------------------

    def nostall(self) -> dict:
        out: dict[str, Any] = {"sequence": list(SEQUENCE), "passes": []}
        with self.cache() as cache:
            for scenario in ("page-cache (first pass)", "memory hit (second pass)"):
                steps = []
                for name in SEQUENCE:
                    with cache.use(name) as pipe:
                        report = cache.last_report
                        run_s = self.run(pipe, name)
                    steps.append({"pipeline": name, "switch": report.as_dict(), "denoise_s": run_s})
                    self.log(
                        f"  {scenario}: {name} switch {report.total_s:.3f} s "
                        f"({report.moved_bytes / 1e9:.2f} GB moved), denoise {run_s:.3f} s"
                    )
                out["passes"].append({"scenario": scenario, "steps": steps})
            for name in ("flux", "sdxl"):
                best, run_s = self.best_host_switch(cache, name)
                out[f"{name}_whole_from_host"] = {"switch": best.as_dict(), "denoise_s": run_s}
                self.log(
                    f"  {name} whole pipeline from the host tier: {best.total_s:.3f} s "
                    f"({best.gbps:.1f} GB/s)"
                )
            if "flux-b" not in self.paths:
                out["stats"] = {k: v for k, v in vars(cache.stats()).items() if k != "components"}
                return out
            # Once both have been read (their bytes hashed, or their files the same
            # through symlinks), FLUX-b shares FLUX's T5, CLIP and VAE.
            cache.pipeline("flux-b")
            cache.evict("gpu")
            cache.pipeline("flux")
            with cache.use("flux-b") as pipe:
                report = cache.last_report
                run_s = self.run(pipe, "flux-b")
            out["shared_flux_b_after_flux"] = {"switch": report.as_dict(), "denoise_s": run_s}
            out["stats"] = {k: v for k, v in vars(cache.stats()).items() if k != "components"}
        return out

    # ---- new process / cold --------------------------------------------------------

    def child(self, name: str, cache_dir: str | None = None) -> dict:
        cmd = [
            sys.executable,
            "-m",
            "nostall.bench.switch",
            "child",
            "--store",
            self.folder,
            "--name",
            name,
            "--device",
            str(self.dev),
            "--size",
            self.size,
            "--cache-dir",
            cache_dir or self.digests,
        ]
        t = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"child switch failed: {res.stderr[-2000:]}")
        out = json.loads(res.stdout.strip().splitlines()[-1])
        out["process_wall_s"] = time.perf_counter() - t
        return out

    def new_process(self) -> dict:
        out = self.child("flux")
        self.log(f"  new process, page cache: flux switch {out['switch']['total_s']:.3f} s")
        return out

    def cold(self) -> dict:
        from nostall.bench import load as load_bench

        def drop(before: str) -> str | None:
            if not self.drop_caches:
                return "the page cache is dropped only when asked (drop_caches=True, --drop-caches)"
            self.log(
                f"  dropping the OS page cache (sync; echo 3 > drop_caches) before the {before}"
            )
            return load_bench.drop_caches()

        why = drop("cold switch")
        if why:
            return {"skipped": why}
        out = self.child("sdxl")
        unet = _largest_file(os.path.join(self.paths["sdxl"], "unet"))
        disk = load_bench.disk_limit(unet, direct=False, drop=drop)  # (seconds, GB/s)
        out["disk"] = {"file": unet, "gbps": disk[1] if disk else None}
        s = out["switch"]
        out["gbps"] = s["moved_bytes"] / s["total_s"] / 1e9
        self.log(
            f"  cold: sdxl switch {s['total_s']:.3f} s = {out['gbps']:.2f} GB/s; disk "
            f"{out['disk']['gbps']} GB/s"
        )
        return out

    # ---- same architecture ---------------------------------------------------------

    def same_arch(self) -> dict:
        out: dict[str, Any] = {}
        if "flux-b" not in self.paths:
            return {"skipped": "no second FLUX checkpoint in this store (size full-lean)"}
        # A device tier that holds one FLUX: the second one must go in place.
        with self.cache(gpu_budget=self.cfg["one_flux_budget"]) as cache:
            pipe = cache.pipeline("flux")
            t = time.perf_counter()
            compiled = self.dev.type == "cuda"
            if compiled:
                pipe.transformer.compile_repeated_blocks(fullgraph=True)
            steps, res = max(4, self.cfg["steps"]), self.cfg["arch_res"]
            self.run(pipe, "flux", steps=steps, res=res)  # compiles
            out["compile_s"] = time.perf_counter() - t
            out["compiled"] = compiled
            warm = []
            for _ in range(self.cfg["repeats"]):
                clock = _StepClock(pipe, self.dev)
                self.run(pipe, "flux", steps=steps, res=res, on_step=clock.on_step)
                warm += clock.steps()
            steady = _median(warm)
            runs = []
            for name in ("flux-b", "flux", "flux-b", "flux"):
                pipe = cache.pipeline(name)
                report = cache.last_report
                clock = _StepClock(pipe, self.dev)
                self.run(pipe, name, steps=steps, res=res, on_step=clock.on_step)
                times = clock.steps()
                runs.append(
                    {
                        "pipeline": name,
                        "switch": report.as_dict(),
                        "step_s": times,
                        "first_step_s": times[0] if times else None,
                        "steady_step_s": steady,
                        "transformer_in_place": any(c.in_place for c in report.components),
                    }
                )
                self.log(
                    f"  same-arch → {name}: switch {report.total_s:.3f} s, first step "
                    f"{runs[-1]['first_step_s']:.4f} s vs steady {steady:.4f} s"
                )
            out["same_module_throughout"] = (
                len({id(cache.pipeline(n).transformer) for n in ("flux", "flux-b")}) == 1
            )
            out["runs"] = runs
            out["steady_step_s"] = steady
        return out

    # ---- prefetch --------------------------------------------------------------

    def prefetch(self) -> dict:
        out: dict[str, Any] = {}
        kw = {"steps": self.cfg["prefetch_steps"], "res": self.cfg["prefetch_res"]}
        with self.cache(gpu_budget=self.cfg["wide_gpu_budget"]) as cache:
            cache.pipeline("sdxl")
            cache.pipeline("flux")  # both in the host tier now
            cache.evict("gpu")
            with cache.use("flux") as pipe:
                self.run(pipe, "flux", **kw)  # warm-up
            base, during, pres = [], [], []
            # Back-to-back pairs, the ratio's median: a FLUX run of 0.6 s varied by up to
            # 2x between repeats on the one-H200 host, more than the 5% being measured.
            for _ in range(self.cfg["prefetch_repeats"]):
                # Each repeat: sdxl back to the host tier only, then flux alone and flux
                # with sdxl prefetched under it, back to back.
                cache.evict("gpu")
                with cache.use("flux") as pipe:
                    base.append(self.run(pipe, "flux", **kw))
                    future = cache.prefetch("sdxl")
                    during.append(self.run(pipe, "flux", **kw))
                    pres.append(future.result())
            with cache.use("sdxl") as pipe:
                visible = cache.last_report
                self.run(pipe, "sdxl")
        out.update(
            flux_denoise_s=_median(base),
            flux_denoise_with_prefetch_s=_median(during),
            runs=[{"alone_s": a, "with_prefetch_s": b} for a, b in zip(base, during, strict=True)],
            slowdown=_median([b / a for a, b in zip(base, during, strict=True)]) - 1,
            prefetch=pres[-1].as_dict(),
            prefetch_s=[p.total_s for p in pres],
            visible_switch=visible.as_dict(),
        )
        base, during, pre = out["flux_denoise_s"], out["flux_denoise_with_prefetch_s"], pres[-1]
        self.log(
            f"  prefetch: sdxl moved in {pre.total_s:.3f} s during flux ({base:.3f} → "
            f"{during:.3f} s); visible switch {visible.total_s:.4f} s"
        )
        return out

    # ---- identity --------------------------------------------------------------------

    def identity(self) -> dict:
        """Cold and page-cache FLUX switches in fresh processes, hashing (empty digest
        index) against not (the index that run filled), alternating."""
        import shutil

        from nostall.bench import load as load_bench

        fresh = os.path.join(self.folder, ".digests-fresh")
        out: dict[str, Any] = {"cold": [], "page_cache": []}

        def run(kind: str, hashing: bool) -> None:
            if hashing:
                shutil.rmtree(fresh, ignore_errors=True)
            if kind == "cold":
                self.log("  dropping the OS page cache (sync; echo 3 > drop_caches)")
                why = load_bench.drop_caches()
                if why:
                    raise RuntimeError(f"cannot drop the page cache: {why}")
            r = self.child("flux", cache_dir=fresh)
            hashed = [c["role"] for c in r["switch"]["components"] if c.get("hashed")]
            if hashing != bool(hashed):
                raise RuntimeError(f"expected hashing={hashing}, the switch hashed {hashed}")
            out[kind].append({"hashing": hashing, "total_s": r["switch"]["total_s"]})
            self.log(
                f"  {kind}, {'hashing' if hashing else 'digests known'}: flux switch "
                f"{r['switch']['total_s']:.3f} s ({r['switch']['gbps']:.2f} GB/s)"
            )

        for _ in range(self.cfg["repeats"] - 1 if self.drop_caches else 0):  # cold: when asked
            run("cold", True)
            run("cold", False)
        run("page_cache", True)
        run("page_cache", False)
        for kind in ("cold", "page_cache") if self.drop_caches else ("page_cache",):
            with_ = [r["total_s"] for r in out[kind] if r["hashing"]]
            without = [r["total_s"] for r in out[kind] if not r["hashing"]]
            out[f"{kind}_overhead"] = min(with_) / min(without) - 1
        return out

    # ---- memory hits, bf16 and FP8, and their peer ----------------------------------

    def memory_hit(self) -> dict:
        from nostall.bench.fp8 import fp8_store

        out: dict[str, Any] = {}
        fp8_root = fp8_store(self.folder, log=self.log)
        for label, root, name in (("bf16", self.folder, "flux"), ("fp8", fp8_root, "flux8")):
            with self.cache(root=root, dtype=torch.bfloat16) as cache:
                cache.pipeline(name)  # read once: the host tier holds it
                best, run_s = self.best_host_switch(cache, name)
                out[label] = {"switch": best.as_dict(), "denoise_s": run_s}
                self.log(
                    f"  {label} FLUX whole pipeline from the host tier: {best.total_s:.3f} s, "
                    f"{best.moved_bytes / 1e9:.2f} GB ({best.gbps:.1f} GB/s)"
                )
        return out

    def diffusers(self) -> dict:
        from diffusers import DiffusionPipeline

        rows = []
        for _ in range(2):
            gc.collect()
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
            sync(self.dev)
            t = time.perf_counter()
            pipe = DiffusionPipeline.from_pretrained(
                self.paths["flux"], torch_dtype=torch.bfloat16
            ).to(self.dev)
            sync(self.dev)
            rows.append({"pipeline": "flux", "switch_s": time.perf_counter() - t})
            pipe.set_progress_bar_config(disable=True)
            rows[-1]["denoise_s"] = self.run(pipe, "flux")
            self.log(f"  diffusers from_pretrained + .to: flux {rows[-1]['switch_s']:.3f} s")
            pipe = None
        return {"diffusers_from_pretrained_to": rows}

    # ---- peers -----------------------------------------------------------------

    def peers(self) -> dict:
        from diffusers import DiffusionPipeline

        out: dict[str, Any] = {}
        dtype = {"flux": torch.bfloat16, "sdxl": torch.float16}

        def free():
            gc.collect()
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()

        seq = ("flux", "sdxl", "flux")
        rows = []
        pipe = None
        for name in seq:
            pipe = None
            free()
            sync(self.dev)
            t = time.perf_counter()
            pipe = DiffusionPipeline.from_pretrained(self.paths[name], torch_dtype=dtype[name]).to(
                self.dev
            )
            pipe.set_progress_bar_config(disable=True)
            sync(self.dev)
            rows.append(
                {
                    "pipeline": name,
                    "switch_s": time.perf_counter() - t,
                    "denoise_s": self.run(pipe, name),
                }
            )
            self.log(f"  diffusers from_pretrained + .to: {name} {rows[-1]['switch_s']:.3f} s")
        out["diffusers_from_pretrained_to"] = rows
        pipe = None
        free()

        resident = {
            n: DiffusionPipeline.from_pretrained(self.paths[n], torch_dtype=dtype[n])
            for n in ("flux", "sdxl")
        }
        for p in resident.values():
            p.set_progress_bar_config(disable=True)
        rows, current = [], None
        for name in ("flux", "sdxl"):
            sync(self.dev)
            t = time.perf_counter()
            if current is not None:
                resident[current].to("cpu")
            resident[name].to(self.dev)
            sync(self.dev)
            rows.append(
                {
                    "pipeline": name,
                    "switch_s": time.perf_counter() - t,
                    "denoise_s": self.run(resident[name], name),
                }
            )
            current = name
            self.log(f"  CPU-resident .to moves: {name} {rows[-1]['switch_s']:.3f} s")
        out["cpu_resident_to"] = rows
        resident = None
        free()

        sync(self.dev)
        t = time.perf_counter()
        pipe = DiffusionPipeline.from_pretrained(self.paths["flux"], torch_dtype=dtype["flux"])
        pipe.set_progress_bar_config(disable=True)
        try:
            pipe.enable_group_offload(
                onload_device=self.dev,
                offload_device=torch.device("cpu"),
                offload_type="leaf_level",
                use_stream=True,
            )
            setup = time.perf_counter() - t
            out["diffusers_group_offload_streams"] = {
                "pipeline": "flux",
                "setup_s": setup,
                "denoise_s": self.run(pipe, "flux"),
            }
            self.log(
                f"  diffusers group offloading (streams): flux setup {setup:.3f} s, "
                f"denoise {out['diffusers_group_offload_streams']['denoise_s']:.3f} s"
            )
        except Exception as e:  # a peer failing is a finding, reported beside the others
            out["diffusers_group_offload_streams"] = {"error": f"{type(e).__name__}: {e}"}
        pipe = None
        free()

        out["nostall_load_model"] = self._load_model_peer(dtype)
        return out

    def _load_model_peer(self, dtype) -> list[dict]:
        from diffusers import DiffusionPipeline

        import nostall
        from nostall.cache import Store

        store = Store(self.folder)
        sizes = sum(store.entry(n).nbytes for n in ("flux", "sdxl"))
        rows = []
        with nostall.PinnedPool(
            int(sizes * 1.2), device=self.dev if self.dev.type == "cuda" else None
        ) as pool:
            pool.wait_pinned()
            for name in ("flux", "sdxl", "flux", "sdxl", "flux"):
                gc.collect()
                if self.dev.type == "cuda":
                    torch.cuda.empty_cache()
                sync(self.dev)
                t = time.perf_counter()
                entry = store.entry(name)
                parts = {
                    c.role: nostall.load_model(c.folder, device=self.dev, pool=pool)
                    for c in entry.weights
                }
                pipe = DiffusionPipeline.from_pretrained(self.paths[name], **parts)
                pipe.set_progress_bar_config(disable=True)
                sync(self.dev)
                rows.append(
                    {
                        "pipeline": name,
                        "switch_s": time.perf_counter() - t,
                        "denoise_s": self.run(pipe, name),
                    }
                )
                self.log(f"  nostall load_model per component: {name} {rows[-1]['switch_s']:.3f} s")
                pipe = parts = None
        return rows


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _largest_file(folder: str) -> str:
    files = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")]
    return max(files, key=os.path.getsize)


def run_switch_bench(
    *,
    folder: str,
    size: str = "full",
    device: str = "cuda",
    parts: tuple[str, ...] = PARTS,
    log: Callable[[str], None] = print,
    save: Callable[[dict], None] | None = None,
    drop_caches: bool = False,
) -> dict:
    """Write (or reuse) the store, run the parts, return the report (saved after each part);
    the cold runs drop the OS page cache (all of it), only with ``drop_caches=True``."""
    from nostall.bench.record import header
    from nostall.synthetic import write_store
    from nostall.transfer.loader import resolve_device

    dev = resolve_device(device)
    t = time.perf_counter()
    cfg = _SIZES[size]
    write_store(folder, cfg["pipelines"], size=cfg["store_size"], device=dev, progress=log)
    report: dict[str, Any] = {
        **header("switch", dev),
        "config": {"size": size, "device": str(dev), **_SIZES[size], "parts": list(parts)},
        "store_write_s": time.perf_counter() - t,
    }
    from nostall.cache import Store

    store = Store(folder)
    report["store"] = {
        n: {
            "bytes": store.entry(n).nbytes,
            "components": {c.role: c.nbytes for c in store.entry(n).weights},
        }
        for n in store.names()
    }
    bench = _Bench(folder, size, dev, log, drop_caches)
    for part in parts:
        log(f"== {part}")
        t = time.perf_counter()
        try:
            report[part] = getattr(bench, part.replace("-", "_"))()
        except Exception as e:  # reported, and the other parts still run
            report[part] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  {part} failed: {type(e).__name__}: {e}")
        report[part]["part_s"] = time.perf_counter() - t
        report["targets"] = evaluate_targets(report)
        if save is not None:
            save(report)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return report


def _child(args) -> None:
    import logging

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    import nostall
    from nostall.transfer.loader import resolve_device

    dev = resolve_device(args.device)
    cfg = _SIZES[args.size]
    cache = nostall.ModelCache(
        args.store,
        device=dev,
        gpu_budget=cfg["gpu_budget"],
        host_budget=cfg["host_budget"],
        cache_dir=args.cache_dir,
    )
    cache.prepare(args.name)  # what a worker does at boot: tiers ready, store read
    with cache.use(args.name) as pipe:
        report = cache.last_report
        run_s = denoise(pipe, args.name, steps=cfg["steps"], res=cfg["res"], dev=dev)
    print(json.dumps({"switch": report.as_dict(), "denoise_s": run_s}))
    cache.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m nostall.bench.switch")
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("child")
    c.add_argument("--store", required=True)
    c.add_argument("--name", required=True)
    c.add_argument("--device", default="cuda")
    c.add_argument("--size", default="full")
    c.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    _child(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
