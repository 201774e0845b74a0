"""The figures of the README's sections: each a block of markdown rendered from a run.

A few numbers per capability (switches, loads, video decode, decoder modes, FP8,
serving); each sits between ``<!-- bench:readme-… -->`` markers, in README.md or in the
page under ``docs/`` that a section moved to, and is rendered here from the same runs as
docs/BENCHMARKS.md (:mod:`benchdocs.blocks`), which holds every peer, the methods and the
targets. Each names its run (the link's text is the run's file: bench, commit, day).
"""

from __future__ import annotations

from collections.abc import Callable

from benchdocs.blocks import (
    DECODE,
    FP8,
    LOAD,
    LOAD_COLD,
    MODES,
    SERVE,
    SWITCH_A,
    SWITCH_B,
    peer_times,
)
from benchdocs.markdown import NA, Doc, day, secs, table
from benchdocs.runs import RUNS

__all__ = ["BLOCKS"]

_BENCHMARKS = "docs/BENCHMARKS.md"


def readme_switch(doc: Doc) -> str:
    a, b = doc.rec(SWITCH_A), doc.rec(SWITCH_B)
    peers = a["peers"]

    def best(rows: list[dict], p: str) -> str:
        xs = peer_times(rows, p)
        return f"{min(xs):.2f} s" if xs else NA

    def whole(p: str) -> str:
        s = a["nostall"][f"{p}_whole_from_host"]["switch"]
        rate = f" ({s['gbps']:.0f} GB/s)" if p == "flux" else ""
        return f"**{s['total_s']:.2f} s{rate}**"

    new = b["new-process"]["switch"]
    rows = [
        [f"FLUX.1-dev layout, {a['store']['flux']['bytes'] / 1e9:.1f} GB",
         best(peers["diffusers_from_pretrained_to"], "flux"), best(peers["cpu_resident_to"], "flux"),
         whole("flux"), f"**{new['total_s']:.2f} s**"],
        [f"SDXL, {a['store']['sdxl']['bytes'] / 1e9:.1f} GB",
         best(peers["diffusers_from_pretrained_to"], "sdxl"),
         best(peers["cpu_resident_to"], "sdxl") + " (FLUX out, SDXL in)", whole("sdxl"), ""],
    ]  # fmt: skip
    in_place = [
        x["switch"]["total_s"]
        for x in a["same-arch"]["runs"]
        if all(c["tier"] != "disk" for c in x["switch"]["components"])
    ]
    visible = a["prefetch"]["visible_switch"]["total_s"]
    head = ["switch to", "diffusers `from_pretrained` + `.to`", "CPU-resident `.to` moves",
            "nostall `ModelCache`, host-tier hit", "nostall, new process, page cache"]  # fmt: skip
    return (
        f"Whole-pipeline switches on an {a['hardware']['gpu']}, peers in the same run, page cache "
        f"warm ([docs/BENCHMARKS.md]({doc.href(_BENCHMARKS + '#whole-pipeline-switches--nostall-bench-switch')});"
        f" records {doc.link(SWITCH_A)}, new process {doc.link(SWITCH_B)}):\n\n"
        f"{table(head, rows)}\n\n"
        f"Two FLUX fine-tunes of one architecture switch in place in {min(in_place):.2f}–"
        f"{max(in_place):.2f} s with a compiled transformer (no recompilation); with the next "
        f"model prefetched, a switch is visible for {visible * 1e3:.1f} ms."
    )


def readme_load(doc: Doc) -> str:
    warm, cold = doc.rec(LOAD), doc.rec(LOAD_COLD)

    def rec(r: dict, method: str, scenario: str) -> dict:
        return next(x for x in r["records"] if x["method"] == method and x["scenario"] == scenario)

    def ours(r: dict, scenario: str) -> list[dict]:
        return [
            x for x in r["records"]
            if x["scenario"] == scenario and x["method"].startswith("nostall (") and x["seconds"]
        ]  # fmt: skip

    pc = min(ours(warm, "page-cache"), key=lambda x: x["seconds"])
    hits = ours(warm, "memory-cache")
    fast = min(ours(cold, "cold"), key=lambda x: x["seconds"])
    how = " (`O_DIRECT`)" if "O_DIRECT" in fast["method"] else ""
    st, dm = "safetensors load_file", "diffusers device_map"
    rows = [
        ["OS page cache warm", secs(rec(warm, st, "page-cache")["seconds"], 2),
         secs(rec(warm, dm, "page-cache")["seconds"], 2),
         f"**{pc['seconds']:.2f} s ({pc['gbps']:.0f} GB/s)**"],
        ["already in nostall's pinned pool", NA, NA,
         f"**{_span2([x['seconds'] for x in hits])} s ({_span2([x['gbps'] for x in hits], 0)} GB/s)**"],
        [f"cold (disk reads {cold['limits']['disk_buffered_gbps']:.1f} GB/s)",
         secs(rec(cold, st, "cold")["seconds"], 1), secs(rec(cold, dm, "cold")["seconds"], 1),
         f"**{fast['seconds']:.1f} s**{how}"],
    ]  # fmt: skip
    return (
        f"FLUX-size transformer ({warm['checkpoint']['bytes'] / 1e9:.2f} GB bf16, one file) onto an "
        f"{warm['hardware']['gpu']}, peers in the same run as each row ([docs/BENCHMARKS.md]"
        f"({doc.href(_BENCHMARKS)}); records {doc.link(LOAD)}, cold {doc.link(LOAD_COLD)}):\n\n"
        + table(["", "safetensors", "diffusers `device_map`", "nostall"], rows)
    )


def _span2(xs: list[float], places: int = 2) -> str:
    lo, hi = f"{min(xs):.{places}f}", f"{max(xs):.{places}f}"
    return lo if lo == hi else f"{lo}–{hi}"


def readme_decode(doc: Doc) -> str:
    r = doc.rec(DECODE)
    res = r["results"]
    alone = ", ".join(
        f"{x['decode-only']['mean']:.2f} s / {x['utilisation']['decode-only']['steady_two_chunks']:.1%} {d}"
        for d, x in res.items()
    )
    rows, flush = [], []
    for d, x in res.items():
        u, b = x["utilisation"], x["back_to_back"]
        flush += b["close_s"]
        rows.append(
            [d, f"{x['sync']['mean']:.2f} s, {u['sync']['steady_two_chunks']:.1%}",
             f"**{x['async']['mean']:.2f} s**, {u['async']['steady_two_chunks']:.1%}",
             f"**{b['submit_per_video_s']:.2f} s** (decode alone {b['decode_only_per_video_s']:.2f} s)"]
        )  # fmt: skip
    return (
        f"Wan 2.1 VAE, {r['config']['size'].split('x')[1]}p, {r['config']['frames']} frames, "
        f"writing MP4 on an {r['hardware']['gpu']} (seconds per video; kernel utilisation from "
        f"`torch.profiler`; decode alone, no output: {alone}; record {doc.link(DECODE)}):\n\n"
        + table(
            ["", "one thread", "async pipeline", "3 videos back to back (`submit_decode`)*"], rows
        )
        + f"\n\n\\* a separate run; the MP4 encoder's {sum(flush) / len(flush):.2f} s flush "
        "overlaps the next video's decode."
    )


_MODE_WHAT = {
    "eager": "`vae.decoder` as `vae.decode` calls it",
    "exact": "the VAE's own modules and weights, fewer passes over memory",
    "fast": "channels last, fused kernels, a CUDA graph per video (CUDA; else exact)",
}


def readme_modes(doc: Doc) -> str:
    r = doc.rec(MODES)
    modes = r["results"]["bf16"]["modes"]
    eager = modes["eager"]["decode_only"]["mean"]
    rows = []
    for mode, m in modes.items():
        t = m["decode_only"]["mean"]
        speed = "" if mode == "eager" else f" ({eager / t:.2f}×)"
        if mode == "eager":
            frames = "the reference"
        elif m.get("bit_identical"):
            frames = "bit-identical to `vae.decode`"
        else:
            frames = (
                f"PSNR vs fp32 {m['psnr_db_vs_fp32_eager']:.3f} dB "
                f"(eager: {modes['eager']['psnr_db_vs_fp32_eager']:.3f})"
            )
        rows.append([f'`"{mode}"`', _MODE_WHAT.get(mode, ""), f"{t:.2f} s{speed}", frames])
    return (
        f"Wan 2.1 VAE, {r['config']['frames']} frames at {r['config']['size'].split('x')[1]}p bf16 "
        f"on an {r['hardware']['gpu']}, eager (diffusers) {eager:.2f} s in the same run "
        f"([docs/BENCHMARKS.md]({doc.href(_BENCHMARKS + '#wan-decoder-modes-issue-9--nostall-bench-decode---part-modes')});"
        f" record {doc.link(MODES)}):\n\n" + table(["mode", "what it is", "decode", "frames"], rows)
    )


def _run(doc: Doc, name: str) -> str:
    """`` ([`abc1234` 2026-12-01](…))``: an inline figure's commit and day, linked to its run."""
    r = doc.rec(name)
    return f" ([`{r['commit']}` {day(r)}]({doc.href(f'{RUNS}/{name}')}))"


def readme_two_gpus(doc: Doc) -> str:
    speedup = doc.rec(MODES)["results"]["bf16"]["devices"]["speedup"]
    return f"{speedup:.2f}× one GPU{_run(doc, MODES)}"


def readme_serve(doc: Doc) -> str:
    res = doc.rec(SERVE)["results"]
    peer, batched = res["peer"], res["stream-batched"]
    n = batched["requests"]
    return (
        f"{batched['answered_200']}/{n} requests answered and none mixed up, at "
        f"{batched['throughput_per_s'] / peer['throughput_per_s']:.1f}x the throughput of a "
        f"plain diffusers worker in the same run ({batched['throughput_per_s']:.2f} against "
        f"{peer['throughput_per_s']:.2f} req/s, p99 {batched['latency_p99_s']:.1f} s against "
        f"{peer['latency_p99_s']:.1f} s){_run(doc, SERVE)}"
    )


def readme_fp8(doc: Doc) -> str:
    res = doc.rec(FP8)["results"]
    b, hit, fwd, comp = res["bytes"], res["loads"]["switch_hit_s"], res["forward"], res["compile"]
    return (
        f"{b['fp8'] / 1e9:.2f} instead of {b['bf16'] / 1e9:.2f} GB, a memory-hit switch of the "
        f"transformer in {hit['fp8']:.3f} s (bf16: {hit['bf16']:.3f} s), a 1024² forward in "
        f"{fwd['fp8_vs_bf16_eager']:.3f}x bf16's time eager (torchao's FP8: "
        f"{fwd['torchao']['eager_s'] / fwd['bf16_eager_s']:.2f}x) and "
        f"{comp['fp8_compiled_speedup']:.2f}x faster compiled, at torchao's accuracy "
        f"(SQNR {fwd['sqnr_gap_to_torchao_db']:.2f} dB from it){_run(doc, FP8)}"
    )


BLOCKS: dict[str, Callable[[Doc], str]] = {
    "readme-switch": readme_switch,
    "readme-load": readme_load,
    "readme-decode": readme_decode,
    "readme-modes": readme_modes,
    "readme-two-gpus": readme_two_gpus,
    "readme-fp8": readme_fp8,
    "readme-serve": readme_serve,
}
