"""Diagnostic for issue #9 (not a benchmark): where the Wan VAE decoder's time goes per
op, and which rewrites keep its arithmetic bit for bit.

Run on the GPU machine: ``python scripts/diag_vae_exact.py --out $OUT/diag-vae.json``.
Checks, each compared bitwise against diffusers' eager ops on the same inputs:

* determinism: ``vae.decode`` twice on the same latents;
* norm: ``vector_norm(x_bf16, dtype=float32)`` against ``x.float().norm()``;
* fused: one Triton kernel for RMS-norm (given the fp32 norm) * scale * gamma + 0, SiLU,
  written into the interior of a padded buffer, against the eager chain;
* conv padding: the conv's own spatial padding against ``F.pad`` + conv;
* halo: a conv on the top half plus one halo row against the full conv's top half.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F


def _same(a: torch.Tensor, b: torch.Tensor) -> dict:
    eq = torch.equal(a, b)
    diff = (a.float() - b.float()).abs()
    return {
        "bit_identical": bool(eq),
        "max_abs": float(diff.max()),
        "mismatches": int((a != b).sum()),
        "numel": a.numel(),
    }


def _vae(dtype):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = AutoencoderKLWan()
    return vae.to(dtype).eval()


def check_determinism(vae, z) -> dict:
    with torch.inference_mode():
        a = vae.decode(z).sample
        b = vae.decode(z).sample
    return _same(a, b)


def check_norm(x: torch.Tensor) -> dict:
    ref = x.float().norm(2, 1, keepdim=True)
    alt = torch.linalg.vector_norm(x, 2, dim=1, keepdim=True, dtype=torch.float32)
    return _same(ref, alt)


try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    triton = None


def _fused_kernel():
    return _rms_silu


if triton is not None:

    @triton.jit
    def _rms_silu(
        x_ptr,
        norm_ptr,
        gamma_ptr,
        out_ptr,
        N,
        C,
        S,
        HW,
        W,
        ob,
        oc,
        ot,
        oh,
        ow,
        scale,
        eps,
        BLOCK: tl.constexpr,
        LIBDEVICE: tl.constexpr = True,  # False only under TRITON_INTERPRET (CPU syntax check)
    ):
        pid = tl.program_id(0)
        idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < N
        s = idx % S
        c = (idx // S) % C
        b = idx // (S * C)
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        n = tl.load(norm_ptr + b * S + s, mask=mask, other=1.0)
        g = tl.load(gamma_ptr + c, mask=mask, other=0.0).to(tl.float32)
        y = (
            tl.math.div_rn(x, tl.maximum(n, eps))
            .to(tl.bfloat16, fp_downcast_rounding="rtne")
            .to(tl.float32)
        )
        y = (y * scale).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        y = (y * g).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        y = tl.where(y == 0.0, 0.0, y)  # + 0.0: -0 becomes +0, as eager's add does
        if LIBDEVICE:  # noqa: SIM108  (a constexpr branch: one is compiled)
            e = libdevice.exp(-y)  # expf, as ATen's SiLU calls it (not the ex2 approximation)
        else:
            e = tl.exp(-y)
        y = tl.math.div_rn(y, 1.0 + e).to(tl.bfloat16, fp_downcast_rounding="rtne")
        t = s // HW
        h = (s // W) % (HW // W)
        w = s % W
        tl.store(out_ptr + b * ob + c * oc + t * ot + h * oh + w * ow, y, mask=mask)


def check_fused(x: torch.Tensor, gamma: torch.Tensor) -> dict:
    B, C, T, H, W = x.shape
    scale = C**0.5
    # eager: WanRMS_norm(images=False) then SiLU, as WanResidualBlock runs them
    ref = F.normalize(x.float(), dim=1).to(x.dtype) * scale * gamma.view(C, 1, 1, 1) + 0.0
    ref = F.silu(ref)
    out = {}
    kern = _fused_kernel()
    for label, norm in (
        ("norm_of_float_copy", x.float().norm(2, 1, keepdim=True)),
        ("vector_norm_dtype", torch.linalg.vector_norm(x, 2, 1, keepdim=True, dtype=torch.float32)),
    ):
        buf = torch.zeros(B, C, T + 2, H + 2, W + 2, dtype=x.dtype, device=x.device)
        dst = buf[:, :, 2:, 1:-1, 1:-1]
        N = x.numel()
        BLOCK = 1024
        kern[(triton_cdiv(N, BLOCK),)](
            x,
            norm.contiguous(),
            gamma.contiguous(),
            dst,
            N,
            C,
            T * H * W,
            H * W,
            W,
            *dst.stride(),
            scale,
            1e-12,
            BLOCK=BLOCK,
            LIBDEVICE=x.is_cuda,
        )
        res = _same(ref, dst)
        res["border_zero"] = bool(
            buf[:, :, :2].abs().sum() == 0 and buf[..., 0, :].abs().sum() == 0
        )
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            kern[(triton_cdiv(N, BLOCK),)](
                x,
                norm,
                gamma,
                dst,
                N,
                C,
                T * H * W,
                H * W,
                W,
                *dst.stride(),
                scale,
                1e-12,
                BLOCK=BLOCK,
                LIBDEVICE=x.is_cuda,
            )
        torch.cuda.synchronize()
        res["fused_ms"] = (time.perf_counter() - t) / 20 * 1e3
        out[label] = res
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        r = F.normalize(x.float(), dim=1).to(x.dtype) * scale * gamma.view(C, 1, 1, 1) + 0.0
        r = F.silu(r)
        r = F.pad(torch.cat([r[:, :, :2], r], 2), (1, 1, 1, 1, 0, 0))
    torch.cuda.synchronize()
    out["eager_chain_ms"] = (time.perf_counter() - t) / 20 * 1e3
    return out


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def check_conv_padding(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> dict:
    xp = F.pad(x, (1, 1, 1, 1, 0, 0))
    ref = F.conv3d(xp, w, bias)
    alt = F.conv3d(x, w, bias, padding=(0, 1, 1))
    return _same(ref, alt)


def check_halo(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> dict:
    H = x.shape[3]
    half = H // 2
    full = F.conv3d(F.pad(x, (1, 1, 1, 1, 0, 0)), w, bias)
    top = F.conv3d(F.pad(x[:, :, :, : half + 1], (1, 1, 1, 0, 0, 0)), w, bias)
    bot = F.conv3d(F.pad(x[:, :, :, half - 1 :], (1, 1, 0, 1, 0, 0)), w, bias)
    return {
        "top": _same(full[:, :, :, :half], top),
        "bottom": _same(full[:, :, :, half:], bot),
    }


def profile_ops(vae, z, mode: str = "vae.decode") -> dict:
    from torch.profiler import ProfilerActivity, profile

    from nostall.video.wan import decode_chunks

    def run(zz):
        if mode == "vae.decode":
            vae.decode(zz)
        else:
            for _ in decode_chunks(vae, zz, mode=mode):
                pass

    with torch.inference_mode():
        run(z[:, :, :2])
        torch.cuda.synchronize()
        t = time.perf_counter()
        run(z)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(z)
            torch.cuda.synchronize()
    rows = []
    total = 0.0
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = e.self_cuda_time_total
        if dev <= 0:
            continue
        total += dev
        rows.append({"op": e.key, "self_ms": dev / 1e3, "calls": e.count})
    rows.sort(key=lambda r: -r["self_ms"])
    for r in rows:
        r["share"] = r["self_ms"] * 1e3 / total
    return {"wall_s": wall, "latent_frames": z.shape[2], "device_ms": total / 1e3, "ops": rows[:40]}


def time_modes(latent_frames: int) -> dict:
    """Decode-only seconds and peak memory, eager against nostall's exact mode, 720p."""
    from nostall.video.wan import decode_chunks

    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        vae = _vae(dtype)
        g = torch.Generator(device="cuda").manual_seed(0)
        z = torch.randn(1, 16, latent_frames, 90, 160, device="cuda", generator=g, dtype=dtype)
        row = {}
        frames = {}
        if dtype != torch.float32:
            import copy

            vae32 = copy.deepcopy(vae).float()
            with torch.inference_mode():
                ref32 = torch.cat(list(decode_chunks(vae32, z.float())), 2)
            del vae32
        else:
            ref32 = None
        for mode in ("eager", "exact", "fast"):
            with torch.inference_mode():
                for _ in decode_chunks(vae, z[:, :, :2], mode=mode):
                    pass
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                t = time.perf_counter()
                chunks = []
                for c in decode_chunks(vae, z, mode=mode):
                    chunks.append(c)
                torch.cuda.synchronize()
                row[f"{mode}_s"] = time.perf_counter() - t
                row[f"{mode}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                frames[mode] = torch.cat(chunks, 2)
                del chunks
        row["speedup"] = row["eager_s"] / row["exact_s"]
        row["fast_speedup"] = row["eager_s"] / row["fast_s"]
        row["bit_identical"] = bool(torch.equal(frames["eager"], frames["exact"]))
        row["mismatches"] = int((frames["eager"] != frames["exact"]).sum())
        ref = ref32 if ref32 is not None else frames["eager"]
        for mode in ("eager", "exact", "fast"):
            mse = float(((frames[mode].float() - ref.float()) ** 2).mean())
            row[f"{mode}_psnr_db"] = None if mse == 0 else 10 * math.log10(4.0 / mse)
        out[name] = row
        print(name, row, flush=True)
        del vae, z, frames
        torch.cuda.empty_cache()
    return out


def time_two_gpus(latent_frames: int) -> dict:
    """bf16 exact on cuda:0 against exact split over cuda:0 and cuda:1, 720p."""
    from nostall.video.wan import decode_chunks

    vae = _vae(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(1, 16, latent_frames, 90, 160, device="cuda", generator=g, dtype=torch.bfloat16)
    row, frames = {}, {}
    from nostall.video import exact as exact_mod

    real_split = exact_mod.split_points
    chosen = real_split(
        vae.decoder,
        __import__("diffusers.models.autoencoders.autoencoder_kl_wan", fromlist=["x"]),
        2,
    )[0]
    runs = [("one", None, None), ("two", ["cuda:0", "cuda:1"], None)]
    runs += [(f"two_cut{c}", ["cuda:0", "cuda:1"], c) for c in (chosen - 2, chosen - 1, chosen + 1)]
    row["chosen_cut"] = chosen
    for name, devices, cut in runs:
        exact_mod.split_points = (lambda *a, c=cut: [c]) if cut is not None else real_split
        with torch.inference_mode():
            for _ in decode_chunks(vae, z[:, :, :2], mode="exact", devices=devices):
                pass
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)
            t = time.perf_counter()
            # Chunks stay where they are made (a copy back to cuda:0 inside the loop would
            # order the next chunk's first stage after this one's second).
            chunks = list(decode_chunks(vae, z, mode="exact", devices=devices))
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)
            row[f"{name}_s"] = time.perf_counter() - t
            frames[name] = torch.cat([c.to("cuda:0") for c in chunks], 2)
            print(name, row[f"{name}_s"], flush=True)
    exact_mod.split_points = real_split
    for name in list(row):
        if name.startswith("two_cut") and name.endswith("_s"):
            row[name[:-2] + "_speedup"] = row["one_s"] / row[name]
    row["speedup"] = row["one_s"] / row["two_s"]
    row["bit_identical"] = bool(torch.equal(frames["one"], frames["two"]))
    print("two GPUs", row, flush=True)
    return row


def tune_kernel() -> dict:
    """Time nostall's fused kernel per (block, num_warps) on the decoder's two largest
    activations, each result checked bitwise against the eager chain."""
    from nostall.video import kernels

    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, shape in (
        ("720p_c96_t4", (1, 96, 4, 720, 1280)),
        ("360p_c192_t4", (1, 192, 4, 360, 640)),
    ):
        x = torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)
        C = shape[1]
        gamma = (1 + 0.1 * torch.randn(C, device="cuda", generator=g)).to(torch.bfloat16)
        ref = F.silu(
            F.normalize(x.float(), dim=1).to(x.dtype) * C**0.5 * gamma.view(C, 1, 1, 1) + 0.0
        )
        B, _, T, H, W = shape
        buf = torch.zeros(B, C, T + 2, H + 2, W + 2, dtype=x.dtype, device="cuda")
        dst = buf[:, :, 2:, 1:-1, 1:-1]
        norm = kernels.channel_norm(x)
        rows = {}
        for block in (256, 512, 1024, 2048):
            for warps in (2, 4, 8):
                kernels._launch(x, norm, gamma, C**0.5, dst, block=block, num_warps=warps)
                same = bool(torch.equal(dst, ref))
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(20):
                    kernels._launch(x, norm, gamma, C**0.5, dst, block=block, num_warps=warps)
                torch.cuda.synchronize()
                ms = (time.perf_counter() - t) / 20 * 1e3
                rows[f"{block}x{warps}"] = {"ms": ms, "bit_identical": same}
        gbytes = 2 * x.numel() * x.element_size() / 1e9
        best = min(rows, key=lambda k: rows[k]["ms"])
        out[label] = {"configs": rows, "best": best, "bound_ms_at_4tbps": gbytes / 4.0e3 * 1e3}
        print(label, best, rows[best], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--time", type=int, default=0, help="latent frames for eager vs exact timing")
    p.add_argument("--profile-mode", default=None, help="only profile decode_chunks(mode=...)")
    p.add_argument("--two-gpus", type=int, default=0, help="latent frames: exact on 1 vs 2 GPUs")
    p.add_argument("--tune-kernel", action="store_true", help="time the fused kernel's configs")
    args = p.parse_args()
    if args.tune_kernel:
        with open(args.out, "w") as f:
            json.dump({"tune_kernel": tune_kernel()}, f, indent=1)
        return
    if args.two_gpus:
        with open(args.out, "w") as f:
            json.dump({"two_gpus": time_two_gpus(args.two_gpus)}, f, indent=1)
        return
    if args.profile_mode:
        vae = _vae(torch.bfloat16)
        g = torch.Generator(device="cuda").manual_seed(0)
        z = torch.randn(
            1, 16, args.frames, 90, 160, device="cuda", generator=g, dtype=torch.bfloat16
        )
        prof = profile_ops(vae, z, args.profile_mode)
        with open(args.out, "w") as f:
            json.dump(prof, f, indent=1)
        print(
            f"wall {prof['wall_s']:.3f} s for {prof['latent_frames']} latents, mode {args.profile_mode}"
        )
        for r in prof["ops"][:30]:
            print(f"{r['self_ms']:9.1f} ms {r['share']:6.1%} {r['calls']:6d}  {r['op'][:110]}")
        return
    if args.time:
        report = {"time_modes": time_modes(args.time)}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return
    torch.backends.cudnn.benchmark = False
    report: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    vae = _vae(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(1, 16, args.frames, 90, 160, device="cuda", generator=g, dtype=torch.bfloat16)
    report["determinism"] = check_determinism(vae, z[:, :, :3])
    x = torch.randn(1, 96, 4, 720, 1280, device="cuda", dtype=torch.bfloat16, generator=g)
    x_mid = torch.randn(1, 384, 4, 90, 160, device="cuda", dtype=torch.bfloat16, generator=g)
    report["norm_720p_c96"] = check_norm(x)
    report["norm_90p_c384"] = check_norm(x_mid)
    gamma = (1 + 0.1 * torch.randn(96, device="cuda", generator=g)).to(torch.bfloat16)
    gamma_mid = (1 + 0.1 * torch.randn(384, device="cuda", generator=g)).to(torch.bfloat16)
    try:
        report["fused_720p_c96"] = check_fused(x, gamma)
        report["fused_90p_c384"] = check_fused(x_mid, gamma_mid)
    except Exception as e:
        report["fused_error"] = f"{type(e).__name__}: {e}"
    conv = vae.decoder.up_blocks[3].resnets[0].conv1
    xc = torch.randn(1, 96, 6, 720, 1280, device="cuda", dtype=torch.bfloat16, generator=g)
    report["conv_padding"] = check_conv_padding(xc, conv.weight, conv.bias)
    report["halo_720p_c96"] = check_halo(xc, conv.weight, conv.bias)
    conv_mid = vae.decoder.mid_block.resnets[0].conv1
    xm = torch.randn(1, 384, 6, 90, 160, device="cuda", dtype=torch.bfloat16, generator=g)
    report["halo_90p_c384"] = check_halo(xm, conv_mid.weight, conv_mid.bias)
    del x, xc
    report["profile_bf16"] = profile_ops(vae, z)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    brief = {k: v for k, v in report.items() if k != "profile_bf16"}
    print(json.dumps(brief, indent=1))
    prof = report["profile_bf16"]
    print(f"wall {prof['wall_s']:.3f} s for {prof['latent_frames']} latents")
    for r in prof["ops"][:25]:
        print(f"{r['self_ms']:9.1f} ms {r['share']:6.1%} {r['calls']:6d}  {r['op'][:90]}")


if __name__ == "__main__":
    main()
