# ruff: noqa: B023, RUF028
"""FP8 kernels on the GPU, measured before choosing nostall's default FP8 path.

1. every FLUX.1-dev linear shape at 1024² (M = 4096 image / 512 text / 4608 joint tokens,
   M = 1 for the modulation layers): bf16 ``F.linear`` against nostall's FP8 forward
   (Triton row quantisation + row-wise ``scaled_mm``), its parts, per-tensor
   ``scaled_mm``, the upcast path and torchao's ``Float8Tensor``;
2. the whole random FLUX transformer (bf16, 23.8 GB, in memory): eager bf16 vs nostall
   FP8 vs torchao per-row FP8 (same layers converted), SQNR of both against bf16, then
   ``compile_repeated_blocks`` for bf16 and nostall FP8 (and torchao if ``--torchao-compile``).

    python scripts/diag_fp8.py --out $OUT/diag-fp8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda")


def timed(fn, n=20, warm=3) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def wall(fn, n=5, warm=2) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


SHAPES = [  # (what, M, K, N)
    ("double img qkv/out", 4096, 3072, 3072),
    ("double img ff in", 4096, 3072, 12288),
    ("double img ff out", 4096, 12288, 3072),
    ("double txt qkv/out", 512, 3072, 3072),
    ("double txt ff in", 512, 3072, 12288),
    ("double txt ff out", 512, 12288, 3072),
    ("single qkv", 4608, 3072, 3072),
    ("single mlp in", 4608, 3072, 12288),
    ("single proj_out", 4608, 15360, 3072),
    ("double modulation", 1, 3072, 18432),
    ("single modulation", 1, 3072, 9216),
]


def micro(torchao_ok: bool) -> list[dict]:
    from nostall.quant.fp8 import quantize_weight
    from nostall.quant.kernels import quantize_rows, quantize_rows_reference
    from nostall.quant.linear import fp8_linear

    rows = []
    for what, m, k, n in SHAPES:
        x = (torch.randn(m, k, device=DEV) * 2).bfloat16()
        w = (torch.randn(n, k, device=DEV) * 0.02).bfloat16()
        b = (torch.randn(n, device=DEV) * 0.02).bfloat16()
        q, s = quantize_weight(w)
        xq, xs = quantize_rows(x)
        r = {"shape": what, "M": m, "K": k, "N": n}
        r["bf16_us"] = timed(lambda: F.linear(x, w, b)) * 1e6
        r["fp8_ours_us"] = timed(lambda: fp8_linear(x, q, s, b, tensor_cores=True)) * 1e6
        r["quant_triton_us"] = timed(lambda: quantize_rows(x)) * 1e6
        r["quant_torch_ops_us"] = timed(lambda: quantize_rows_reference(x)) * 1e6
        r["scaled_mm_rowwise_us"] = (
            timed(
                lambda: torch._scaled_mm(
                    xq,
                    q.t(),
                    scale_a=xs,
                    scale_b=s.reshape(1, n),
                    bias=b,
                    out_dtype=torch.bfloat16,
                    use_fast_accum=True,
                )  # fmt: skip
            )
            * 1e6
        )
        one = torch.ones((), device=DEV)
        r["scaled_mm_tensorwise_us"] = (
            timed(
                lambda: torch._scaled_mm(
                    xq,
                    q.t(),
                    scale_a=one,
                    scale_b=one,
                    out_dtype=torch.bfloat16,
                    use_fast_accum=True,
                )  # fmt: skip
            )
            * 1e6
        )
        r["upcast_us"] = timed(lambda: fp8_linear(x, q, s, b, tensor_cores=False)) * 1e6
        if torchao_ok:
            try:
                from torchao.quantization import (
                    Float8DynamicActivationFloat8WeightConfig,
                    PerRow,
                    quantize_,
                )

                lin = nn.Linear(k, n, device=DEV, dtype=torch.bfloat16)
                lin.weight.data.copy_(w)
                lin.bias.data.copy_(b)
                quantize_(lin, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
                with torch.inference_mode():
                    r["torchao_us"] = timed(lambda: lin(x)) * 1e6
            except Exception as e:  # a finding, not a crash
                r["torchao_error"] = f"{type(e).__name__}: {e}"[:200]
        r["ours_vs_bf16"] = r["fp8_ours_us"] / r["bf16_us"]
        rows.append(r)
        print(
            f"{what:20s} M={m:5d} bf16 {r['bf16_us']:7.1f} ours {r['fp8_ours_us']:7.1f} "
            f"(quant {r['quant_triton_us']:5.1f}/{r['quant_torch_ops_us']:5.1f}, mm row "
            f"{r['scaled_mm_rowwise_us']:6.1f} tensor {r['scaled_mm_tensorwise_us']:6.1f}) "
            f"upcast {r['upcast_us']:7.1f} torchao {r.get('torchao_us', float('nan')):7.1f} "
            f"ratio {r['ours_vs_bf16']:.2f}",
            flush=True,
        )
    return rows


def whole(torchao_ok: bool, torchao_compile: bool) -> dict:
    import copy

    import diffusers

    from nostall.verify import sqnr_db
    from nostall.quant.fp8 import DEFAULT_SKIP, quantize_weight, skip_reason
    from nostall.quant.modules import install_fp8
    from nostall.synthetic import step_inputs

    out: dict = {}
    t = time.perf_counter()
    with torch.device("meta"):
        ref = diffusers.FluxTransformer2DModel(guidance_embeds=True)
    ref = ref.to(torch.bfloat16).to_empty(device=DEV).eval()
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=DEV) * 0.02)
    out["build_s"] = time.perf_counter() - t

    def convertible(fqn: str, mod: nn.Module) -> bool:
        return (
            isinstance(mod, nn.Linear)
            and skip_reason(
                fqn + ".weight", tuple(mod.weight.shape), mod.weight.dtype, DEFAULT_SKIP
            )
            is None
        )

    ours = copy.deepcopy(ref)
    scales = {}
    with torch.no_grad():
        for fqn, mod in ours.named_modules():
            if convertible(fqn, mod):
                q, s = quantize_weight(mod.weight)
                mod.weight = nn.Parameter(q, requires_grad=False)
                scales[fqn + ".weight"] = s
    install_fp8(ours, scales)
    out["converted_layers"] = len(scales)
    inputs = step_inputs(ref, "full", DEV)

    def fwd(m):
        def f():
            with torch.inference_mode():
                return m(**inputs)[0]

        return f

    res = {}
    res["bf16_eager_s"] = wall(fwd(ref))
    res["ours_eager_s"] = wall(fwd(ours))
    with torch.inference_mode():
        a, b = ref(**inputs)[0], ours(**inputs)[0]
    out["sqnr_ours_db"] = sqnr_db(a, b)
    print(f"eager bf16 {res['bf16_eager_s'] * 1e3:.1f} ms, ours {res['ours_eager_s'] * 1e3:.1f} ms, "
          f"SQNR {out['sqnr_ours_db']:.2f} dB", flush=True)  # fmt: skip
    ao = None
    if torchao_ok:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            PerRow,
            quantize_,
        )

        del ours
        torch.cuda.empty_cache()
        ao = copy.deepcopy(ref)
        quantize_(
            ao,
            Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
            filter_fn=lambda mod, fqn: convertible(fqn, mod),
        )
        res["torchao_eager_s"] = wall(fwd(ao))
        with torch.inference_mode():
            c = ao(**inputs)[0]
        out["sqnr_torchao_db"] = sqnr_db(a, c)
        print(f"torchao eager {res['torchao_eager_s'] * 1e3:.1f} ms, SQNR "
              f"{out['sqnr_torchao_db']:.2f} dB", flush=True)  # fmt: skip
        if not torchao_compile:
            del ao
            ao = None
        ours = copy.deepcopy(ref)
        with torch.no_grad():
            for fqn, mod in ours.named_modules():
                if convertible(fqn, mod):
                    q, s = quantize_weight(mod.weight)
                    mod.weight = nn.Parameter(q, requires_grad=False)
        install_fp8(ours, scales)
    torch.cuda.empty_cache()
    models = [("bf16", ref), ("ours", ours)] + ([("torchao", ao)] if ao is not None else [])
    for name, m in models:
        torch._dynamo.reset()
        t = time.perf_counter()
        m.compile_repeated_blocks(fullgraph=True)
        with torch.inference_mode():
            m(**inputs)
        torch.cuda.synchronize()
        res[f"{name}_compile_s"] = time.perf_counter() - t
        res[f"{name}_compiled_s"] = wall(fwd(m))
        print(f"{name} compiled {res[f'{name}_compiled_s'] * 1e3:.1f} ms (compile "
              f"{res[f'{name}_compile_s']:.1f} s)", flush=True)  # fmt: skip
        if name == "ours":
            with torch.inference_mode():
                out["sqnr_ours_compiled_db"] = sqnr_db(a, m(**inputs)[0])
    out["times"] = res
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--skip-whole", action="store_true")
    p.add_argument("--torchao-compile", action="store_true")
    args = p.parse_args()
    try:
        import torchao  # noqa: F401

        torchao_ok = True
    except ImportError:
        torchao_ok = False
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["micro"] = micro(torchao_ok)
    if not args.skip_whole:
        report["whole"] = whole(torchao_ok, args.torchao_compile)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
