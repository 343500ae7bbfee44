"""Benchmark paged attention (decode and prefill) and the norm kernels on one CUDA GPU.

  python3 perf/kernels/bench_attention.py --out $OUT [--sweep] [--prefill-only]

Decode: K+V bytes read per call over time, against the device-to-device copy bandwidth (bytes
read + written) measured in the same run. Each timed CUDA graph runs R calls over R disjoint
block sets (>= 512 MiB of KV in all) so no call finds its K/V in L2, as a real forward over 18
layers would not. Prefill: causal TFLOP/s (2 * T^2 * H * D) against
torch.nn.functional.scaled_dot_product_attention (best of its backends; K/V expanded to 40 heads
and enable_gqa); each config's output checked against SDPA's, a config that fails (error,
compile, resources) is reported and skipped. Prefill configs: "paged" the block-table kernel,
"phased" / "desc" the two-phase kernel (prefill_phased.py) gathering the new tokens' K/V or
reading them contiguously through TMA. Writes attention_bench.json and attention_bench.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import warnings

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from volundr.kernels.attention.decode import paged_decode_attention
from volundr.kernels.attention.naive import naive_paged_attention
from volundr.kernels.attention.prefill import paged_prefill_attention
from volundr.kernels.norm.engine import rms_norm, swiglu

H, KVH, D, BS = 40, 2, 128, 16
DT = torch.bfloat16
SCALE = D ** -0.5


def graph_ms(fn, reps: int = 30) -> float:
    """Median ms of one replay of a CUDA graph capturing fn()."""
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.randn(1 << 30, device="cuda", dtype=DT)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(functools.partial(dst.copy_, src), warmup=50, rep=300,
                                 return_mode="median")
    return 2 * (1 << 31) / (ms * 1e-3)


def decode_inputs(B: int, L: int, R: int):
    nb = B * L // BS
    kc = torch.randn(R * nb, BS, KVH, D, device="cuda", dtype=DT)
    vc = torch.randn_like(kc)
    perm = torch.randperm(R * nb, device="cuda").int()
    bts = [perm[r * nb:(r + 1) * nb].view(B, L // BS) for r in range(R)]
    q = torch.randn(B, H, D, device="cuda", dtype=DT)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    ctx = torch.full((B,), L, device="cuda", dtype=torch.int32)
    return q, kc, vc, bts, cu, ctx


# name: kwargs; "o" = programs_per_sm, the residency the split count is sized for
DECODE_CFGS = {
    "n64_w4_s7_o2": dict(block_n=64, num_warps=4, num_stages=7, programs_per_sm=2),
    "n64_w4_s5_o2": dict(block_n=64, num_warps=4, num_stages=5, programs_per_sm=2),
    "n32_w4_s8_o3": dict(block_n=32, num_warps=4, num_stages=8, programs_per_sm=3),
    "n128_w8_s5_o1": dict(block_n=128, num_warps=8, num_stages=5, programs_per_sm=1),
    "n64_w4_s3_o2": dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=2),
}

def _pcfg(impl: str, m: int, n: int, w: int, s: int, **kw) -> dict:
    return dict(impl=impl, block_m=m, block_n=n, num_warps=w, num_stages=s, **kw)


# desc at BLOCK_N 128 holds 3 K/V stages at most in the H200's 227 KiB of shared memory (+ Q);
# warp_specialize compiles but Triton 3.6 leaves this kernel unspecialised on sm_90 (TTGIR)
PREFILL_CFGS = {
    "m128_n64_w8_s3": _pcfg("paged", 128, 64, 8, 3),
    "m128_n128_w8_s2": _pcfg("paged", 128, 128, 8, 2),
    "m128_n64_w8_s5": _pcfg("paged", 128, 64, 8, 5),
    "m64_n64_w4_s3": _pcfg("paged", 64, 64, 4, 3),
    "phased_m128_n128_w8_s3": _pcfg("phased", 128, 128, 8, 3),
    "desc_m128_n128_w8_s2": _pcfg("desc", 128, 128, 8, 2),
    "desc_m128_n128_w8_s3": _pcfg("desc", 128, 128, 8, 3),
    "desc_m128_n64_w8_s3": _pcfg("desc", 128, 64, 8, 3),
    "desc_m128_n64_w8_s5": _pcfg("desc", 128, 64, 8, 5),
    "desc_ws_m128_n128_w8_s2": _pcfg("desc", 128, 128, 8, 2, warp_specialize=True),
}
# = the engine's defaults (prefill: volundr.kernels.attention.prefill.IMPL / CONFIGS)
DEFAULT_DECODE, DEFAULT_PREFILL = "n64_w4_s5_o2", "desc_m128_n128_w8_s3"


def _decode_calls(q, kc, vc, bts, cu, ctx, L, kw):
    return [paged_decode_attention(q, kc, vc, bt, cu, ctx, SCALE, L, **kw) for bt in bts]


def bench_decode(cfgs, contexts, batches):
    rows = []
    for B in batches:
        for L in contexts:
            kv_bytes = B * L * KVH * D * 2 * 2
            R = max(1, min(64, math.ceil((512 << 20) / kv_bytes)))
            q, kc, vc, bts, cu, ctx = decode_inputs(B, L, R)
            if B * L <= 16 * 4096:  # every config == naive on the bench inputs
                ref = naive_paged_attention(q, kc, vc, bts[0], cu, ctx, SCALE).float()
            for name, kw in cfgs.items():
                run = functools.partial(_decode_calls, q, kc, vc, bts, cu, ctx, L, kw)
                if B * L <= 16 * 4096:
                    out = run()[0].float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    assert err < 1.5e-2, (name, B, L, err)
                ms = graph_ms(run) / R
                rows.append(dict(batch=B, context=L, cfg=name, us=ms * 1e3,
                                 bytes=kv_bytes, bytes_per_s=kv_bytes / (ms * 1e-3)))
                print(f"decode B={B:3d} L={L:7d} {name:15s} {ms * 1e3:9.1f} us "
                      f"{rows[-1]['bytes_per_s'] / 1e12:6.2f} TB/s", flush=True)
            torch.cuda.empty_cache()
    return rows


def sdpa_ms(q, k, v, backend, gqa: bool) -> float | None:
    """Median ms of causal SDPA forced to `backend` (None: PyTorch's own choice)."""
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    try:
        if backend is None:
            fn()
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        with sdpa_kernel([backend]):
            fn()
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    except RuntimeError:
        return None


def bench_prefill(cfgs, lengths):
    rows = []
    for T in lengths:
        flops = 2.0 * T * T * H * D
        q = torch.randn(T, H, D, device="cuda", dtype=DT)
        kc = torch.randn(T // BS, BS, KVH, D, device="cuda", dtype=DT)
        vc = torch.randn_like(kc)
        bt = torch.randperm(T // BS, device="cuda").int().view(1, -1)
        cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
        ctx = torch.tensor([T], device="cuda", dtype=torch.int32)
        # the new tokens' K/V in token order as column slices of one buffer: strided rows, like
        # the engine's split of the fused QKV projection
        kv = torch.stack([c[bt[0].long()].reshape(T, KVH * D) for c in (kc, vc)], 1)
        k_new, v_new = (x.view(T, KVH, D) for x in kv.view(T, 2 * KVH * D).split(KVH * D, 1))
        # SDPA layout [1, heads, T, D]; K/V in token order
        qs = q.transpose(0, 1).unsqueeze(0).contiguous()
        ks = kc[bt[0].long()].reshape(T, KVH, D).transpose(0, 1).unsqueeze(0).contiguous()
        vs = vc[bt[0].long()].reshape(T, KVH, D).transpose(0, 1).unsqueeze(0).contiguous()
        kx, vx = ks.repeat_interleave(H // KVH, 1), vs.repeat_interleave(H // KVH, 1)
        base = {}
        for be in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                   SDPBackend.EFFICIENT_ATTENTION):
            for gqa in (False, True):
                ms = sdpa_ms(qs, ks if gqa else kx, vs if gqa else vx, be, gqa)
                if ms is not None:
                    base[f"{be.name if be else 'DEFAULT'}{'_gqa' if gqa else ''}"] = ms
        best = min(base, key=base.get)
        ref = F.scaled_dot_product_attention(qs, kx, vx, is_causal=True)[0].transpose(0, 1)
        for name, kw in cfgs.items():
            fn = functools.partial(paged_prefill_attention, q, kc, vc, bt, cu, ctx, SCALE, T,
                                   k_new, v_new, **kw)
            try:  # one config that does not compile, fit or match must not end the run
                err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 1.5e-2, f"rel err {err}"
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            except Exception as e:  # noqa: BLE001
                rows.append(dict(T=T, cfg=name, failed=f"{type(e).__name__}: {e}"[:2000]))
                print(f"prefill T={T:6d} {name:24s} FAILED {rows[-1]['failed'][:300]}",
                      flush=True)
                torch.cuda.synchronize()
                continue
            rows.append(dict(T=T, cfg=name, ms=ms, tflops=flops / ms / 1e9,
                             sdpa_best=best, sdpa_ms=base[best],
                             sdpa_tflops=flops / base[best] / 1e9,
                             ratio=base[best] / ms, ratio_default=base["DEFAULT"] / ms,
                             sdpa_all_ms=base, rel_err=err))
            print(f"prefill T={T:6d} {name:24s} {ms:8.2f} ms {rows[-1]['tflops']:6.1f} TFLOP/s"
                  f" | SDPA {best} {base[best]:.2f} ms {rows[-1]['sdpa_tflops']:.1f}"
                  f" -> ratio {rows[-1]['ratio']:.2f} (vs default SDPA "
                  f"{rows[-1]['ratio_default']:.2f})", flush=True)
        torch.cuda.empty_cache()
    return rows


def bench_norm(copy_bw: float):
    T, C, inter = 8192, 5120, 17408
    x, r = (torch.randn(T, C, device="cuda", dtype=DT) for _ in range(2))
    w = torch.randn(C, device="cuda", dtype=DT)
    gu = torch.randn(T, 2 * inter, device="cuda", dtype=DT)
    out = {}
    for name, fn, nbytes in [
        ("rms_norm_residual", lambda: rms_norm(x, w, 1e-6, r), 4 * T * C * 2),
        ("rms_norm", lambda: rms_norm(x, w, 1e-6), 2 * T * C * 2),
        ("swiglu", lambda: swiglu(gu[:, :inter], gu[:, inter:]), 3 * T * inter * 2),
    ]:
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        out[name] = dict(us=ms * 1e3, bytes_per_s=nbytes / (ms * 1e-3),
                         frac_copy=nbytes / (ms * 1e-3) / copy_bw)
        print(f"{name:18s} {ms * 1e3:8.1f} us {out[name]['frac_copy']:.2f} of copy", flush=True)
    return out


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    if res.get("decode"):
        plot_decode(res, a1)
    plot_prefill(res, a2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_decode(res, a1) -> None:
    bw = res["copy_bytes_per_s"] / 1e12
    for B in sorted({r["batch"] for r in res["decode"]}):
        best = {}
        for r in res["decode"]:
            if r["batch"] == B and r["cfg"] == res["decode_default_cfg"]:
                best[r["context"]] = r["bytes_per_s"] / 1e12
        xs = sorted(best)
        a1.plot(xs, [best[x] for x in xs], "o-", label=f"Triton paged decode, batch {B}")
    a1.axhline(bw, color="k", ls="--", label=f"D2D copy {bw:.2f} TB/s")
    a1.axhline(0.8 * bw, color="gray", ls=":", label="80% of copy")
    a1.set_xscale("log", base=2)
    a1.set(xlabel="context (tokens)", ylabel="K+V TB/s", title="Decode attention (H200, bf16)")
    a1.legend(fontsize=8)


def plot_prefill(res, a2) -> None:
    """The default config, the best of the sweep and SDPA's best backend, per T."""
    ok = [r for r in res["prefill"] if "failed" not in r]
    Ts = sorted({r["T"] for r in ok})
    dflt = [max([r["tflops"] for r in ok if r["T"] == T and
                 r["cfg"] == res["prefill_default_cfg"]] or [0.0]) for T in Ts]
    best = [max((r for r in ok if r["T"] == T), key=lambda r: r["tflops"]) for T in Ts]
    sdpa = [next(r["sdpa_tflops"] for r in ok if r["T"] == T) for T in Ts]
    xs = range(len(Ts))
    a2.bar([x - 0.27 for x in xs], dflt, 0.27, label=f"Triton {res['prefill_default_cfg']}")
    a2.bar(list(xs), [r["tflops"] for r in best], 0.27, label="Triton, best config")
    for x, r in zip(xs, best):
        a2.text(x, r["tflops"], r["cfg"], rotation=90, fontsize=6, ha="center", va="top")
    a2.bar([x + 0.27 for x in xs], sdpa, 0.27, label="SDPA (best backend)")
    a2.set_xticks(list(xs), [f"{T // 1024}K" for T in Ts])
    a2.set(xlabel="T (causal, 40 q / 2 kv heads, d=128)", ylabel="TFLOP/s",
           title="Prefill attention")
    a2.legend(fontsize=8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/out"))
    ap.add_argument("--sweep", action="store_true", help="time every config, not only defaults")
    ap.add_argument("--prefill-only", action="store_true", help="prefill only (no norms, decode)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # SDPA's "kernel not used" notes
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    dcfg = DECODE_CFGS if a.sweep else {DEFAULT_DECODE: DECODE_CFGS[DEFAULT_DECODE]}
    pcfg = PREFILL_CFGS if a.sweep else {DEFAULT_PREFILL: PREFILL_CFGS[DEFAULT_PREFILL]}
    bw = 0.0 if a.prefill_only else copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, copy_bytes_per_s=bw,
               decode_default_cfg=DEFAULT_DECODE, prefill_default_cfg=DEFAULT_PREFILL)
    try:
        res["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                       text=True).stdout.strip()
    except OSError:
        pass
    if not a.prefill_only:
        res["norm"] = bench_norm(bw)
        res["decode"] = bench_decode(dcfg, [4096, 32768, 131072, 262144], [1, 16])
    res["prefill"] = bench_prefill(pcfg, [4096, 16384, 32768])
    with open(os.path.join(a.out, "attention_bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, "attention_bench.png"))
    print("\nsummary (default cfgs): decode fraction of copy bandwidth")
    for r in res.get("decode", []):
        print(f"  B={r['batch']:2d} L={r['context']:6d} {r['cfg']:15s} "
              f"{r['bytes_per_s'] / bw:.2f}")
    if a.sweep:
        print("best config per shape:")
        for key in sorted({(r["batch"], r["context"]) for r in res.get("decode", [])}):
            rs = [r for r in res["decode"] if (r["batch"], r["context"]) == key]
            b = max(rs, key=lambda r: r["bytes_per_s"])
            print(f"  decode B={key[0]} L={key[1]}: {b['cfg']} {b['bytes_per_s'] / bw:.2f}")
    failed = [r for r in res["prefill"] if "failed" in r]
    for r in res["prefill"]:
        if "failed" in r:
            continue
        print(f"  prefill T={r['T']} {r['cfg']} {r['tflops']:.0f} TFLOP/s vs SDPA "
              f"{r['sdpa_tflops']:.0f} ({r['sdpa_best']}): {r['ratio']:.2f}x; vs default SDPA "
              f"{r['ratio_default']:.2f}x")
    for r in failed:
        print(f"  FAILED prefill T={r['T']} {r['cfg']}: {r['failed'][:300]}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
