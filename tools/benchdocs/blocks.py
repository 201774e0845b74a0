"""The generated tables of docs/BENCHMARKS.md: what each shows, and from which run.

Each block is a function of the runs and the index (:class:`~benchdocs.markdown.Doc`)
that returns markdown; :mod:`benchdocs.render` puts it between the document's
``<!-- bench:NAME -->`` and ``<!-- /bench -->`` markers. Every number in a block comes
from a run under ``docs/bench/runs/``: a table of one run's figures names that run (the
text around it discusses it); a ``*-targets`` table shows each target as it stands in
the index, the latest measured value and its run, beside the runs the text discusses.
The words around the numbers are fixed here. The README's blocks are
:mod:`benchdocs.readme`, its headline table :mod:`benchdocs.headlines`.
"""

from __future__ import annotations

from collections.abc import Callable

from benchdocs.markdown import NA, Doc, day, num, provenance, secs, table, targets_table, when

__all__ = [
    "ADAPTERS",
    "BLOCKS",
    "DECODE",
    "FP8",
    "LOAD",
    "LOAD_COLD",
    "MODES",
    "REMOTE",
    "SERVE",
    "SERVE_B1",
    "SWITCH",
    "SWITCH_A",
    "SWITCH_B",
    "peer_times",
    "span",
]

# The runs the text of docs/BENCHMARKS.md discusses (docs/bench/runs/).
LOAD = "load-e58935b-2026-11-29.json"  # warm scenarios
LOAD_COLD = "load-842f99e-2026-11-29.json"
DECODE = "decode-e3e40ff-2026-11-29.json"  # merged from four device calls
MODES = "decode-0871722-2026-11-30.json"  # the decoder modes (issue #9)
SWITCH_A = "switch-e4f0342-2026-11-30.json"
SWITCH_B = "switch-f40f06d-2026-11-30.json"  # --size full-lean
SWITCH = "switch-caff6a3-2026-12-01.json"  # identity + FP8 issue, partial
FP8 = "fp8-31e9f1f-2026-12-01-2.json"  # merged from its day's two runs
SERVE_CHECK = "serve-check-c6a5e0b-2026-12-02.json"
SERVE = "serve-21a8645-2026-12-01.json"
REMOTE = "remote-2a40321-2026-12-02.json"
SERVE_B1 = "serve-7d22636-2026-12-01.json"  # the unbatched stream (its batched part failed)
SERVE_FIRST = "serve-c92afe5-2026-12-01.json"

_LOAD_LABELS = {
    "safetensors load_file": 'safetensors `load_file(device="cuda")`',
    "diffusers from_pretrained + .to": 'diffusers `from_pretrained` + `.to("cuda")`',
    "diffusers device_map": 'diffusers `from_pretrained(device_map="cuda")`',
    "runai-model-streamer + .to": "runai-model-streamer + `.to`",
    "nostall (staging ring)": "nostall, staging ring (no pool)",
    "nostall (pool, read)": "nostall, into the pool",
    "nostall (O_DIRECT, ring)": 'nostall, `read_mode="direct"`',
    "nostall (pool, memory-cache hit)": "nostall, pool hit (fresh device allocation)",
    "nostall (pool hit, device memory reused)": "nostall, pool hit, device memory reused",
    "nostall load_model (pool hit)": "nostall `load_model`, pool hit (FLUX module built + adopted)",
}
_SCENARIO_HEADS = {
    "page-cache": "page-cache hit",
    "memory-cache": "memory-cache hit",
    "cold": "cold",
}


def _load_cell(r: dict) -> str:
    if r["seconds"] is None:
        return r["note"][:60] or NA
    build = r.get("phases", {}).get("build_s")
    extra = f" (build + adopt {build:.3f} s)" if build else ""
    bad = "" if r["equal"] else " (NOT EQUAL to safetensors)"
    return f"{r['seconds']:.3f} s, {r['gbps']:.2f} GB/s{extra}{bad}"


def _load_table(doc: Doc, name: str, scenarios: tuple[str, ...]) -> str:
    recs = [r for r in doc.rec(name)["records"] if r["scenario"] in scenarios]
    methods = list(dict.fromkeys(r["method"] for r in recs))
    best = {
        s: min((r["seconds"] for r in recs if r["scenario"] == s and r["seconds"]), default=None)
        for s in scenarios
    }
    rows = []
    for m in methods:
        row = [_LOAD_LABELS.get(m, m)]
        for s in scenarios:
            r = next((x for x in recs if x["method"] == m and x["scenario"] == s), None)
            cell = NA if r is None else _load_cell(r)
            row.append(f"**{cell}**" if r and r["seconds"] == best[s] else cell)
        rows.append(row)
    return table(["method", *(_SCENARIO_HEADS[s] for s in scenarios)], rows)


def load_warm(doc: Doc) -> str:
    lim = doc.rec(LOAD)["limits"]
    hp = (lim.get("pool_hugepage_bytes") or 0) / max(lim.get("pool_bytes") or 1, 1)
    return (
        f"{provenance(doc, LOAD)} Same run: link (4 GiB pinned H2D, cudaHostAlloc) "
        f"**{lim['link_h2d_gbps']:.1f} GB/s**; H2D from a nostall pool block "
        f"{lim['pool_h2d_gbps']:.1f} GB/s; pool of {lim['pool_bytes'] / 1e9:.1f} GB pinned in "
        f"the background in {lim['pool_pin_seconds']:.2f} s, {hp:.0%} huge pages. "
        "**Bold**: the fastest in its column.\n\n"
        + _load_table(doc, LOAD, ("page-cache", "memory-cache"))
    )


def load_cold(doc: Doc) -> str:
    r = doc.rec(LOAD_COLD)
    lim, size = r["limits"], r["checkpoint"]["bytes"]
    return (
        f"{provenance(doc, LOAD_COLD)} Same run: disk, `dd bs=16M` after dropping the cache: "
        f"buffered **{lim['disk_buffered_gbps']:.2f} GB/s** ({size / lim['disk_buffered_gbps'] / 1e9:.2f} s), "
        f"`O_DIRECT` {lim['disk_direct_gbps']:.2f} GB/s; link {lim['link_h2d_gbps']:.1f} GB/s.\n\n"
        + _load_table(doc, LOAD_COLD, ("cold",))
    )


def load_targets(doc: Doc) -> str:
    heads = [
        f"{what} run `{doc.rec(n)['commit']}` {day(doc.rec(n))}"
        for what, n in (("warm", LOAD), ("cold", LOAD_COLD))
    ]
    return targets_table(doc, "load", [LOAD, LOAD_COLD], heads)


_DECODE_MODES = {
    "decode-only": "decode-only (no output)",
    "sync": "sync (decode, blocking copy, write)",
    "async": "**async pipeline**",
}


def decode(doc: Doc) -> str:
    r = doc.rec(DECODE)
    runs = "; ".join(
        f"{when(x)} `{x['commit']}` ({', '.join(x['dtypes'])}: {', '.join(x['parts'])})"
        for x in r["runs"]
    )
    rows = []
    for dtype, res in r["results"].items():
        for mode, label in _DECODE_MODES.items():
            s, u = res[mode], res["utilisation"][mode]
            close = secs(s.get("close_mean_s")) if "close_mean_s" in s else NA
            rows.append(
                [dtype, label, f"{s['min']:.3f}", f"{s['mean']:.3f}", f"{s['p99']:.3f}",
                 f"{s['frames_per_s']:.1f}", f"{s['rtf']:.3f}", close,
                 f"{u['steady_two_chunks']:.2%} / {u['whole_decode']:.2%}"]
            )  # fmt: skip
    head = ["dtype", "mode", "min s", "mean s", "p99 s", "frames/s", "RTF", "close",
            "kernel util. steady / whole"]  # fmt: skip
    return f"{provenance(doc, DECODE)} Runs merged: {runs}.\n\n{table(head, rows)}"


def decode_b2b(doc: Doc) -> str:
    rows = []
    for dtype, res in doc.rec(DECODE)["results"].items():
        b = res["back_to_back"]
        rows.append(
            [dtype, f"{b['decode_only_per_video_s']:.3f}",
             f"{b['one_at_a_time_per_video_s']:.3f} ({b['one_at_a_time_vs_decode_only']:.3f}×)",
             f"**{b['submit_per_video_s']:.3f} ({b['submit_vs_decode_only']:.3f}×)**"]
        )  # fmt: skip
    head = ["dtype", "decode-only", "`decode_to_file` one at a time",
            "`submit_decode` (flush overlaps next decode)"]  # fmt: skip
    r = doc.rec(DECODE)
    part = next((x for x in r.get("runs", []) if "back-to-back" in x["parts"]), r)
    caption = f"Back to back: {when(part)}, commit `{part['commit']}`, in {doc.link(DECODE)}."
    return f"{caption}\n\n{table(head, rows)}"


def decode_targets(doc: Doc) -> str:
    return targets_table(doc, "decode", [DECODE], columns=False)


def _frames_vs_eager(m: dict) -> str:
    if "bit_identical" not in m:
        return NA
    return "bit-identical" if m["bit_identical"] else f"{m['mismatches'] / 1e6:.0f} M values differ"


def _psnr(dtype: str, m: dict) -> str:
    if "psnr_db_vs_fp32_eager" not in m:
        return "(reference)" if dtype == "fp32" else NA
    v = m["psnr_db_vs_fp32_eager"]
    return "= reference" if v is None else f"{v:.3f} dB"


def decode_modes(doc: Doc) -> str:
    r = doc.rec(MODES)
    rows = []
    for dtype, res in r["results"].items():
        modes = res["modes"]
        eager = modes["eager"]["decode_only"]["mean"]
        for mode, m in modes.items():
            busy = m.get("utilisation_async_mp4", {}).get("steady_two_chunks")
            rows.append(
                [dtype, mode, secs(m["first_call_s"]), secs(m["decode_only"]["mean"]),
                 f"{eager / m['decode_only']['mean']:.3f}×", secs(m["async_mp4"]["mean"]),
                 f"{m['async_vs_decode_only']:.4f}×", secs(m["async_close_mean_s"]),
                 f"{m['peak_gib']:.3f}", _frames_vs_eager(m), _psnr(dtype, m),
                 NA if busy is None else f"{busy:.2%}"]
            )  # fmt: skip
        two = res.get("devices")
        if two:
            d, a = two["decode_only"]["mean"], two["async_mp4"]["mean"]
            rows.append(
                [dtype, f"exact, {len(two['devices'])} GPUs", secs(two["first_call_s"]), secs(d),
                 f"{two['speedup']:.3f}× vs exact", secs(a), f"{a / d:.4f}×", NA, NA,
                 _frames_vs_eager(two), NA, NA]
            )  # fmt: skip
    head = ["dtype", "mode", "first call", "decode-only (mean)", "speed-up", "async MP4",
            "MP4 / decode-only", "encoder flush", "peak GiB", "frames vs eager", "PSNR vs fp32",
            "steady kernel-busy"]  # fmt: skip
    return f"{provenance(doc, MODES)}\n\n{table(head, rows)}"


def decode_modes_targets(doc: Doc) -> str:
    return targets_table(doc, "decode", [MODES], columns=False)


def peer_times(rows: list[dict], pipeline: str) -> list[float]:
    return [x["switch_s"] for x in rows if x["pipeline"] == pipeline]


def _switch_steps(r: dict, pipeline: str) -> list[dict]:
    return [
        s["switch"]
        for p in r.get("nostall", {}).get("passes", [])
        for s in p["steps"]
        if s["pipeline"] == pipeline
    ]


def span(xs: list[float]) -> str:
    if not xs:
        return NA
    lo, hi = min(xs), max(xs)
    return f"{lo:.3f} s" if f"{lo:.3f}" == f"{hi:.3f}" else f"{lo:.3f}–{hi:.3f} s"


def _whole(r: dict, key: str) -> str:
    s = r.get("nostall", {}).get(key, {}).get("switch")
    return NA if not s else f"**{s['total_s']:.3f} s ({s['gbps']:.1f} GB/s)**"


def _peer_cell(part: str) -> Callable[[dict, str], str]:
    def cell(r: dict, p: str) -> str:
        xs = peer_times(r.get("peers", {}).get(part, []), p)
        return " / ".join(f"{x:.3f}" for x in xs) + " s" if xs else NA

    return cell


def _offload(r: dict, p: str) -> str:
    g = r.get("peers", {}).get("diffusers_group_offload_streams", {})
    if g.get("pipeline") != p:
        return NA
    return f"setup {g['setup_s']:.2f} s, {r['config']['steps']} steps {g['denoise_s']:.3f} s"


def _load_model(r: dict, p: str) -> str:
    xs = peer_times(r.get("peers", {}).get("nostall_load_model", []), p)
    if not xs:
        return NA
    return (
        f"first {xs[0]:.3f} s (page cache), then " + " / ".join(f"{x:.3f}" for x in xs[1:]) + " s"
    )


def _in_sequence(r: dict, p: str) -> str:
    # Host-tier switches only: the first pass's first switch to each reads the page cache,
    # and a pipeline still on the device moves nothing.
    return span(
        [
            s["total_s"]
            for s in _switch_steps(r, p)
            if s["moved_bytes"] and all(c["tier"] != "disk" for c in s["components"])
        ]
    )


def _first(r: dict, p: str) -> str:
    steps = _switch_steps(r, p)
    return secs(steps[0]["total_s"]) if steps else NA


def _new_process(r: dict, p: str) -> str:
    s = r.get("new-process", {}).get("switch")
    return f"**{s['total_s']:.3f} s**" if s and s["pipeline"] == p else NA


def _cold(r: dict, p: str) -> str:
    c = r.get("cold", {})
    s = c.get("switch")
    if not s or s["pipeline"] != p:
        return NA
    return (
        f"{s['total_s']:.3f} s = {c['gbps']:.2f} GB/s; the disk reads {c['disk']['gbps']:.2f} GB/s"
    )


def _shared(r: dict, p: str) -> str:
    s = r.get("nostall", {}).get("shared_flux_b_after_flux", {}).get("switch")
    return secs(s["total_s"]) if s and p == "flux" else NA


_SWITCH_ROWS: list[tuple[str, Callable[[dict, str], str]]] = [
    ('diffusers `from_pretrained` + `.to("cuda")` per switch (page cache)',
     _peer_cell("diffusers_from_pretrained_to")),
    ('both pipelines resident in CPU RAM, `.to("cuda")` in, `.to("cpu")` out',
     _peer_cell("cpu_resident_to")),
    ("diffusers group offloading, `leaf_level`, `use_stream=True`", _offload),
    ("nostall `load_model` per component + one `PinnedPool`", _load_model),
    ("**nostall `ModelCache`, whole pipeline from the host tier**",
     lambda r, p: _whole(r, f"{p}_whole_from_host")),
    ("nostall `ModelCache`, in the flux → sdxl → flux sequence (host tier)", _in_sequence),
    ("nostall `ModelCache`, first switch from the page cache (in the bench process)", _first),
    ("**nostall `ModelCache`, new process, page cache**", _new_process),
    ("nostall `ModelCache`, cold (page cache dropped), new process", _cold),
    ("nostall `ModelCache`, FLUX-b after FLUX", _shared),
]  # fmt: skip


def switch_runs(doc: Doc) -> str:
    lines = []
    for label, name in (("Run A", SWITCH_A), ("Run B", SWITCH_B)):
        cfg = doc.rec(name)["config"]
        lines.append(
            f"- **{label}**: `--size {cfg['size']}`, parts {', '.join(cfg['parts'])}; device tier "
            f"{cfg['gpu_budget'] / 1e9:.0f} GB, host tier {cfg['host_budget'] / 1e9:.0f} GB. "
            + provenance(doc, name)
        )
    return "\n".join(lines)


def switch(doc: Doc) -> str:
    cols = [(SWITCH_A, "flux", "FLUX, run A"), (SWITCH_A, "sdxl", "SDXL, run A"),
            (SWITCH_B, "flux", "FLUX, run B"), (SWITCH_B, "sdxl", "SDXL, run B")]  # fmt: skip
    rows = [[label, *(fn(doc.rec(n), p) for n, p, _ in cols)] for label, fn in _SWITCH_ROWS]
    rows = [r for r in rows if any(c != NA for c in r[1:])]
    heads = [f"{h} (`{doc.rec(n)['commit']}` {day(doc.rec(n))})" for n, _, h in cols]
    return table(["method (same run)", *heads], rows)


def switch_targets(doc: Doc) -> str:
    heads = [
        f"run {x} `{doc.rec(n)['commit']}` {day(doc.rec(n))}"
        for x, n in (("A", SWITCH_A), ("B", SWITCH_B))
    ]
    return targets_table(doc, "switch", [SWITCH_A, SWITCH_B], heads)


def switch_identity(doc: Doc) -> str:
    r = doc.rec(SWITCH)
    ident, rows = r.get("identity", {}), []
    for kind, label in (("cold", "cold (page cache dropped)"), ("page_cache", "page cache")):
        runs = ident.get(kind, [])
        hashing = ", ".join(f"{x['total_s']:.3f}" for x in runs if x["hashing"])
        known = ", ".join(f"{x['total_s']:.3f}" for x in runs if not x["hashing"])
        if runs:
            rows.append([f"new process, {label}: hashing every byte / digests known",
                         f"{hashing} s / {known} s"])  # fmt: skip
    s = r.get("new-process", {}).get("switch")
    if s:
        rows.append(["new process, page cache, digest index filled (nothing hashed)",
                     f"{s['total_s']:.3f} s ({s['gbps']:.1f} GB/s)"])  # fmt: skip
    for part in ("memory-hit", "diffusers"):
        if "error" in r.get(part, {}):
            rows.append([f"part `{part}`", f"failed: {r[part]['error'][:90]}…"])
        elif part not in r:
            rows.append([f"part `{part}`", "not in the record"])
    return f"{provenance(doc, SWITCH)}\n\n" + table(["figure", f"`{r['commit']}`"], rows)


def switch_identity_targets(doc: Doc) -> str:
    return targets_table(doc, "switch", [SWITCH])


def fp8(doc: Doc) -> str:
    r = doc.rec(FP8)
    res = r["results"]
    b, loads, fwd, comp, e2e = (res[k] for k in ("bytes", "loads", "forward", "compile", "e2e"))
    ao = fwd["torchao"]
    rows = [["transformer weights", f"{b['bf16'] / 1e9:.2f} GB", f"{b['fp8'] / 1e9:.2f} GB",
             f"{b['ratio']:.3f}", ""]]  # fmt: skip
    for key, label in (
        ("page_cache_load_s", "page-cache load, `load_model`"),
        ("memory_hit_s", "memory hit, `load_model` from a pool"),
        ("switch_hit_s", "memory-hit switch (into resident memory)"),
    ):
        x = loads[key]
        rows.append([label, secs(x["bf16"]), secs(x["fp8"]), f"{x['ratio']:.3f}", ""])
    rows += [
        ["forward, eager", f"{fwd['bf16_eager_s'] * 1e3:.1f} ms", f"{fwd['fp8_eager_s'] * 1e3:.1f} ms",
         f"{fwd['fp8_vs_bf16_eager']:.3f}",
         f"{ao['eager_s'] * 1e3:.1f} ms ({ao['eager_s'] / fwd['bf16_eager_s']:.2f}x bf16)"],
        ["output SQNR vs bf16", "", f"{fwd['sqnr_db']:.2f} dB", "",
         f"{ao['sqnr_db']:.2f} dB (gap {fwd['sqnr_gap_to_torchao_db']:.3f} dB)"],
        ["forward, `compile_repeated_blocks` (fresh process each)",
         f"{comp['bf16_compiled_s'] * 1e3:.1f} ms (compile {comp['bf16_compile_s']:.1f} s)",
         f"{comp['fp8_compiled_s'] * 1e3:.1f} ms (compile {comp['fp8_compile_s']:.1f} s)",
         f"{comp['fp8_compiled_s'] / comp['bf16_compiled_s']:.3f} ({comp['fp8_compiled_speedup']:.3f}x)", ""],
        ["model cache's FP8 transformer vs `load_model`'s, same inputs", "",
         "bit-equal" if res["cache"]["equal"] else "differs",
         f"max diff {res['cache']['max_abs_diff']}", ""],
        [f"end to end through the model cache, {e2e['steps']} steps at {e2e['resolution']}² "
         f"(host-tier switch + encode + denoise + VAE), best of {len(e2e['bf16']['runs'])}",
         *(f"{e2e[k]['total_s']:.3f} s (switches {span([x['switch_s'] for x in e2e[k]['runs']])})"
           for k in ("bf16", "fp8")),
         f"{e2e['fp8']['total_s'] / e2e['bf16']['total_s']:.3f} ({e2e['fp8_speedup']:.3f}x)", ""],
    ]  # fmt: skip
    parts = "; ".join(
        f"{doc.link(doc.run_at(m['commit'], m['date'], besides=FP8))} ({when(m)}: "
        f"{', '.join(m['parts'])})"
        for m in r.get("merged_from", [])
    )
    head = ["figure", "bf16", "nostall FP8", "FP8 / bf16", "torchao per-row (peer)"]
    return f"{provenance(doc, FP8)} Merged from {parts}.\n\n{table(head, rows)}"


def fp8_targets(doc: Doc) -> str:
    return targets_table(doc, "fp8", [FP8], columns=False)


def gpu_checks(doc: Doc) -> str:
    # every GPU check, newest first (the runs are oldest first)
    names = [n for n in reversed(list(doc.runs)) if n.startswith("gpu-check-")]
    rows = []
    for n in names:
        r = doc.rec(n)
        t, load, dec = (
            r["cuda_tests"],
            r.get("smoke", {}).get("load", {}),
            r.get("smoke", {}).get("decode", {}),
        )
        two = load.get("two_gpus")
        rows.append(
            [when(r), f"`{r['commit']}`", f"{r['hardware']['count']}× {r['hardware']['name']}",
             f"{t['passed']} / {t['failed']} / {t['skipped']}", num(r.get("demo_rc")),
             f"{load.get('safetensors_page_cache_s', 0):.3f} / {load.get('nostall_ring_page_cache_s', 0):.3f} / "
             f"{load.get('nostall_pool_hit_s', 0):.3f} s ({load.get('nostall_pool_hit_gbps', 0):.1f} GB/s)",
             f"{two['both_gpus_s']:.3f} s ({two['both_gpus_total_gbps']:.1f} GB/s)" if two else NA,
             f"{dec['decode_only_s']:.3f} / {dec['async_mp4_s']:.3f} s" if "decode_only_s" in dec else NA,
             "yes" if r["ok"] else "**no**", doc.link(n)]
        )  # fmt: skip
    head = ["date", "commit", "GPUs", "cuda tests passed / failed / skipped", "demo exit",
            "load: safetensors / ring / pool hit", "pool hit to both GPUs at once",
            "Wan decode-only / async MP4", "OK", "record"]  # fmt: skip
    return table(head, rows)


def serve_check(doc: Doc) -> str:
    """#28's real-size check of ``nostall serve`` (scripts/serve_check.py): the drain on
    SIGTERM and the shared tier after its index is damaged."""
    r = doc.rec(SERVE_CHECK)
    d, t = r["drain"], r["shared_tier"]
    status = ", ".join(f"{k} {d[k]}" for k in ("readyz_after_sigterm", "new_request_after_sigterm"))
    rows = [
        [
            f"SIGTERM with `--grace-s {d['grace_s']:g}`, a job running, two queued",
            f"{status}; finished job {d['finished_job']}, running job {d['running_job']} "
            f"({d['running_job_says']}), queued job {d['queued_job']}; exited "
            f"{d['exit_after_sigterm_s']:.1f} s after the signal, status {d['returncode']}",
            "yes" if d["ok"] else "**no**",
        ],
        [
            "three workers on one shared tier, its index overwritten between them",
            f"the third (a smaller budget) warned and attached: {t['third_worker_warned']}; "
            f"first worker's image unchanged: {t['first_worker_image_unchanged']}; second "
            f"worker from tier {t['second_worker_switch_tiers']}; files left after the last "
            f"worker: {len(t['files_left_after_last_worker'])}",
            "yes" if t["ok"] else "**no**",
        ],
    ]
    caption = f"{when(r)}, `{r['commit']}`, {r['hardware']}, {doc.link(SERVE_CHECK)}"
    return f"{caption}\n\n" + table(["check", "what happened", "OK"], rows)


_STREAMS = (
    ("peer", "diffusers worker (peer, `.to()` per switch)"),
    ("stream", "nostall worker"),
    ("stream-batched", "nostall worker, `--batch {batch}`"),
    ("stream-embed", "nostall worker + embedding service in-process"),
    ("stream-embed-process", "nostall worker + embedding service process"),
)


def serve_streams(doc: Doc) -> str:
    """The mixed stream through each server, every record's rows against its own peer."""
    rows = []
    for name in (SERVE, SERVE_B1):
        r = doc.rec(name)
        res, batch = r["results"], r["config"].get("batch")
        peer = res.get("peer", {}).get("throughput_per_s")
        for part, label in _STREAMS:
            s = res.get(part, {})
            if "requests" not in s:
                continue
            tput, busy = s["throughput_per_s"], s.get("gpu_busy_share")
            wrong = s.get("wrong_images") if s.get("images", {}).get("checked") else None
            rows.append([f"`{r['commit']}` {day(r)}", label.format(batch=batch),
                         f"{s['answered_200']}/{s['requests']}", num(wrong),
                         f"{tput:.3f}", f"{tput / peer:.2f}×" if peer else NA,
                         secs(s.get("latency_p50_s"), 1), secs(s.get("latency_p99_s"), 1),
                         NA if busy is None else f"{busy:.1%}"])  # fmt: skip
    head = ["run", "server", "answered", "wrong images", "req/s", "vs peer", "p50", "p99",
            "GPU busy"]  # fmt: skip
    return "\n".join([table(head, rows), "", provenance(doc, SERVE), "",
                      provenance(doc, SERVE_B1, "Unbatched stream")])  # fmt: skip


def serve_by_model(doc: Doc) -> str:
    """Where the worker's time went: each pipeline's median call, per stream part."""
    rows = []
    for name in (SERVE, SERVE_B1):
        r = doc.rec(name)
        for part, label in _STREAMS[1:]:
            for model, m in r["results"].get(part, {}).get("by_model", {}).items():
                med = m["median_s"]
                per = max(1.0, m["requests"] / m["calls"])
                rows.append([f"`{r['commit']}` {day(r)}", label.format(batch=r["config"].get("batch")),
                             model, f"{m['requests']} / {m['calls']}",
                             *(secs(med.get(k), 3) for k in ("text", "denoise", "decode")),
                             secs(med.get("denoise", 0.0) / per, 3)])  # fmt: skip
    head = ["run", "server", "pipeline", "requests / calls", "text", "denoise", "decode",
            "denoise per image"]  # fmt: skip
    return table(head, rows)


def serve_targets(doc: Doc) -> str:
    return targets_table(doc, "serve", [SERVE, SERVE_B1, SERVE_FIRST])


ADAPTERS = "adapters-8baf3fd-2026-12-02.json"
# every GPU run of the LoRA switch, oldest first, and what its commit changed
ADAPTER_RUNS = (
    ("adapters-460f467-2026-12-01.json", "addmm per weight from the kept base copy"),
    ("adapters-da0bee6-2026-12-01.json", "one Triton kernel per weight (one pass)"),
    ("adapters-0a84e35-2026-12-01.json", "one grouped launch per factor chunk"),
    # cut by the call's time limit after the switches were timed: they are in its .log only
    ("adapters-87e2c4b-2026-12-01.json", "launches as the chunks land, while the walk goes on"),
    (ADAPTERS, "a fuse's launches replayed as a plan (no walk over the weights)"),
)


def adapters(doc: Doc) -> str:
    """LoRAs per rank in the run the text discusses: diffusers + PEFT beside nostall."""
    r = doc.rec(ADAPTERS)
    peer, ours = r.get("peer", {}).get("ranks", {}), r.get("nostall", {}).get("switch", {})
    rows = []
    for rank in sorted({*peer, *ours}, key=int):
        p, n = peer.get(rank, {}), ours.get(rank, {})
        mb = r.get("loras", {}).get(f"r{rank}-a", {}).get("bytes")
        rows.append([rank, NA if mb is None else f"{mb / 1e6:.0f}",
                     secs(p.get("first_load_s")), secs(p.get("hotswap_s"), 4),
                     secs(p.get("hotswap_from_memory_s"), 4),
                     NA if "unfused_forward_overhead" not in p
                     else f"{p['unfused_forward_overhead']:+.1%}",
                     secs(max(n["first_switch_s"]) if n else None),
                     secs(n.get("switch_s"), 4), secs(n.get("from_base_s"), 4),
                     secs(n.get("to_base_s"), 4)])  # fmt: skip
    head = ["rank", "LoRA MB", "diffusers: first load", "diffusers: hotswap",
            "hotswap from memory", "unfused forward", "nostall: first switch (file read)",
            "LoRA → LoRA", "base → LoRA", "LoRA → base"]  # fmt: skip
    fwd = r.get("nostall", {}).get("forward", {})
    comp = r.get("nostall", {}).get("compiled", {})
    lines = [table(head, rows), ""]
    if "overhead" in fwd:
        lines.append(f"Forward at 1024² with a fused rank-{r['config']['switch_rank']} LoRA: "
                     f"{fwd['lora_forward_s'] * 1e3:.1f} ms against {fwd['base_forward_s'] * 1e3:.1f}"
                     f" ms for the base ({fwd['overhead']:+.1%}). Graphs compiled over "
                     f"{comp.get('switches', NA)} switches of an inductor-compiled transformer: "
                     f"{num(comp.get('frames_compiled'))}.")  # fmt: skip
    cn = r.get("controlnet", {})
    if "attach_gbps" in cn:
        peer_cn = cn.get("peer", {})
        lines.append(f"ControlNet ({cn['model']['nbytes'] / 1e9:.2f} GB) attached from the host "
                     f"tier in {cn['nostall']['attach_s']:.3f} s ({cn['attach_gbps']:.1f} GB/s); "
                     f"diffusers' load + pipeline {num(peer_cn.get('attach_s'))} s; images "
                     f"equal: {num(cn.get('image', {}).get('equal'))}.")  # fmt: skip
    appended = r.get("appended")
    if appended:
        lines.append(f"The {', '.join(appended['parts'])} part ran at `{appended['commit']}` "
                     f"({appended['date'][:16]}), each against its own peer, and was kept by "
                     "`--append`.")  # fmt: skip
    lines += ["", provenance(doc, ADAPTERS)]
    return "\n".join(lines)


def adapters_runs(doc: Doc) -> str:
    """The LoRA switch in every GPU run, against the peer's hotswap of the same run."""
    rows = []
    for name, change in ADAPTER_RUNS:
        r = doc.rec(name)
        ours = r.get("nostall", {}).get("switch", {})
        hot = r.get("peer", {}).get("ranks", {}).get("64", {}).get("hotswap_s")
        r64 = ours.get("64", {}).get("switch_s")
        rows.append([f"`{r['commit']}` {day(r)}", change,
                     *(secs(ours.get(k, {}).get("switch_s"), 4) for k in ("16", "64", "128")),
                     secs(ours.get("64", {}).get("to_base_s"), 4), secs(hot, 4),
                     f"{hot / r64:.1f}×" if hot and r64 else NA])  # fmt: skip
    head = ["run", "fuse", "r16", "r64", "r128", "r64 → base (a copy)",
            "diffusers hotswap r64", "vs hotswap"]  # fmt: skip
    return table(head, rows)


def adapters_targets(doc: Doc) -> str:
    return targets_table(doc, "adapters", [ADAPTERS, *(n for n, _ in ADAPTER_RUNS[:-1][::-1])])


def remote(doc: Doc) -> str:
    """The FLUX transformer from rclone's S3 server to the device, per link, nostall
    against one GET stream and boto3; then the shared host tier's second process."""
    r = doc.rec(REMOTE)
    res, cfg = r["results"], r["config"]
    gb = r["object"]["nbytes"] / 1e9
    rows = []
    for link in ("loopback", "throttled"):
        x = res.get(link)
        if not x:
            continue
        n, one, b = x["nostall"], x["single"], x["boto3"]
        where = (
            "loopback"
            if link == "loopback"
            else f"{cfg['bwlimit_per_connection']}iB/s per connection"
        )
        rows.append([where, f"**nostall**, {n['connections']} connections",
                     secs(n["to_resident_s"], 2), f"{n['gbps']:.2f}",
                     f"download {secs(n['download_s'], 2)}; copies trail it ×{n['overlap']:.3f}"])  # fmt: skip
        rows.append(["", "one GET stream", NA, f"{one['gbps']:.3f}",
                     "its steady rate" if not one["complete"] else "whole object"])  # fmt: skip
        rows.append(["", "boto3 `download_file` + `load_file`", secs(b["to_resident_s"], 2),
                     f"{b['gbps']:.2f}",
                     f"download {secs(b['download_s'], 2)}; nostall {x['vs_boto3']:.2f}×, "
                     f"{x['vs_single_stream']:.1f}× one stream; tensors "
                     f"{'equal' if b['equal_to_nostall'] else '**differ**'}"])  # fmt: skip
    head = ["link", "method", "to resident", "GB/s", "notes"]
    out = f"FLUX transformer, {gb:.2f} GB, to `{cfg['device']}`.\n\n" + table(head, rows)
    sh = res.get("shared") or {}
    if sh.get("second"):
        a, b2 = sh["first"], sh["second"]
        out += (
            f"\n\nShared host tier: process 1 {a['scenario']} in {secs(a['s'], 2)}; process 2 "
            f"mapped and registered the tier in {secs(b2['attach_s'], 2)}, then its load was a "
            f"{b2['scenario']}: {secs(b2['s'], 3)}, **{b2['gbps']:.1f} GB/s**."
        )
    elif sh.get("error"):
        out += f"\n\nShared host tier: not measured ({' '.join(sh['error'].split())[-200:]})."
    return out + "\n\n" + provenance(doc, REMOTE)


def remote_targets(doc: Doc) -> str:
    return targets_table(doc, "remote", [REMOTE], columns=False)


def video(doc: Doc) -> str:
    """Every ``nostall bench video`` run: per part, row and nostall system (bf16, FP8),
    its median seconds per video beside the same call in-process and diffusers' (bf16),
    the A14B boundary's visible seconds and the device peak."""
    rows = []
    for name, r in sorted(doc.runs.items(), key=lambda kv: kv[1].get("date", "")):
        if r.get("benchmark") != "video":
            continue
        for part, p in r.get("parts", {}).items():
            for row in p.get("rows", []):
                for who, label in (("nostall", "bf16"), ("nostall_fp8", "FP8")):
                    ours = row.get(f"{who}_median_s")
                    if ours is None:
                        continue
                    peer = row.get("diffusers_median_s")
                    visible = "boundary_visible" if who == "nostall" else "fp8_boundary_visible"
                    peak = (row.get("peak_bytes") or {}).get(who)
                    rows.append(
                        [
                            f"{p.get('model')} ({part})",
                            label,
                            f"{row['frames']} × {r.get('width')}×{r.get('height')}, {row['steps']}",
                            secs(ours, 2),
                            secs(row.get("alone_median_s") if who == "nostall" else None, 2),
                            secs(peer, 2),
                            NA if not peer else f"{peer / ours:.2f}×",
                            secs(row.get(f"{visible}_median_s"), 3),
                            NA if peak is None else f"{peak / 1e9:.1f} GB",
                            f"{len(row.get(who, []))}",
                            doc.link(name),
                        ]
                    )
    head = [
        "pipeline (part)",
        "nostall",
        "frames, steps",
        "nostall (HTTP)",
        "same call in-process",
        "diffusers bf16",
        "diffusers ÷ nostall",
        "A14B boundary visible",
        "device peak",
        "passes",
        "run",
    ]
    return table(head, rows)


def video_targets(doc: Doc) -> str:
    return targets_table(doc, "video")


def catalog(doc: Doc) -> str:
    """Every ``nostall bench catalog`` run: per device budget and system, the medians of
    the interleaved rounds; then the preemption part of each run."""
    rows, pre = [], []
    for name, r in sorted(doc.runs.items(), key=lambda kv: kv[1].get("date", "")):
        if r.get("benchmark") != "catalog":
            continue
        for gb, run in r.get("budgets", {}).items():
            for system, m in run.get("medians", {}).items():
                tiers = {}
                for p in run["passes"].get(system, []):
                    for t, n in (p.get("switch_tiers") or {}).items():
                        tiers[t] = tiers.get(t, 0) + n
                rows.append(
                    [
                        f"{gb} GB" + ("" if run.get("complete", True) else " (cut short)"),
                        system,
                        NA if m["slo_attainment"] is None else f"{m['slo_attainment']:.0%}",
                        NA if m["goodput_per_s"] is None else f"{m['goodput_per_s']:.2f}",
                        secs(m["latency_p50_s"], 2),
                        secs(m["latency_p99_s"], 2),
                        secs(m["weights_stall_s"], 2),
                        ", ".join(f"{t} {n}" for t, n in sorted(tiers.items())) or "0",
                        NA if m["gpu_busy_share"] is None else f"{m['gpu_busy_share']:.0%}",
                        f"{m['lost'] or 0:.0f}",
                        str(len(run["passes"].get(system, []))),
                        doc.link(name),
                    ]
                )
            x = run.get("preemption")
            if x:
                pre.append(
                    f"- {doc.link(name)}, {gb} GB: FLUX {x['long']['side']}² {x['long']['steps']} "
                    f"steps {secs(x['long']['straight_s'], 2)} straight, "
                    f"{secs(x['long']['paused_s'], 2)} paused for "
                    f"{', '.join(b['model'] for b in x['preempted_by']) or 'nothing'}; the short "
                    f"SDXL request {secs(x['short']['latency_s'], 2)} (SLO "
                    f"{secs(x['short']['slo_s'], 2)}); the paused image "
                    f"{'equals' if x['equal'] else '**differs from**'} the straight one"
                )
    head = ["budget", "system", "SLO met", "goodput/s", "p50", "p99", "waited for weights",
            "switches by tier (all rounds)", "GPU busy", "lost", "rounds", "run"]  # fmt: skip
    return table(head, rows) + ("\n\n" + "\n".join(pre) if pre else "")


def catalog_targets(doc: Doc) -> str:
    return targets_table(doc, "catalog")


BLOCKS: dict[str, Callable[[Doc], str]] = {
    "load-warm": load_warm,
    "load-cold": load_cold,
    "load-targets": load_targets,
    "decode": decode,
    "decode-b2b": decode_b2b,
    "decode-targets": decode_targets,
    "switch-runs": switch_runs,
    "switch": switch,
    "switch-targets": switch_targets,
    "switch-identity": switch_identity,
    "switch-identity-targets": switch_identity_targets,
    "gpu-checks": gpu_checks,
    "serve-check": serve_check,
    "decode-modes": decode_modes,
    "decode-modes-targets": decode_modes_targets,
    "fp8": fp8,
    "fp8-targets": fp8_targets,
    "serve-streams": serve_streams,
    "serve-by-model": serve_by_model,
    "serve-targets": serve_targets,
    "adapters": adapters,
    "adapters-runs": adapters_runs,
    "adapters-targets": adapters_targets,
    "remote": remote,
    "remote-targets": remote_targets,
    "video": video,
    "video-targets": video_targets,
    "catalog": catalog,
    "catalog-targets": catalog_targets,
}
