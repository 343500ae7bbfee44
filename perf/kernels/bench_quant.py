"""Mixed-bit GEMV/GEMM on the GPU: bandwidth at Volundr-32B shapes vs the HBM copy and cuBLAS.

    python perf/kernels/bench_quant.py --out $OUT        (H200: about 3 minutes)
    python perf/kernels/bench_quant.py --m1-compare --out $OUT/gemv_compare.json
        M = 1 only: the FMA GEMV (gemv.py, engine config) vs the tensor-core GEMV (gemv_tc.py,
        a few configs) at the 4 shapes x 2/3/4 bits; each variant checked against the naive
        reference before it is timed (a wrong one is reported, never timed). CPU dry run of
        the same script at tiny shapes: TRITON_INTERPRET=1 ... --m1-compare --smoke
    python perf/kernels/bench_quant.py --m16-compare --out $OUT/gemm16.json
        M = 2, 4, 8, 16: the engine's batch path (tl.dot tiles of 16 rows, BATCH_CONFIG) vs
        the tensor-core GEMM with x^T as the mma B operand (gemm_tc.py, a few configs), same
        checks, shapes and JSON style (H200: well under 90 s); CPU dry run:
        TRITON_INTERPRET=1 ... --m16-compare --smoke

Per (shape, bits, M) it times every kernel config of a small sweep, checks each config's
output against the naive fp32 reference, and reports the best: time, bytes moved (packed
weights + scales/zeros; x and y are negligible) and GB/s against a large device-to-device
copy and bf16 cuBLAS (F.linear) at the same shape, all measured in this run. Weights rotate
over enough copies (> 4x L2) that every call streams from HBM, and C calls are captured in one
CUDA graph (launch gaps as in the engine's decode graph) timed with triton's do_bench
(median, L2 flushed before each replay). Writes bench_quant.json (+ .png with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

from volundr.kernels.quant.gemm import dequant_matmul
from volundr.kernels.quant.gemm_tc import gemm_tc
from volundr.kernels.quant.gemv import quant_matmul_triton
from volundr.kernels.quant.gemv_tc import gemv_tc
from volundr.kernels.quant.naive import dequantize_kernel_layout, naive_quant_matmul

SHAPES = [(5120, 5120), (17408, 5120), (5120, 17408), (262144, 5120)]  # (out N, in K)
# (bn, num_warps, waves, prefetch, num_stages); M = 1 rows per thread = bn / (128 num_warps)
GEMV_CFGS = [(128, 1, 8.0, True, None), (256, 1, 4.0, True, None), (256, 1, 8.0, True, None),
             (256, 2, 4.0, True, None), (512, 2, 4.0, True, None), (128, 1, 8.0, False, None)]
BATCH_CFGS = [(128, 4, 2.0, True, None), (128, 4, 4.0, True, 1), (64, 2, 4.0, False, 2)]
PREFILL_MS = [64, 256, 1024]
STREAM_BYTES = 1 << 29  # rotate weight copies until this many bytes: > 8x the H200's L2


def random_layer(n, k, bits, g=128, seed=0, device="cuda"):
    """Random packed planes and plausible bf16 scales/zeros (timing does not depend on values)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pa = 4 if bits == 4 else 2
    qa = torch.randint(-2**31, 2**31 - 1, (k * pa // 32, n), generator=gen, device=device,
                       dtype=torch.int32)
    qb = torch.randint(-2**31, 2**31 - 1, (k // 32 if bits == 3 else 0, n), generator=gen,
                       device=device, dtype=torch.int32)
    s = (torch.rand(n, k // g, generator=gen, device=device) * 0.02 + 0.005).to(torch.bfloat16)
    z = (torch.rand(n, k // g, generator=gen, device=device) * (2**bits - 1)).to(torch.bfloat16)
    from volundr.kernels.quant.pack import pack_scale_zero

    return qa, qb, pack_scale_zero(s, z)


def layer_bytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in layer)


def time_graph(fn, copies: int, rep: int = 80) -> float:
    """Microseconds per call of fn(c) for c in 0..copies-1, captured as one CUDA graph."""
    for c in range(copies):
        fn(c)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in range(copies):
            fn(c)
    ms = triton.testing.do_bench(g.replay, warmup=10, rep=rep, return_mode="median")
    return ms * 1e3 / copies


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, read + write
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=20, rep=200, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3) / 1e9


def bench_shape(n, k, bits, ms, copy_gbs, results, quick=False):
    nbytes = layer_bytes(random_layer(n, k, bits))
    copies = max(2, min(64, math.ceil(STREAM_BYTES / nbytes)))
    layers = [random_layer(n, k, bits, seed=c) for c in range(copies)]
    qa, qb, sz = layers[0]
    wbf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
           for _ in range(max(2, min(64, math.ceil(STREAM_BYTES / (2 * n * k)))))]
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, 128, k)
        t_bf16 = time_graph(lambda c, x=x: F.linear(x, wbf[c % len(wbf)]), len(wbf))
        cfgs = GEMV_CFGS if m == 1 else BATCH_CFGS
        block_m = 1 if m == 1 else 16
        best = None
        for bn, nw, waves, pf, st in (cfgs[:2] if quick else cfgs):
            rec = {"n": n, "k": k, "bits": bits, "m": m, "bn": bn, "num_warps": nw,
                   "waves": waves, "prefetch": pf, "num_stages": st, "bytes": nbytes,
                   "copies": copies}
            try:
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

                def fn(c, bn=bn, nw=nw, waves=waves, out=out, x=x, block_m=block_m, pf=pf,
                       st=st):
                    a, b, s = layers[c]
                    quant_matmul_triton(x, a, b, s, bits, 128, out=out, block_m=block_m, bn=bn,
                                        num_warps=nw, waves=waves, prefetch=pf, num_stages=st)
                out.fill_(float("nan"))
                fn(0)
                rec["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                rec["us"] = time_graph(fn, copies)
                rec["gbs"] = nbytes / (rec["us"] * 1e-6) / 1e9
                rec["frac_copy"] = rec["gbs"] / copy_gbs
                rec["bf16_us"] = t_bf16
                rec["bf16_gbs"] = 2 * n * k / (t_bf16 * 1e-6) / 1e9
            except Exception as e:  # a config that does not compile or fit: record, go on
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            results.append(rec)
            ok = "us" in rec and rec["rel_err"] < 1e-2
            if ok and (best is None or rec["us"] < best["us"]):
                best = rec
        if best is not None:
            print(f"{n:6d}x{k:<6d} {bits}b M={m:<3d} best bn={best['bn']:3d} nw={best['num_warps']}"
                  f" w={best['waves']:.0f} pf={best['prefetch']:d} st={best['num_stages']}: "
                  f"{best['us']:8.2f} us {best['gbs']:7.0f} GB/s "
                  f"({100 * best['frac_copy']:5.1f}% copy)  bf16 {t_bf16:8.2f} us "
                  f"err {best['rel_err']:.1e}", flush=True)


def bench_engine(n, k, bits, ms, results):
    """The engine's own choice (kernels/quant/engine.py) per M, for the summary table."""
    from volundr.kernels.quant.engine import quant_matmul

    layer = random_layer(n, k, bits)
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = naive_quant_matmul(x.float(), *layer, bits, 128, k)
        err = ((quant_matmul(x, *layer, bits, 128).float() - ref).norm() / ref.norm()).item()
        us = triton.testing.do_bench(lambda x=x: quant_matmul(x, *layer, bits, 128), warmup=10,
                                     rep=50, return_mode="median") * 1e3
        results.append({"n": n, "k": k, "bits": bits, "m": m, "us": us, "rel_err": err})
        print(f"engine {n}x{k} {bits}b M={m:<5d} {us:9.1f} us err {err:.1e}", flush=True)


def bench_prefill(n, k, bits, results):
    layer = random_layer(n, k, bits)
    wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    for m in PREFILL_MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = naive_quant_matmul(x.float(), *layer, bits, 128, k)
        rec = {"n": n, "k": k, "bits": bits, "m": m, "prefill": True}
        fns = {
            "fused64": lambda x=x: quant_matmul_triton(x, *layer, bits, 128, block_m=64, bn=128,
                                                       num_warps=4, waves=1.0),
            "dequant_cublas": lambda x=x: dequant_matmul(x, *layer, bits, 128),
            "bf16_cublas": lambda x=x: F.linear(x, wbf),
        }
        for name, fn in fns.items():
            try:
                y = fn()
                if name != "bf16_cublas":
                    rec[name + "_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                rec[name + "_us"] = triton.testing.do_bench(fn, warmup=10, rep=50,
                                                            return_mode="median") * 1e3
                rec[name + "_tflops"] = 2 * m * n * k / (rec[name + "_us"] * 1e-6) / 1e12
            except Exception as e:
                rec[name + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        results.append(rec)
        print(f"prefill {n}x{k} {bits}b M={m:<5d} " + "  ".join(
            f"{nm} {rec.get(nm + '_us', float('nan')):8.1f} us" for nm in fns), flush=True)


def plot(data: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: skipping the plot")
        return
    best = {}
    for r in data["gemv"]:
        if "us" in r and r["rel_err"] < 1e-2 and r["m"] == 1:
            key = (r["n"], r["k"], r["bits"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{n}x{k}" for n, k in SHAPES]
    for j, bits in enumerate((2, 3, 4)):
        vals = [best.get((n, k, bits), {}).get("gbs", 0) for n, k in SHAPES]
        ax.bar([i + 0.2 * j for i in range(len(SHAPES))], vals, 0.2, label=f"{bits}-bit")
    bf = [next((r["bf16_gbs"] for r in data["gemv"] if r.get("bf16_gbs") and r["m"] == 1
                and (r["n"], r["k"]) == s), 0) for s in SHAPES]
    ax.bar([i + 0.6 for i in range(len(SHAPES))], bf, 0.2, label="bf16 cuBLAS")
    ax.axhline(data["copy_gbs"], color="k", ls="--", label="HBM copy")
    ax.axhline(0.8 * data["copy_gbs"], color="gray", ls=":", label="80% of copy")
    ax.set_xticks([i + 0.3 for i in range(len(SHAPES))], labels)
    ax.set_ylabel("GB/s (packed weights + scales/zeros)")
    ax.set_title(f"Mixed-bit GEMV, batch 1, {data['device']}")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --m1-compare: the engine's FMA config per bit width vs tensor-core configs. engine=True starts
# from the engine's GEMV_TC_CONFIG for the bit width (reps 2 = 64 rows per 1-warp program,
# waves 24 = one set of 4 groups per program at K = 5120; 128-register cap at 2 and 4 bits;
# early weights per pdl.EARLY_WEIGHTS) and sets the keys given (maxnreg=None: no cap). Runs
# 14-20 measured early 0-4 blocks, the next set's early blocks loaded before each set's work,
# 2 or 4 accumulator chains per set, stages 2, waves 8-48: none beat the engine's config.
TC_CFGS = [dict(engine=True),
           dict(engine=True, maxnreg=None),
           dict(engine=True, early=0),
           dict(engine=True, reps=1, waves=48.0)]
SMOKE_SHAPES = [(256, 512), (96, 640)]
# the engine's own fused shapes too: KDA's six projections of x (padded), the MLP's gate_up;
# and Engram's k / v projections (K = 2048: on the tensor cores since TC_MIN_DIM 2048, run 23)
M1_SHAPES = SHAPES + [(15680, 5120), (34816, 5120), (5120, 2048)]


def parse_cfgs(text: str) -> list[dict]:
    """"reps,warps,waves[,maxnreg[,stages[,early]]];..." -> [dict(reps=, num_warps=, ...)]
    (--tc-configs; M = 1 only: maxnreg = gemv_tc's register cap (empty: none), stages = its
    software-pipelined set loop, weights through shared memory; early = k: the first k blocks
    of weights of each set loaded before the PDL wait). A part "e:key=value,..." is the
    engine's config for each bit width with those keys set (e.g. "e:tma=1,stages=3,waves=8";
    maxnreg= empty: no cap)."""
    out = []
    for part in filter(None, text.split(";")):
        if part.startswith("e:"):
            cfg = {"engine": True}
            for kv in filter(None, part[2:].split(",")):
                key, val = kv.split("=")
                cfg[key] = None if val == "" else float(val) if "." in val else int(val)
            if "tma" in cfg:
                cfg["tma"] = bool(cfg["tma"])
            out.append(cfg)
            continue
        f = part.split(",")
        cfg = dict(reps=int(f[0]), num_warps=int(f[1]), waves=float(f[2]))
        if len(f) > 3 and f[3]:
            cfg["maxnreg"] = int(f[3])
        if len(f) > 4 and f[4]:
            cfg["stages"] = int(f[4])
        if len(f) > 5:
            cfg["early"] = int(f[5])
        out.append(cfg)
    return out


def cpu_time(fn) -> float:
    """--smoke stand-in for time_graph (one interpreted call; exercises the reporting code)."""
    t = time.perf_counter()
    fn(0)
    return (time.perf_counter() - t) * 1e6


def _compare_header(smoke: bool) -> dict:
    return {"device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(0),
            "torch": torch.__version__, "triton": triton.__version__,
            "copy_gbs": float("nan") if smoke else copy_bandwidth(), "rows": []}


def _check_then_time(rec: dict, fn, y: torch.Tensor, ref: torch.Tensor, smoke: bool,
                     copies: int, rep: int, copy_gbs: float) -> None:
    """One variant into rec: first call (compiles) checked against ref, then timed over the
    weight copies; a wrong result or an exception is recorded instead of a time."""
    try:
        y.fill_(float("nan"))
        t1 = time.time()
        fn(0)  # compiles on first use
        if not smoke:
            torch.cuda.synchronize()
        rec["first_call_s"] = time.time() - t1
        rec["rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
        if not rec["rel_err"] < 1e-2:  # NaN too: never time a wrong kernel
            rec["error"] = f"wrong result: rel_err {rec['rel_err']:.3g}"
        else:
            rec["us"] = cpu_time(fn) if smoke else time_graph(fn, copies, rep=rep)
            rec["gbs"] = rec["bytes"] / (rec["us"] * 1e-6) / 1e9
            rec["frac_copy"] = rec["gbs"] / copy_gbs
    except Exception as e:  # record, go on with the other variants
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"


def _save_compare(data: dict, out: str, name: str, t0: float) -> int:
    data["seconds"] = time.time() - t0
    path = out if out.endswith(".json") else os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    bad = [r for r in data["rows"] if "error" in r]
    print(f"done in {data['seconds']:.0f} s, {len(bad)} variant(s) failed -> {path}")
    return 1 if bad else 0


def _tc_kwargs(cfg: dict, bits: int) -> dict:
    """gemv_tc kwargs of a TC_CFGS entry: engine=True: the engine's config for `bits`, then
    the entry's keys; early spelt out (the engine's comes from pdl.EARLY_WEIGHTS)."""
    from volundr.kernels import pdl
    from volundr.kernels.quant.engine import GEMV_TC_CONFIG

    if not cfg.get("engine"):
        return dict(cfg)
    kw = {"early": pdl.EARLY_WEIGHTS.get(bits, 0), **GEMV_TC_CONFIG[bits],
          **{k: v for k, v in cfg.items() if k != "engine"}}
    return {k: v for k, v in kw.items() if v is not None}


def m1_compare(out: str, smoke: bool, tc_cfgs: list, shapes: list | None = None,
               fma: bool = True) -> int:
    """M = 1 only: old (FMA) vs new (tensor-core) GEMV at SHAPES x bits 2/3/4, one JSON. Each
    variant is checked against the naive reference first; a wrong one is recorded, not timed.
    smoke: tiny shapes, no timing (CPU interpreter dry run of this code path)."""
    from volundr.kernels.quant.engine import GEMV_CONFIG

    dev = "cpu" if smoke else "cuda"
    t0 = time.time()
    data = _compare_header(smoke)
    rows = data["rows"]
    for n, k in (SMOKE_SHAPES if smoke else shapes or M1_SHAPES):
        for bits in (2, 3, 4):
            nbytes = layer_bytes(random_layer(n, k, bits, device=dev))
            copies = 1 if smoke else max(2, min(64, math.ceil(STREAM_BYTES / nbytes)))
            layers = [random_layer(n, k, bits, seed=c, device=dev) for c in range(copies)]
            x = torch.randn(1, k, device=dev).to(torch.bfloat16)
            ref = naive_quant_matmul(x.float(), *layers[0], bits, 128, k)
            bn, nw, waves, pf = GEMV_CONFIG[bits]
            variants = [("fma", dict(bn=bn, num_warps=nw, waves=waves, prefetch=pf))] * fma
            variants += [("tc", _tc_kwargs(c, bits)) for c in tc_cfgs]
            for name, kw in variants:
                rec = {"n": n, "k": k, "bits": bits, "variant": name, **kw, "bytes": nbytes,
                       "copies": copies}
                y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)

                def fn(c, name=name, kw=kw, y=y, x=x, layers=layers, bits=bits):
                    if name == "fma":
                        quant_matmul_triton(x, *layers[c], bits, 128, out=y, block_m=1, **kw)
                    else:
                        gemv_tc(x, *layers[c], bits, 128, out=y, **kw)
                _check_then_time(rec, fn, y, ref, smoke, copies, 40, data["copy_gbs"])
                rows.append(rec)
                cfg = " ".join(f"{a}={b}" for a, b in kw.items())
                res = (f"{rec['us']:8.2f} us {100 * rec['frac_copy']:5.1f}% copy" if "us" in rec
                       else rec.get("error", "ok (not timed)"))
                print(f"{n:6d}x{k:<6d} {bits}b {name:3s} {cfg:40s} err "
                      f"{rec.get('rel_err', float('nan')):.1e}  {res}", flush=True)
    print("summary (best tc vs fma, us):")
    for n, k in (SMOKE_SHAPES if smoke else shapes or M1_SHAPES):
        for bits in (2, 3, 4):
            sel = [r for r in rows if (r["n"], r["k"], r["bits"]) == (n, k, bits) and "us" in r]
            old = [r["us"] for r in sel if r["variant"] == "fma"]
            new = [r["us"] for r in sel if r["variant"] == "tc"]
            if old and new:
                print(f"  {n}x{k} {bits}b: fma {old[0]:.2f}  tc {min(new):.2f}  "
                      f"({old[0] / min(new):.2f}x)")
    return _save_compare(data, out, "gemv_compare.json", t0)


# --m16-compare: tensor-core GEMM configs: the engine's (BN = 64 rows per 1-warp program,
# split-K to ~8 programs per SM), and its group loop pipelined through shared memory (stages 2
# or 3; fewer splits, so that a program has groups to pipeline over)
GEMM16_CFGS = [dict(reps=2, num_warps=1, waves=8.0),
               dict(reps=2, num_warps=1, waves=8.0, stages=2),
               dict(reps=2, num_warps=1, waves=4.0, stages=2),
               dict(reps=2, num_warps=1, waves=4.0, stages=3)]
M16_MS = [2, 4, 8, 16]
M16_SMOKE_SHAPES = [(96, 256)]


def m16_compare(out: str, smoke: bool, tc_cfgs: list) -> int:
    """2 <= M <= 16: the engine's batch path (16-row tl.dot tiles) vs gemm_tc at SHAPES x bits
    2/3/4 x M16_MS, one JSON. Each variant is checked against the naive reference first; a wrong
    one is recorded, not timed. smoke: tiny shapes, no timing (CPU interpreter dry run)."""
    from volundr.kernels.quant.engine import BATCH_CONFIG, MAX_M

    dev = "cpu" if smoke else "cuda"
    t0 = time.time()
    data = _compare_header(smoke)
    rows = data["rows"]
    shapes = M16_SMOKE_SHAPES if smoke else SHAPES
    ms = [3, 16] if smoke else M16_MS
    for n, k in shapes:
        for bits in (2, 3, 4):
            nbytes = layer_bytes(random_layer(n, k, bits, device=dev))
            copies = 1 if smoke else max(2, min(64, math.ceil(STREAM_BYTES / nbytes)))
            layers = [random_layer(n, k, bits, seed=c, device=dev) for c in range(copies)]
            # the naive reference's W once per layer (fp32; 5.4 GB for lm_head), then per M
            w = dequantize_kernel_layout(*layers[0], bits, 128, k)
            for m in ms:
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                ref = x.float() @ w.t()
                variants = [("tile", dict(BATCH_CONFIG))]
                variants += [("tc", dict(c)) for c in tc_cfgs]
                for name, kw in variants:
                    rec = {"n": n, "k": k, "bits": bits, "m": m, "variant": name, **kw,
                           "bytes": nbytes, "copies": copies}
                    y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

                    def fn(c, name=name, kw=kw, y=y, x=x, layers=layers, bits=bits):
                        if name == "tile":
                            quant_matmul_triton(x, *layers[c], bits, 128, out=y, block_m=MAX_M,
                                                **kw)
                        else:
                            gemm_tc(x, *layers[c], bits, 128, out=y, **kw)
                    _check_then_time(rec, fn, y, ref, smoke, copies, 20, data["copy_gbs"])
                    rows.append(rec)
                    cfg = " ".join(f"{a}={b}" for a, b in kw.items() if a != "prefetch")
                    res = (f"{rec['us']:8.2f} us {100 * rec['frac_copy']:5.1f}% copy"
                           if "us" in rec else rec.get("error", "ok (not timed)"))
                    print(f"{n:6d}x{k:<6d} {bits}b M={m:<2d} {name:4s} {cfg:44s} err "
                          f"{rec.get('rel_err', float('nan')):.1e}  {res}", flush=True)
            del w
    print("summary (best tc vs tile, us):")
    for n, k in shapes:
        for bits in (2, 3, 4):
            line = []
            for m in ms:
                sel = [r for r in rows if (r["n"], r["k"], r["bits"], r["m"]) == (n, k, bits, m)
                       and "us" in r]
                old = [r["us"] for r in sel if r["variant"] == "tile"]
                new = [r["us"] for r in sel if r["variant"] == "tc"]
                if old and new:
                    line.append(f"M={m}: {old[0]:.1f} -> {min(new):.1f} ({old[0] / min(new):.2f}x)")
            print(f"  {n}x{k} {bits}b: " + "  ".join(line))
    return _save_compare(data, out, "gemm16_compare.json", t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."),
                    help="folder (or, with --m1-compare / --m16-compare, a .json path)")
    ap.add_argument("--m1-compare", action="store_true",
                    help="only M = 1: FMA GEMV vs tensor-core GEMV (gemv_tc.py)")
    ap.add_argument("--m16-compare", action="store_true",
                    help="only M = 2..16: tl.dot tiles vs tensor-core GEMM (gemm_tc.py)")
    ap.add_argument("--smoke", action="store_true",
                    help="with --m1-compare / --m16-compare: tiny shapes on the CPU, no timing "
                         "(run under TRITON_INTERPRET=1)")
    ap.add_argument("--quick", action="store_true",
                    help="two configs per case, no prefill (--m1/--m16-compare: one tc config)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--shapes", default="all", help="all, or indices into SHAPES, e.g. 1,3")
    ap.add_argument("--tc-configs", default="",
                    help='--m1/--m16-compare: tensor-core configs "reps,warps,waves'
                         '[,maxnreg[,stages[,early]]];..." instead of the built-in list; '
                         '"e:key=value,...": the engine\'s config with those keys')
    ap.add_argument("--m1-shapes", default="",
                    help='--m1-compare: "N:K,..." instead of M1_SHAPES')
    ap.add_argument("--no-fma", action="store_true", help="--m1-compare: no FMA-path rows")
    args = ap.parse_args(argv)
    if args.m1_compare or args.m16_compare:
        if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke runs on the CPU: set TRITON_INTERPRET=1", file=sys.stderr)
            return 1
        if not args.smoke and not torch.cuda.is_available():
            print("needs CUDA (or --smoke)", file=sys.stderr)
            return 1
        own = parse_cfgs(args.tc_configs)
        if args.m16_compare:
            return m16_compare(args.out, args.smoke,
                               own or (GEMM16_CFGS[:1] if args.quick else GEMM16_CFGS))
        shapes = [tuple(int(v) for v in sh.split(":")) for sh in filter(None,
                                                                        args.m1_shapes.split(","))]
        return m1_compare(args.out, args.smoke, own or (TC_CFGS[:1] if args.quick else TC_CFGS),
                          shapes, not args.no_fma)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    data = {"device": props.name, "sms": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__,
            "copy_gbs": copy_bandwidth(), "gemv": [], "prefill": []}
    print(f"{props.name}: device-to-device copy {data['copy_gbs']:.0f} GB/s", flush=True)
    ms = [int(v) for v in args.batches.split(",")]
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    for n, k in shapes:
        for bits in (2, 3, 4):
            bench_shape(n, k, bits, ms, data["copy_gbs"], data["gemv"], args.quick)
    if not args.quick:
        for bits in (2, 3, 4):
            bench_prefill(17408, 5120, bits, data["prefill"])
    data["engine"] = []
    for bits in (2, 3, 4):
        bench_engine(17408, 5120, bits, [1, 2, 4, 16, 64, 512], data["engine"])
    data["seconds"] = time.time() - t0
    with open(os.path.join(args.out, "bench_quant.json"), "w") as f:
        json.dump(data, f, indent=1)
    plot(data, os.path.join(args.out, "bench_quant.png"))
    print(f"done in {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
