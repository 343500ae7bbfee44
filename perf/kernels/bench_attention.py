"""Benchmark paged attention (decode and prefill) and the norm kernels on one CUDA GPU.

  python3 perf/kernels/bench_attention.py --out $OUT [--sweep] [--prefill-only] [--prefix P]
      [--decode-only] [--decode-cfgs NAME,...] [--fenced]

Decode: K+V bytes read per call over time, against the device-to-device copy bandwidth (bytes
read + written) measured in the same run. Each timed CUDA graph runs R calls over R disjoint
block sets (>= 512 MiB of KV in all) so no call finds its K/V in L2, as a real forward over 18
layers would not; consecutive calls overlap as PDL lets them (--fenced also times every config
with a non-PDL kernel between calls: the single-call latency). Prefill: causal TFLOP/s (2 * T^2
* H * D) against torch.nn.functional.scaled_dot_product_attention (best of its backends; K/V
expanded to 40 heads and enable_gqa); each config's output checked against SDPA's, a config that
fails (error, compile, resources) is reported and skipped. Prefill configs: "paged" the
block-table kernel, "phased" / "desc" the two-phase kernel (prefill_phased.py) gathering the new
tokens' K/V or reading them contiguously through TMA. --prefix P: also 512 / 2048 new tokens
after P cached ones (a resumed session: the prefix part is a block-table gather in every config)
against SDPA with a bottom-right causal mask. Writes attention_bench.json and
attention_bench.png.
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
import triton
from attention_prefill import (  # perf/kernels/attention_prefill.py, beside this script
    BS,
    DT,
    KVH,
    PREFILL_CFGS,
    SCALE,
    D,
    H,
    bench_prefill,
    bench_prefill_prefix,
)

from volundr.kernels.attention.cache import FP8
from volundr.kernels.attention.decode import paged_decode_attention
from volundr.kernels.attention.naive import naive_paged_attention
from volundr.kernels.norm.engine import rms_norm, swiglu


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


def decode_inputs(B: int, L: int, R: int, kv_dtype: torch.dtype = DT):
    nb = B * L // BS
    kc = torch.randn(R * nb, BS, KVH, D, device="cuda", dtype=DT).to(kv_dtype)
    vc = torch.randn(R * nb, BS, KVH, D, device="cuda", dtype=DT).to(kv_dtype)
    perm = torch.randperm(R * nb, device="cuda").int()
    bts = [perm[r * nb:(r + 1) * nb].view(B, L // BS) for r in range(R)]
    q = torch.randn(B, H, D, device="cuda", dtype=DT)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    ctx = torch.full((B,), L, device="cuda", dtype=torch.int32)
    return q, kc, vc, bts, cu, ctx


def decode_cfg(name: str) -> dict:
    """paged_decode_attention's kwargs from a name
    [heads_]nB_wW_sS_oO[+ahead][+early][+bf16p][+f16]: block_n, warps, stages, "o" =
    programs_per_sm (the residency the split count is sized for); bf16p: bfloat16 partials;
    f16: an fp8 cache's dots in float16."""
    base, *flags = name.split("+")
    heads = base.startswith("heads_")
    n, w, s, o = (int(f[1:]) for f in base.removeprefix("heads_").split("_"))
    cfg = dict(block_n=n, num_warps=w, num_stages=s, programs_per_sm=o, bt_ahead=False,
               early_idx=False)
    if heads:
        cfg.update(min_split=128, all_heads=True)
    if "bf16p" in flags:
        flags.remove("bf16p")
        cfg["partial_dtype"] = torch.bfloat16
    if "f16" in flags:
        flags.remove("f16")
        cfg["f16"] = True
    cfg.update({dict(ahead="bt_ahead", early="early_idx")[f]: True for f in flags})
    return cfg


# decode configs by name (decode_cfg): +ahead = block-table entries one tile ahead, +early =
# that and cu, ctx, the first entries before the PDL wait (the kernel's default since run 69);
# heads_ = every KV head in one program (all_heads; sm_90 compile: 137 / 136 / 154 registers,
# 96 / 80 / 128 KiB of shared memory), splits of >= 128 tokens. Any other name of that form
# also works with --decode-cfgs.
DECODE_CFGS = {n: decode_cfg(n) for n in (
    "n64_w4_s3_o2+early", "n64_w4_s7_o2", "n64_w4_s5_o2", "n32_w4_s8_o3", "n128_w8_s5_o1",
    "n64_w4_s3_o2", "n64_w4_s5_o2+ahead", "n64_w4_s5_o2+early", "n64_w4_s3_o2+ahead",
    "n64_w4_s4_o2+early", "n32_w4_s8_o3+early", "heads_n32_w8_s4_o2", "heads_n16_w8_s6_o2",
    "heads_n32_w8_s5_o1")}

# = the engine's defaults (prefill: volundr.kernels.attention.prefill.IMPL / CONFIGS)
DEFAULT_DECODE, DEFAULT_PREFILL = "n64_w4_s3_o2+early", "desc_m128_n128_w8_s3"


def _decode_calls(q, kc, vc, bts, cu, ctx, L, kw, fence=None):
    """R calls; fence: a tiny tensor zeroed between calls, a kernel launched without PDL, so
    that no call overlaps the one before (the single-call latency)."""
    out = []
    for bt in bts:
        if fence is not None:
            fence.zero_()
        out.append(paged_decode_attention(q, kc, vc, bt, cu, ctx, SCALE, L, **kw))
    return out


def bench_decode(cfgs, contexts, batches, fenced=False, kv_dtypes=("bf16",)):
    """kv_dtypes: the caches' ("bf16", "fp8": e4m3, half the bytes), each timed in turn."""
    rows = []
    for B, L, kvd in ((B, L, k) for B in batches for L in contexts for k in kv_dtypes):
        kdt = {"bf16": DT, "fp8": FP8}[kvd]
        kv_bytes = B * L * KVH * D * 2 * kdt.itemsize
        R = max(1, min(64, math.ceil((512 << 20) / kv_bytes)))
        q, kc, vc, bts, cu, ctx = decode_inputs(B, L, R, kdt)
        if B * L <= 16 * 4096:  # every config == naive on the bench inputs
            ref = naive_paged_attention(q, kc, vc, bts[0], cu, ctx, SCALE).float()
        runs = [(name, kw, None) for name, kw in cfgs.items()]
        if fenced:  # the same configs, each call fenced off from the one before
            fence = torch.zeros(1, device="cuda")
            runs += [(name + "|fenced", kw, fence) for name, kw in cfgs.items()]
        for name, kw, fence in runs:
            run = functools.partial(_decode_calls, q, kc, vc, bts, cu, ctx, L, kw, fence)
            try:  # (a config may not fit, e.g. 128-row bf16 tiles' shared memory: go on)
                if B * L <= 16 * 4096:
                    out = run()[0].float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    assert err < 1.5e-2, (name, kvd, B, L, err)
                ms = graph_ms(run) / R
            except Exception as e:  # noqa: BLE001 (recorded, never timed)
                rows.append(dict(batch=B, context=L, cfg=name, kv=kvd,
                                 failed=f"{type(e).__name__}: {str(e)[:300]}"))
                print(f"decode B={B:3d} L={L:7d} {kvd:4s} {name:15s} FAILED {rows[-1]['failed']}")
                continue
            rows.append(dict(batch=B, context=L, cfg=name, kv=kvd, us=ms * 1e3,
                             bytes=kv_bytes, bytes_per_s=kv_bytes / (ms * 1e-3)))
            print(f"decode B={B:3d} L={L:7d} {kvd:4s} {name:15s} {ms * 1e3:9.1f} us "
                  f"{rows[-1]['bytes_per_s'] / 1e12:6.2f} TB/s", flush=True)
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
    for B, cfg, kv in sorted({(r["batch"], r["cfg"], r.get("kv", "bf16"))
                              for r in res["decode"]}):
        tb = {r["context"]: r["bytes_per_s"] / 1e12 for r in res["decode"]
              if (r["batch"], r["cfg"], r.get("kv", "bf16")) == (B, cfg, kv)}
        xs = sorted(tb)
        a1.plot(xs, [tb[x] for x in xs], "o-", label=f"batch {B}, {cfg}, {kv} KV")
    a1.axhline(bw, color="k", ls="--", label=f"D2D copy {bw:.2f} TB/s")
    a1.axhline(0.8 * bw, color="gray", ls=":", label="80% of copy")
    a1.set_xscale("log", base=2)
    a1.set(xlabel="context (tokens)", ylabel="K+V TB/s (the cache's bytes)",
           title="Decode attention")
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
    ap.add_argument("--decode-only", action="store_true", help="decode only (no norms, prefill)")
    ap.add_argument("--decode-cfgs", default="", help="comma-separated config names (decode_cfg)")
    ap.add_argument("--kv-dtypes", default="bf16",
                    help="decode: the caches' dtypes, comma-separated (bf16, fp8)")
    ap.add_argument("--fenced", action="store_true",
                    help="decode: also each config with a non-PDL kernel between calls")
    ap.add_argument("--prefix", type=int, default=0,
                    help="also time prefill of 512 / 2048 new tokens after this many cached "
                         "ones (a resumed session), e.g. 30720")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # SDPA's "kernel not used" notes
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    dcfg = DECODE_CFGS if a.sweep else {DEFAULT_DECODE: DECODE_CFGS[DEFAULT_DECODE]}
    if a.decode_cfgs:
        dcfg = {n: decode_cfg(n) for n in a.decode_cfgs.split(",")}
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
        if not a.decode_only:
            res["norm"] = bench_norm(bw)
        rows = bench_decode(dcfg, [4096, 32768, 131072, 262144], [1, 16], a.fenced,
                            a.kv_dtypes.split(","))
        res["decode"] = [r for r in rows if "failed" not in r]
        res["decode_failed"] = [r for r in rows if "failed" in r]
    res["prefill"] = [] if a.decode_only else bench_prefill(pcfg, [4096, 16384, 32768])
    if a.prefix:
        res["prefill_prefix"] = bench_prefill_prefix(pcfg, a.prefix, [512, 2048])
    with open(os.path.join(a.out, "attention_bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, "attention_bench.png"))
    print("\nsummary (default cfgs): decode fraction of copy bandwidth")
    for r in res.get("decode", []):
        print(f"  B={r['batch']:2d} L={r['context']:6d} {r.get('kv', 'bf16'):4s} {r['cfg']:15s} "
              f"{r['bytes_per_s'] / bw:.2f}")
    if a.sweep:
        print("best config per shape:")
        for key in sorted({(r["batch"], r["context"], r.get("kv", "bf16"))
                           for r in res.get("decode", [])}):
            rs = [r for r in res["decode"]
                  if (r["batch"], r["context"], r.get("kv", "bf16")) == key]
            b = max(rs, key=lambda r: r["bytes_per_s"])
            print(f"  decode B={key[0]} L={key[1]} {key[2]}: {b['cfg']} "
                  f"{b['bytes_per_s'] / bw:.2f}")
    failed = [r for r in res["prefill"] + res.get("prefill_prefix", []) if "failed" in r]
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
