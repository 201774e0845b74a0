"""``nostall bench adapters``: LoRAs and a ControlNet on a cached FLUX, nostall against
diffusers (+ PEFT), in one process on one device.

The store holds a FLUX.1-dev pipeline with random weights (``full``: real size, 33.98 GB;
``tiny``: the tiny FLUX, for CPU runs) and random LoRAs beside it in ``<store>/loras``,
two per rank (``r<rank>-a``, ``r<rank>-b``), each adapting every linear layer of the
transformer's blocks that FLUX LoRAs adapt (418 at full size), written as diffusers'
``save_lora_weights`` writes them (:func:`write_loras`). Parts (``parts``):

* ``peer``: diffusers + PEFT on a pipeline from ``DiffusionPipeline.from_pretrained``
  moved to the device: the first ``load_lora_weights``, the next adapter's, the
  transformer's forward with that adapter active and unfused against the base (1024²
  at full size; tiny: 256 image tokens), ``fuse_lora`` / ``unfuse_lora``, then hotswaps
  (``load_lora_weights(..., hotswap=True)`` into one adapter, alternating two LoRAs of
  the rank, median) from the files and, its best case, from state dicts held in host
  memory, for ranks 16 and 64 (tiny: 2 and 4).
* ``nostall``: a :class:`nostall.ModelCache` over the same store. With the pipeline
  resident, the time to enter ``cache.use("flux", loras={lora: 1.0})`` switching from
  another LoRA of the rank (median; ranks 16, 64, 128, tiny 2, 4, 8), from and to the
  base; the forward with a fused LoRA against the base's (alternating blocks);
  frames compiled over 20 switches after warm-up with the transformer's blocks under
  ``torch.compile`` (``compile_repeated_blocks``; on a CPU with ``backend="eager"``, so
  no C++ compiler runs), counted by ``torch._dynamo``; and whether every transformer
  parameter, back on the base, equals bit for bit a copy taken before any LoRA.
* ``controlnet``: a random ControlNet (full: InstantX's Union layout, 6.60 GB) attached
  to the cached FLUX from the pinned host tier against diffusers' load and pipeline
  build, and one image of each compared (:mod:`nostall.bench.adapters_controlnet`).

The report's ``targets`` are the adapters issue's (#19); :func:`evaluate_targets`
recomputes them.
"""

from __future__ import annotations

import gc
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from nostall.bench import adapters_controlnet
from nostall.bench.record import check_run, header
from nostall.bench.targets import Targets
from nostall.bench.timing import sync, timed

__all__ = ["PARTS", "SIZES", "evaluate_targets", "run_adapters_bench", "tables", "write_loras"]

PARTS = ("peer", "nostall", "controlnet")
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "ranks": (16, 64, 128),
        "peer_ranks": (16, 64),
        "switch_rank": 64,  # the rank the switch targets are read at
        "dtype": "bfloat16",
    },
    # the middle rank stands for 64: its figures keep the targets' names
    "tiny": {
        "ranks": (2, 4, 8),
        "peer_ranks": (2, 4),
        "switch_rank": 4,
        "dtype": "float32",
    },
}
COMPILE_SWITCHES = 20
# What FLUX LoRAs adapt (ai-toolkit, kohya's FLUX scripts): every linear layer of the
# double and single blocks, 418 at full size (diffusers' module names, suffixes).
FLUX_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "proj_mlp",
    "proj_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
_BLOCKS = re.compile(r"(single_)?transformer_blocks\.\d+\.")
HOTSWAP_NOTE = (
    "diffusers 0.42.1 with peft 0.21 hotswaps an uncompiled transformer without "
    "enable_lora_hotswap (an equal or smaller rank is copied in place, zero-padded; a larger "
    "one swaps tensors); a compiled one needs enable_lora_hotswap(target_rank) before the "
    "first load (ranks padded, scalings as tensors, so no recompile). The peer calls it "
    "before each rank's first load, as a compiled server must."
)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ---- the LoRA files ------------------------------------------------------------------


def _target_linears(transformer_folder: str) -> dict[str, tuple[int, int]]:
    """``module name → (out, in)`` of every linear layer a FLUX LoRA adapts, from the
    transformer built on ``meta`` (no weight is read)."""
    import diffusers

    cfg = diffusers.FluxTransformer2DModel.load_config(transformer_folder)
    cls = getattr(diffusers, cfg.get("_class_name", "FluxTransformer2DModel"))
    with torch.device("meta"):
        model = cls.from_config(cfg)
    return {
        name: (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and _BLOCKS.match(name)
        and any(name.endswith(f".{s}") for s in FLUX_TARGETS)
    }


def write_loras(
    pipeline: str,
    folder: str,
    ranks: tuple[int, ...],
    *,
    device: torch.device | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """Two random LoRAs per rank for the FLUX pipeline folder ``pipeline``, as
    ``<folder>/r<rank>-a.safetensors`` and ``-b``; a file already written for the same
    layers is kept. Returns ``name → {"path", "rank", "layers", "bytes"}``.

    Each file is what ``FluxPipeline.save_lora_weights`` writes for a PEFT adapter:
    ``transformer.<module>.lora_A.weight`` (rank × in) and ``.lora_B.weight`` (out ×
    rank) in bf16, and a ``lora_adapter_metadata`` header entry holding the
    ``LoraConfig`` arguments under ``transformer.`` (``r``, ``lora_alpha = r``: scale 1,
    ``target_modules``), from which diffusers builds the adapter.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    layers = _target_linears(os.path.join(pipeline, "transformer"))
    gen_dev = device if device is not None and device.type == "cuda" else torch.device("cpu")
    os.makedirs(folder, exist_ok=True)
    out: dict[str, dict[str, Any]] = {}
    for rank in ranks:
        for i, tag in enumerate("ab"):
            name = f"r{rank}-{tag}"
            path = os.path.join(folder, f"{name}.safetensors")
            stamp = json.dumps({"rank": rank, "seed": 2 * rank + i, "layers": sorted(layers)})
            if os.path.isfile(path):
                with safe_open(path, framework="pt") as f:
                    if (f.metadata() or {}).get("nostall_bench") == stamp:
                        out[name] = _lora_info(path, rank, len(layers))
                        continue
            g = torch.Generator(device=gen_dev).manual_seed(2 * rank + i)
            tensors = {}
            for module, (n_out, n_in) in layers.items():
                for ab, shape, fan_in in (("A", (rank, n_in), n_in), ("B", (n_out, rank), rank)):
                    t = torch.randn(shape, generator=g, device=gen_dev) * (0.5 / fan_in**0.5)
                    tensors[f"transformer.{module}.lora_{ab}.weight"] = t.to(torch.bfloat16).cpu()
            meta = {
                "transformer.r": rank,
                "transformer.lora_alpha": rank,
                "transformer.target_modules": sorted(layers),
            }
            header_ = {
                "format": "pt",
                "lora_adapter_metadata": json.dumps(meta, indent=2, sort_keys=True),
                "nostall_bench": stamp,
            }
            tmp = f"{path}.partial"
            save_file(tensors, tmp, metadata=header_)
            os.replace(tmp, path)  # a reader sees no file or the whole one
            out[name] = _lora_info(path, rank, len(layers))
            log(f"  wrote LoRA {name}: {len(layers)} layers, {out[name]['bytes'] / 1e6:.1f} MB")
    return out


def _lora_info(path: str, rank: int, layers: int) -> dict[str, Any]:
    return {"path": path, "rank": rank, "layers": layers, "bytes": os.path.getsize(path)}


# ---- the benchmark -------------------------------------------------------------------


class _Bench:
    def __init__(self, store: str, size: str, dev: torch.device, repeat: int, log):
        self.store, self.size, self.dev, self.repeat, self.log = store, size, dev, repeat, log
        self.cfg = SIZES[size]
        self.flux = os.path.join(store, "flux")
        self.loras = os.path.join(store, "loras")
        self.dtype = getattr(torch, self.cfg["dtype"])

    def lora(self, rank: int, tag: str) -> str:
        return os.path.join(self.loras, f"r{rank}-{tag}.safetensors")

    def free(self) -> None:
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def inputs(self, transformer: torch.nn.Module) -> dict[str, Any]:
        """One denoising step's inputs, batch 1, in the transformer's dtype (full: 1024²,
        4096 image and 512 text tokens; tiny: 256 and 32)."""
        from nostall.synthetic import step_inputs

        dtype = next(transformer.parameters()).dtype
        return step_inputs(transformer, self.size, self.dev, dtype=dtype)

    def forward(self, transformer: torch.nn.Module, inputs: dict, n: int) -> list[float]:
        """Seconds of ``n`` forwards after one warm-up."""
        with torch.inference_mode():
            transformer(**inputs)
            return [timed(self.dev, transformer, **inputs)[0] for _ in range(n)]

    # ---- diffusers + PEFT ------------------------------------------------------------

    def peer(self) -> dict:
        from diffusers import DiffusionPipeline
        from safetensors.torch import load_file

        dev, out = self.dev, {"ranks": {}, "hotswap_note": HOTSWAP_NOTE}
        out["from_pretrained_to_s"], pipe = timed(
            dev,
            lambda: DiffusionPipeline.from_pretrained(self.flux, dtype=self.dtype).to(dev),
        )
        pipe.set_progress_bar_config(disable=True)
        tr = pipe.transformer
        inputs = self.inputs(tr)
        base = _median(self.forward(tr, inputs, self.repeat))
        out["base_forward_s"] = base
        self.log(
            f"  diffusers from_pretrained + .to {out['from_pretrained_to_s']:.3f} s; "
            f"base forward {base * 1e3:.1f} ms"
        )
        for r in self.cfg["peer_ranks"]:
            a, b = self.lora(r, "a"), self.lora(r, "b")
            row: dict[str, Any] = {}
            # Adapter names no weight key contains: diffusers reports as missing every key
            # of another adapter that contains the loaded adapter's name ("a", "b" do).
            load = pipe.load_lora_weights
            row["first_load_s"], _ = timed(dev, load, a, adapter_name="lora-first")
            row["next_load_s"], _ = timed(dev, load, b, adapter_name="lora-next")
            pipe.set_adapters(["lora-next"], [1.0])
            fwd = _median(self.forward(tr, inputs, self.repeat))
            row["unfused_forward_s"], row["unfused_forward_overhead"] = fwd, fwd / base - 1
            row["fuse_s"], _ = timed(dev, pipe.fuse_lora, components=["transformer"])
            row["unfuse_s"], _ = timed(dev, pipe.unfuse_lora, components=["transformer"])
            row["unload_s"], _ = timed(dev, pipe.unload_lora_weights)
            pipe.enable_lora_hotswap(target_rank=r)  # before the first load (module note)
            load(a, adapter_name="lora-swap")
            swaps = [
                timed(dev, load, (b, a)[i % 2], adapter_name="lora-swap", hotswap=True)[0]
                for i in range(self.repeat)
            ]
            row["hotswap_runs_s"], row["hotswap_s"] = swaps, _median(swaps)
            # the peer's best case, as nostall keeps LoRAs read: state dicts in host memory
            held = [load_file(p) for p in (b, a)]
            swaps = [
                timed(dev, load, held[i % 2], adapter_name="lora-swap", hotswap=True)[0]
                for i in range(self.repeat)
            ]
            row["hotswap_from_memory_s"] = _median(swaps)
            pipe.unload_lora_weights()
            out["ranks"][str(r)] = row
            self.log(
                f"  rank {r}: first load {row['first_load_s']:.3f} s, next "
                f"{row['next_load_s']:.3f} s, hotswap {row['hotswap_s']:.4f} s (from host "
                f"memory {row['hotswap_from_memory_s']:.4f} s), fuse {row['fuse_s']:.4f} s / "
                f"unfuse {row['unfuse_s']:.4f} s; unfused adapter forward "
                f"{row['unfused_forward_overhead']:+.1%}"
            )
        return out

    # ---- ControlNet ------------------------------------------------------------------

    def controlnet(self) -> dict:
        part = adapters_controlnet.ControlNetPart(
            self.store, self.size, self.dev, self.dtype, self.repeat, self.log
        )
        return part.run()

    # ---- nostall ---------------------------------------------------------------------

    def cache(self):
        import nostall
        from nostall.adapters import lora_bytes
        from nostall.cache import Store

        nbytes = Store(self.store, cache_dir=False).entry("flux").nbytes
        loras = int(lora_bytes(self.loras) * 1.15)  # every LoRA kept pinned (size classes)
        return nostall.ModelCache(
            self.store,
            device=self.dev,
            gpu_budget=int(nbytes * 1.15) + (1 << 30),
            host_budget=int(nbytes * 1.15) + (1 << 30) + loras,
            lora_budget=loras,
            cache_dir=os.path.join(self.store, ".digests"),
        )

    def enter(self, cache, loras: dict[str, float] | None) -> float:
        """Seconds to enter ``cache.use("flux", loras=...)``, synchronised."""
        sync(self.dev)
        t = time.perf_counter()
        with cache.use("flux", loras=loras):
            sync(self.dev)
            return time.perf_counter() - t

    def nostall(self) -> dict:
        out: dict[str, Any] = {"switch": {}}
        with self.cache() as cache:
            out["first_use_s"], pipe = timed(self.dev, cache.pipeline, "flux")  # resident
            tr = pipe.transformer
            names = [n for n, _ in tr.named_parameters()]
            # the base before any LoRA, on the device: a second copy of the transformer
            snapshot = {n: p.detach().clone() for n, p in tr.named_parameters()}
            for r in self.cfg["ranks"]:
                out["switch"][str(r)] = self.switches(cache, r)
            out["forward"] = self.overhead(cache, tr)
            try:
                out["compiled"] = self.recompiles(cache, tr)
            except Exception as e:  # reported; the base check below still runs
                out["compiled"] = {"error": f"{type(e).__name__}: {e}"[:1000]}
                self.log(f"  compiled switches failed: {out['compiled']['error']}")
            with cache.use("flux") as pipe:
                now = dict(pipe.transformer.named_parameters())
                differ = [n for n in names if n not in now or not torch.equal(now[n], snapshot[n])]
                same_module = pipe.transformer is tr
        out["base_restored"] = {
            "bit_exact": int(not differ),
            "parameters": len(names),
            "differing": differ[:20],
            "same_module": same_module,
        }
        self.log(f"  base restored bit for bit: {not differ} ({len(names)} parameters)")
        return out

    def switches(self, cache, r: int) -> dict:
        a, b = f"r{r}-a", f"r{r}-b"
        first = [self.enter(cache, {n: 1.0}) for n in (a, b)]  # each file read here
        lora = [self.enter(cache, {(a, b)[i % 2]: 1.0}) for i in range(self.repeat)]
        to_base, from_base = [], []
        for _ in range(self.repeat):
            to_base.append(self.enter(cache, None))
            from_base.append(self.enter(cache, {a: 1.0}))
        row = {
            "first_switch_s": first,  # the file read, then fused
            "switch_runs_s": lora,
            "switch_s": _median(lora),
            "to_base_s": _median(to_base),
            "from_base_s": _median(from_base),
        }
        self.log(
            f"  rank {r}: LoRA → LoRA {row['switch_s']:.4f} s (first, file read: "
            f"{max(first):.3f} s), → base {row['to_base_s']:.4f} s, base → LoRA "
            f"{row['from_base_s']:.4f} s"
        )
        return row

    def overhead(self, cache, tr: torch.nn.Module) -> dict:
        """The forward with a fused LoRA against the base's, in alternating blocks."""
        lora = {f"r{self.cfg['switch_rank']}-a": 1.0}
        inputs = self.inputs(tr)
        base_s, lora_s = [], []
        for _ in range(self.repeat):
            for loras, into in ((None, base_s), (lora, lora_s)):
                with cache.use("flux", loras=loras) as pipe:
                    into += self.forward(pipe.transformer, inputs, 1)
        out = {"base_forward_s": _median(base_s), "lora_forward_s": _median(lora_s)}
        out["overhead"] = out["lora_forward_s"] / out["base_forward_s"] - 1
        self.log(
            f"  forward: base {out['base_forward_s'] * 1e3:.1f} ms, fused rank "
            f"{self.cfg['switch_rank']} LoRA {out['lora_forward_s'] * 1e3:.1f} ms "
            f"({out['overhead']:+.1%})"
        )
        return out

    def recompiles(self, cache, tr: torch.nn.Module) -> dict:
        """Graphs compiled over :data:`COMPILE_SWITCHES` switches (LoRAs of every rank
        and the base in turn, a forward after each), after a warm-up that compiled the
        transformer and ran it with the base and with a LoRA."""
        from torch._dynamo.utils import counters

        kw: dict[str, Any] = {"fullgraph": True}
        if self.dev.type != "cuda":
            kw["backend"] = "eager"  # traced as on a GPU, no C++ compiler needed
        t = time.perf_counter()
        if getattr(tr, "_repeated_blocks", None):
            tr.compile_repeated_blocks(**kw)
            how = "compile_repeated_blocks"
        else:
            tr.compile(**kw)
            how = "compile"
        inputs = self.inputs(tr)
        states = [None] + [{f"r{r}-{tag}": 1.0} for tag in "ab" for r in self.cfg["ranks"]]
        for loras in states[:2]:  # warm-up: compiles
            with cache.use("flux", loras=loras) as pipe:
                self.forward(pipe.transformer, inputs, 1)
        compile_s = time.perf_counter() - t
        graphs = counters["stats"]["unique_graphs"]
        runs = []
        for i in range(COMPILE_SWITCHES):
            loras = states[(i + 2) % len(states)]
            sync(self.dev)
            t = time.perf_counter()
            with cache.use("flux", loras=loras) as pipe:
                sync(self.dev)
                switch_s = time.perf_counter() - t
                assert pipe.transformer is tr, "the cache rebuilt a resident transformer"
                (fwd,) = self.forward(pipe.transformer, inputs, 1)
            runs.append({"loras": sorted(loras or {}), "switch_s": switch_s, "forward_s": fwd})
        out = {
            "how": how,
            "backend": kw.get("backend", "inductor"),
            "compile_s": compile_s,
            "graphs_after_warm_up": graphs,
            "frames_compiled": counters["stats"]["unique_graphs"] - graphs,
            "switches": COMPILE_SWITCHES,
            "runs": runs,
        }
        self.log(
            f"  compiled ({how}, {out['backend']}, {compile_s:.1f} s): "
            f"{out['frames_compiled']} frames compiled over {COMPILE_SWITCHES} switches"
        )
        return out


def _versions(*names: str) -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def evaluate_targets(report: dict) -> dict[str, dict]:
    """The adapters issue's targets, each ``{"value", "threshold", "op", "met"}`` (``met``
    is ``None`` where the figure was not measured). The switch targets are read at the
    size's ``switch_rank`` (64; tiny 4) under their rank-64 names."""
    t = Targets()

    rank = str(report.get("config", {}).get("switch_rank", 64))
    ours = report.get("nostall", {})
    switch = ours.get("switch", {}).get(rank, {}).get("switch_s")
    hotswap = report.get("peer", {}).get("ranks", {}).get(rank, {}).get("hotswap_s")
    t.add("lora_switch_s_r64", switch, "<=", 0.02)
    ratio = hotswap / switch if hotswap and switch else None
    t.add("lora_switch_vs_diffusers_hotswap", ratio, ">=", 10.0)
    t.add("lora_forward_overhead", ours.get("forward", {}).get("overhead"), "<=", 0.03)
    t.add("lora_recompiles", ours.get("compiled", {}).get("frames_compiled"), "<=", 0)
    t.add("lora_base_restored_bit_exact", ours.get("base_restored", {}).get("bit_exact"), ">=", 1)
    attach = report.get("controlnet", {}).get("attach_gbps")
    t.add("controlnet_attach_gbps", attach, ">=", 45.0)
    return t


def run_adapters_bench(
    *,
    size: str = "full",
    device: str = "cuda",
    parts: tuple[str, ...] = PARTS,
    repeat: int = 5,
    work: str | None = None,
    log: Callable[[str], None] = print,
    save: Callable[[dict], None] | None = None,
    previous: dict | None = None,
) -> dict:
    """Write (or reuse) the store and the LoRAs under ``work`` (default: full size
    ``/tmp/nostall-bench/adapters``, kept; tiny a new temporary folder), run the parts,
    return the report (handed to ``save`` after each part). ``previous``: an earlier
    report of the same size, device and repeat whose other parts this one keeps (a long
    run as several commands; ``appended`` names the parts kept and their commit)."""
    import logging

    from nostall.errors import ArgumentError
    from nostall.synthetic import write_store
    from nostall.transfer.loader import resolve_device

    check_run(size, SIZES, repeat, parts, PARTS)
    if previous is not None:
        earlier = previous.get("config", {})
        ran = {"size": size, "device": str(resolve_device(device)), "repeat": repeat}
        if {k: earlier.get(k) for k in ran} != ran:
            raise ArgumentError(
                f"the earlier report ran { ({k: earlier.get(k) for k in ran}) } and this run "
                f"{ran}; run the same --size, --device and --repeat to add to it"
            )
    import diffusers  # noqa: F401  (configures its loggers: the level set below stays)

    # per-load notices ("no LoRA keys for CLIPTextModel"), not findings
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    dev = resolve_device(device)
    if work is None:
        work = (
            "/tmp/nostall-bench/adapters"
            if size == "full"
            else tempfile.mkdtemp(prefix="nostall-adapters-")
        )
    cfg = SIZES[size]
    store = os.path.join(work, "store")
    t = time.perf_counter()
    write_store(store, ("flux",), size=size, device=dev, progress=log)
    ranks = tuple(sorted({*cfg["ranks"], *cfg["peer_ranks"]}))
    loras: dict[str, dict[str, Any]] = {}
    if {"peer", "nostall"} & set(parts):  # (the controlnet part writes its own file)
        loras = write_loras(
            os.path.join(store, "flux"), os.path.join(store, "loras"), ranks, device=dev, log=log
        )
    report: dict[str, Any] = {
        **header("adapters", dev),
        "config": {
            "size": size,
            "device": str(dev),
            **cfg,
            "repeat": repeat,
            "parts": list(parts),
            "model": "FLUX.1-dev layout, random weights" if size == "full" else "tiny FLUX",
            "lora_targets": list(FLUX_TARGETS),
            "compile_switches": COMPILE_SWITCHES,
            "versions": _versions("diffusers", "peft", "transformers"),
        },
        "store": store,
        "store_write_s": time.perf_counter() - t,
        "loras": {n: {k: v for k, v in x.items() if k != "path"} for n, x in loras.items()},
    }
    if previous is not None:
        kept = [p for p in PARTS if p in previous and p not in parts]
        for p in kept:
            report[p] = previous[p]
        if kept:
            report["appended"] = {
                "parts": kept,
                "commit": previous.get("commit"),
                "date": previous.get("date"),
            }
            report["config"]["parts"] = [p for p in PARTS if p in kept or p in parts]
    bench = _Bench(store, size, dev, repeat, log)
    for part in parts:
        log(f"== {part}")
        t = time.perf_counter()
        try:
            report[part] = getattr(bench, part)()
        except Exception as e:  # reported, and the other part still runs
            report[part] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            log(f"  {part} failed: {type(e).__name__}: {e}")
        report[part]["part_s"] = time.perf_counter() - t
        report["targets"] = evaluate_targets(report)
        if save is not None:
            save(report)
        bench.free()
    report["targets"] = evaluate_targets(report)
    return report


def tables(report: dict) -> list:
    """What ``nostall bench adapters`` prints: the figures per rank, diffusers + PEFT
    beside nostall, then the targets."""
    from rich.table import Table

    from nostall.bench import targets

    cfg, peer, ours = report["config"], report.get("peer", {}), report.get("nostall", {})
    figures = Table(title=f"LoRAs on {cfg['model']}, same run", title_justify="left")
    for col in ("figure", "rank", "LoRA MB", "diffusers + PEFT", "nostall"):
        figures.add_column(col, justify="left" if col == "figure" else "right")

    def s(x: float | None) -> str:
        return "" if x is None else f"{x:.4f} s"

    def mb(r: str) -> str:
        x = report.get("loras", {}).get(f"r{r}-a")
        return f"{x['bytes'] / 1e6:.3g}" if x else ""

    ranks = sorted({*peer.get("ranks", {}), *ours.get("switch", {})}, key=int)
    for r in ranks:
        p, n = peer.get("ranks", {}).get(r, {}), ours.get("switch", {}).get(r, {})
        rows = [
            (
                "first load_lora_weights / first switch (file read)",
                p.get("first_load_s"),
                max(n["first_switch_s"]) if n else None,
            ),
            ("next adapter load_lora_weights", p.get("next_load_s"), None),
            ("hotswap (file) / LoRA → LoRA switch", p.get("hotswap_s"), n.get("switch_s")),
            ("hotswap (state dict in host memory)", p.get("hotswap_from_memory_s"), None),
            ("fuse_lora / base → LoRA switch", p.get("fuse_s"), n.get("from_base_s")),
            ("unfuse_lora / LoRA → base switch", p.get("unfuse_s"), n.get("to_base_s")),
        ]
        for what, a, b in rows:
            if a is not None or b is not None:
                figures.add_row(what, r, mb(r), s(a), s(b))
        if "unfused_forward_overhead" in p:
            figures.add_row(
                "forward, unfused adapter active vs base",
                r,
                mb(r),
                f"{p['unfused_forward_overhead']:+.1%}",
                "",
            )
    fwd = ours.get("forward", {})
    if "overhead" in fwd:
        r = str(cfg["switch_rank"])
        figures.add_row("forward, fused LoRA vs base", r, mb(r), "", f"{fwd['overhead']:+.1%}")
    comp = ours.get("compiled", {})
    if "frames_compiled" in comp:
        figures.add_row(
            f"frames compiled over {comp['switches']} switches ({comp['backend']})",
            "",
            "",
            "",
            str(comp["frames_compiled"]),
        )
    elif "error" in comp:
        figures.add_row("compiled switches", "", "", "", comp["error"][:60])
    if "bit_exact" in ours.get("base_restored", {}):
        exact = bool(ours["base_restored"]["bit_exact"])
        figures.add_row("base restored bit for bit", "", "", "", str(exact))
    errors = [f"{p} failed: {report[p]['error']}" for p in PARTS if "error" in report.get(p, {})]
    title = f"adapters bench ({cfg['size']}) on {report['hardware'].get('gpu', cfg['device'])}"
    controlnet = adapters_controlnet.table(report)
    return [
        *([figures] if figures.row_count else []),
        *([controlnet] if controlnet is not None else []),
        *errors,
        targets.table(report.get("targets", {}), title=title),
    ]
