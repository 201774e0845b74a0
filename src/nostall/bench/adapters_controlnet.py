"""The ``controlnet`` part of ``nostall bench adapters``: a ControlNet attached to the cached
FLUX from the pinned host tier, against diffusers loading it, and one image of each.

The ControlNet is random, written beside the store as ``<store>/controlnets/bench-cn/``
(:func:`write_controlnet`): at full size InstantX/FLUX.1-dev-Controlnet-Union's layout (5
double and 10 single blocks, 10 control modes: 3.30 B parameters, 6.60 GB in bf16); tiny,
one block of each over the tiny FLUX. It is built on ``meta`` from the base transformer's
config and its tensors drawn and written one by one (``save_pretrained`` of a real-size
random model on a CPU takes minutes), as the synthetic stores are.

:class:`ControlNetPart` measures, in one process:

* ``peer``: diffusers, its base pipeline already on the device:
  ``FluxControlNetModel.from_pretrained(folder).to(device)`` and the ControlNet pipeline
  built from the base's components (median of ``repeat``), then one image.
* ``nostall``: a :class:`nostall.ModelCache` over the store. The first
  ``use("flux", controlnet=...)`` reads the ControlNet from disk into the host tier; then,
  ``repeat`` times, everything is evicted from the device, the base switched back in, and
  the attach timed: only the ControlNet moves, from the host tier. ``attach_gbps`` is its
  bytes over that time (median): the issue's ``controlnet_attach_gbps``.
* ``image``: the two pipelines' images (same prompt, control image, seed) compared, and
  nostall's against the base's without a ControlNet (the control shows).
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from nostall.bench.timing import sync, timed

__all__ = ["CONTROLNET", "LAYOUTS", "ControlNetPart", "table", "write_controlnet"]

CONTROLNET = "bench-cn"  # its name under <store>/controlnets
LAYOUTS: dict[str, dict[str, int]] = {
    # InstantX/FLUX.1-dev-Controlnet-Union (Shakker-Labs' Union-Pro has the same)
    "full": {"num_layers": 5, "num_single_layers": 10, "num_mode": 10},
    "tiny": {"num_layers": 1, "num_single_layers": 1, "num_mode": 10},
}
IMAGES = {"full": {"res": 512, "steps": 4}, "tiny": {"res": 32, "steps": 2}}
# An image (floats in [0, 1]) counts as equal to diffusers' within this: float32 on a CPU
# is bit-stable in practice; bf16 kernels may pick another reduction order for another
# memory layout, a last-bit change that a few steps can carry to ~1e-3.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
PROMPT = "a lighthouse on a cliff at dusk"
_WEIGHTS = "diffusion_pytorch_model"
_STAMP = "nostall-bench.json"


def write_controlnet(
    pipeline: str,
    folder: str,
    *,
    layout: dict[str, int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """A random ``FluxControlNetModel`` for the FLUX pipeline folder ``pipeline``, written to
    ``folder`` as ``save_pretrained`` lays it out (``config.json`` and
    ``diffusion_pytorch_model.safetensors``); a folder already written for the same
    config and dtype is kept. ``layout``: ``num_layers``, ``num_single_layers``,
    ``num_mode``; everything else is the base transformer's (the cache refuses a
    ControlNet whose widths differ). Returns ``{"class", "config", "nbytes"`` (its
    tensors), ``"file_bytes", "write_s", "kept"}``.

    Tensors are N(0, 0.02) in ``dtype``, drawn on ``device`` (a GPU draws 6.6 GB in a
    second); the zero-initialised output projections of a fresh ControlNet are random too,
    so the control image shows in the image.

    >>> write_controlnet("store/flux", "store/controlnets/cn", layout=LAYOUTS["tiny"],
    ...                  dtype=torch.float32)  # doctest: +SKIP
    """
    import diffusers

    from nostall.cache.report import human_bytes
    from nostall.synthetic import safetensors_bytes
    from nostall.synthetic.full import write_weights

    cls = diffusers.FluxControlNetModel
    base = cls.load_config(os.path.join(pipeline, "transformer"))
    fields = set(inspect.signature(cls.__init__).parameters) - {"self"}
    config = {k: v for k, v in base.items() if k in fields} | dict(layout)
    stamp = {"config": config, "dtype": str(dtype)}
    t = time.perf_counter()
    with torch.device("meta"):
        model = cls(**config)
    nbytes = sum(x.numel() for x in model.state_dict().values()) * dtype.itemsize
    out: dict[str, Any] = {"class": cls.__name__, "config": config, "nbytes": nbytes}
    stamp_path = os.path.join(folder, _STAMP)
    if os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            kept = json.load(f) == stamp
        if kept:
            return {**out, "file_bytes": safetensors_bytes(folder), "write_s": 0.0, "kept": True}
        os.remove(stamp_path)  # another layout: no stamp until the new one is whole
    os.makedirs(folder, exist_ok=True)
    write_weights(model, folder, _WEIGHTS, dtype, torch.device(device), 2026, log, "controlnet")
    model.save_config(folder)
    with open(stamp_path, "w") as f:  # last: the folder is whole
        json.dump(stamp, f)
    out.update(file_bytes=safetensors_bytes(folder), write_s=time.perf_counter() - t, kept=False)
    log(f"  wrote ControlNet {os.path.basename(folder)}: {human_bytes(nbytes)}")
    return out


class ControlNetPart:
    """One run of the part over ``store`` (its ``flux`` pipeline), on ``dev``."""

    def __init__(
        self,
        store: str,
        size: str,
        dev: torch.device,
        dtype: torch.dtype,
        repeat: int,
        log: Callable[[str], None],
    ):
        self.store, self.size, self.dev, self.dtype = store, size, dev, dtype
        self.repeat, self.log = repeat, log
        self.flux = os.path.join(store, "flux")
        self.folder = os.path.join(store, "controlnets", CONTROLNET)
        self.image_cfg = IMAGES[size]

    def run(self) -> dict:
        model = write_controlnet(
            self.flux,
            self.folder,
            layout=LAYOUTS[self.size],
            dtype=self.dtype,
            device=self.dev,
            log=self.log,
        )
        nbytes = model["nbytes"]
        out: dict[str, Any] = {"model": model, "image_config": dict(self.image_cfg)}
        try:
            out["peer"], theirs = self.peer(nbytes)
        except Exception as e:  # reported; nostall's attach (the target) is still measured
            out["peer"], theirs = {"error": f"{type(e).__name__}: {e}"[:2000]}, None
            self.log(f"  diffusers failed: {out['peer']['error']}")
        self.free()
        out["nostall"], ours, base = self.nostall(nbytes)
        out["attach_gbps"] = out["nostall"]["attach_gbps"]
        out["image"] = self.compare(ours, theirs, base)
        return out

    def free(self) -> None:
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def control(self) -> Any:
        """The control image: seeded noise, ``res``² RGB."""
        import numpy as np
        from PIL import Image

        res = self.image_cfg["res"]
        rng = np.random.default_rng(0)
        return Image.fromarray(rng.integers(0, 256, (res, res, 3), dtype=np.uint8))

    def image(self, pipe: Any, control: bool) -> Any:
        """One image, ``float`` (H, W, 3) in [0, 1], from a CPU generator (the same
        numbers on every device)."""
        pipe.set_progress_bar_config(disable=True)
        res = self.image_cfg["res"]
        kw: dict[str, Any] = {}
        if control:
            kw = {"control_image": self.control(), "controlnet_conditioning_scale": 0.8}
            if LAYOUTS[self.size].get("num_mode"):
                kw["control_mode"] = 0  # a Union ControlNet takes the mode as a token
        g = torch.Generator().manual_seed(1)
        return pipe(
            prompt=PROMPT,
            height=res,
            width=res,
            generator=g,
            output_type="np",
            num_inference_steps=self.image_cfg["steps"],
            **kw,
        ).images[0]

    # ---- diffusers -------------------------------------------------------------------

    def peer(self, nbytes: int) -> tuple[dict, Any]:
        """diffusers: the ControlNet loaded and its pipeline built over the base, already
        on the device (median of ``repeat``); then its image."""
        import diffusers

        from nostall.store.catalog import CONTROLNET_PIPELINES

        dev, dtype = self.dev, self.dtype
        base = diffusers.DiffusionPipeline.from_pretrained(self.flux, dtype=dtype).to(dev)
        cn_cls = diffusers.FluxControlNetModel
        pipe_cls = getattr(diffusers, CONTROLNET_PIPELINES[type(base).__name__])
        runs, loads, builds = [], [], []
        pipe = None
        for _ in range(self.repeat):
            pipe = cn = None  # the last run's ControlNet leaves the device first
            self.free()
            sync(dev)
            t = time.perf_counter()
            load_s, cn = timed(
                dev, lambda: cn_cls.from_pretrained(self.folder, dtype=dtype).to(dev)
            )
            build_s, pipe = timed(dev, lambda cn=cn: pipe_cls(**base.components, controlnet=cn))
            runs.append(time.perf_counter() - t)
            loads.append(load_s)
            builds.append(build_s)
        attach = statistics.median(runs)
        out = {
            "how": f"{cn_cls.__name__}.from_pretrained(folder).to(device) + "
            f"{pipe_cls.__name__}(**base.components, controlnet=cn)",
            "attach_runs_s": runs,
            "attach_s": attach,
            "from_pretrained_to_s": statistics.median(loads),
            "pipeline_s": statistics.median(builds),
            "attach_gbps": nbytes / attach / 1e9,
        }
        self.log(
            f"  diffusers: ControlNet from_pretrained + .to + pipeline {attach:.3f} s "
            f"({out['attach_gbps']:.2f} GB/s)"
        )
        return out, self.image(pipe, True)  # the pipelines go with this frame

    # ---- nostall ---------------------------------------------------------------------

    def cache(self, extra: int):
        import nostall
        from nostall.cache import Store

        nbytes = Store(self.store, cache_dir=False).entry("flux").nbytes + extra
        return nostall.ModelCache(
            self.store,
            device=self.dev,
            gpu_budget=int(nbytes * 1.15) + (1 << 30),
            host_budget=int(nbytes * 1.1) + (1 << 30),
            lora_budget=0,  # (no LoRA here: the host budget is the components')
            cache_dir=os.path.join(self.store, ".digests"),
        )

    def attach(self, cache, controlnet: str | None) -> tuple[float, dict, float]:
        """Seconds to enter ``cache.use("flux", controlnet=...)`` (synchronised), the
        switch's rows by role (``tier``, ``nbytes``, …) and its report's ``total_s``."""
        sync(self.dev)
        t = time.perf_counter()
        with cache.use("flux", controlnet=controlnet):
            sync(self.dev)
            seconds = time.perf_counter() - t
            report = cache.last_report
        rows = {
            c.role: {
                "tier": c.tier,
                "nbytes": c.nbytes,
                "copy_s": c.copy_s,
                "read_s": c.read_s,
                "cached": c.cached,
                "in_place": c.in_place,
            }
            for c in report.components
        }
        return seconds, rows, report.total_s

    def nostall(self, nbytes: int) -> tuple[dict, Any, Any]:
        out: dict[str, Any] = {}
        with self.cache(nbytes) as cache:
            out["base_first_use_s"], _, _ = self.attach(cache, None)  # the base, from disk
            with cache.use("flux") as pipe:
                base = self.image(pipe, False)
            first_s, rows, _ = self.attach(cache, CONTROLNET)  # read from disk
            out["first_attach_s"], out["first_attach"] = first_s, rows
            with cache.use("flux", controlnet=CONTROLNET) as pipe:
                out["pipeline_class"] = type(pipe).__mro__[1].__name__  # diffusers' own
                image = self.image(pipe, True)
            runs, totals, copies, moved = [], [], [], set()
            for _ in range(self.repeat):
                cache.evict("gpu")  # everything leaves the device tier; the host keeps it
                self.attach(cache, None)  # the base back, from the host tier
                seconds, rows, total = self.attach(cache, CONTROLNET)
                runs.append(seconds)
                totals.append(total)
                copies.append(rows["controlnet"]["copy_s"])
                moved |= {r for r, row in rows.items() if row["tier"] not in ("gpu", "device")}
        attach = statistics.median(runs)
        out.update(
            attach_runs_s=runs,
            attach_s=attach,
            attach_tiers={r: row["tier"] for r, row in rows.items()},
            moved_roles=sorted(moved),  # over every measured attach
            controlnet_bytes=nbytes,  # its tensors' bytes, as the peer's figure counts them
            cache_bytes=rows["controlnet"]["nbytes"],  # as the device tier lays them out
            report_total_s=statistics.median(totals),
            copy_s=statistics.median(copies),
        )
        out["attach_gbps"] = nbytes / attach / 1e9
        self.log(
            f"  nostall: attach from the host tier {attach:.4f} s "
            f"({out['attach_gbps']:.2f} GB/s; moved: {', '.join(out['moved_roles'])}), "
            f"first from disk {first_s:.3f} s"
        )
        return out, image, base

    def compare(self, ours: Any, theirs: Any | None, base: Any) -> dict:
        """nostall's image against diffusers' (``None``: the peer failed; ``equal`` is
        then ``None``) and against the base's without a ControlNet."""
        import numpy as np

        tol = TOLERANCE.get(self.dtype, 1e-2)
        diff = None if theirs is None else float(np.abs(ours - theirs).max())
        out = {
            "max_abs_diff": diff,
            "bit_equal": None if theirs is None else bool(np.array_equal(ours, theirs)),
            "tolerance": tol,
            "equal": None if diff is None else diff <= tol,
            "vs_base_max_abs_diff": float(np.abs(ours - base).max()),  # the control shows
            "shape": list(ours.shape),
        }
        self.log(
            f"  image {self.image_cfg['res']}², {self.image_cfg['steps']} steps: nostall vs "
            f"diffusers max |Δ| {_verdict(out)}; vs the base without ControlNet "
            f"{out['vs_base_max_abs_diff']:.3f}"
        )
        return out


def _verdict(image: dict) -> str:
    if image["max_abs_diff"] is None:
        return "not compared (diffusers failed)"
    return f"{image['max_abs_diff']:.2e} ({'equal' if image['equal'] else 'DIFFERENT'})"


def table(report: dict) -> Any:
    """The part's figures, diffusers beside nostall (``None`` when it did not run)."""
    from rich.table import Table

    from nostall.cache.report import human_bytes

    cn = report.get("controlnet", {})
    if "nostall" not in cn:
        return None
    peer, ours, model, img = cn.get("peer", {}), cn["nostall"], cn["model"], cn.get("image", {})
    layout = model["config"]
    title = (
        f"ControlNet attach: {model['class']} ({layout['num_layers']} double + "
        f"{layout['num_single_layers']} single blocks, {human_bytes(model['nbytes'])}), same run"
    )
    out = Table(title=title, title_justify="left")
    for col in ("figure", "diffusers", "nostall"):
        out.add_column(col, justify="left" if col == "figure" else "right")

    def s(x: float | None, gbps: float | None = None) -> str:
        if x is None:
            return ""
        return f"{x:.4f} s" + ("" if gbps is None else f" ({gbps:.3g} GB/s)")

    out.add_row(
        "attach (diffusers: from_pretrained + .to + pipeline; nostall: host tier → device)",
        s(peer.get("attach_s"), peer.get("attach_gbps")),
        s(ours["attach_s"], ours["attach_gbps"]),
    )
    out.add_row(
        "  of which from_pretrained + .to / the copy",
        s(peer.get("from_pretrained_to_s")),
        s(ours["copy_s"]),
    )
    out.add_row("first attach (ControlNet read from disk)", "", s(ours["first_attach_s"]))
    out.add_row(
        "moved on the measured attach",
        "",
        ", ".join(f"{r} ({ours['attach_tiers'][r]})" for r in ours["moved_roles"]),
    )
    if img:
        res = cn["image_config"]
        what = f"image {res['res']}², {res['steps']} steps: nostall vs diffusers max |Δ|"
        out.add_row(what, "", _verdict(img))
    if "error" in peer:
        out.add_row("diffusers failed", peer["error"][:60], "")
    return out
