"""Benchmark (#5): the integer tensor-core GEMV (volundr.kernels.quant.gemv_i8) against gemv_tc.

At the engine's batch-1 shapes and 2, 3 and 4 bits: gemv_tc with the engine's config (and
without early weights), and gemv_i8 configs, each checked against the naive reference first,
then timed in CUDA graphs over rotating weight copies (bench_quant's time_graph). An i8
config is `reps,waves,maxnreg,early,digits[,splits]` (maxnreg 0: uncapped; digits 0: x's digits
made once outside the timed call, as a producer would, 1: the digits launch before every GEMV;
splits: the split-K count instead of the one `waves` gives).

    python3 perf/kernels/diag_gemv_i8.py --out $OUT/gemv_i8.json

Sessions 19-20 (perf/RESULTS.md) measured this kernel's development variants from this file
(commit be389c4): shifts instead of masks, N at run time, and the digits made inside the GEMV
(1.3-4x slower); the library kept the best of them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import triton

from volundr.kernels import pdl

SHAPES = [(5120, 5120), (15680, 5120), (17408, 5120), (34816, 5120), (5120, 17408)]


def bench_case(n: int, k: int, bits: int, cfgs: list, data: dict) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_quant import STREAM_BYTES, layer_bytes, random_layer

    from volundr.kernels.quant import gemv_i8 as gi
    from volundr.kernels.quant.engine import GEMV_TC_CONFIG
    from volundr.kernels.quant.gemv_tc import gemv_tc
    from volundr.kernels.quant.naive import naive_quant_matmul

    nbytes = layer_bytes(random_layer(n, k, bits))
    copies = max(2, min(64, math.ceil(STREAM_BYTES / nbytes)))
    layers = [random_layer(n, k, bits, seed=c) for c in range(copies)]
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    ref = naive_quant_matmul(x.float(), *layers[0], bits, 128, k)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    digits = gi.x_digits(x, bits)

    def tc_fn(early: int):
        return lambda c: gemv_tc(x, *layers[c], bits, 128, out=y, early=early,
                                 **GEMV_TC_CONFIG[bits])

    def i8_fn(reps: int, waves: int, cap: int, early: int, launch: int, splits: int = 0):
        return lambda c: gi.gemv_i8(x, *layers[c], bits, 128, out=y,
                                    digits=None if launch else digits, reps=reps,
                                    waves=float(waves), maxnreg=cap or None, early=bool(early),
                                    splits=splits or None)

    variants = [("tc engine", tc_fn(pdl.EARLY_WEIGHTS.get(bits, 0))), ("tc early 0", tc_fn(0))]
    for cfg in cfgs:
        r, w, cap, early, launch = cfg[:5]
        sp = f" s{cfg[5]}" if len(cfg) > 5 and cfg[5] else ""
        name = f"i8 r{r} w{w}{sp} cap{cap}{' early' * early}{' +digits' * launch}"
        if (n // 32) % r:
            continue
        variants.append((name, i8_fn(*cfg)))
    for name, fn in variants:
        measure({"n": n, "k": k, "bits": bits, "variant": name, "bytes": nbytes}, fn, ref,
                copies, data, f"{n:6d}x{k:<6d} {bits}b {name:30s}", out=y)


def measure(rec: dict, fn, ref: torch.Tensor, copies: int, data: dict, label: str,
            out: torch.Tensor | None = None) -> None:
    """Checks fn(0)'s output (out, filled with NaN first, where fn writes into it) against
    ref, then times fn over the weight copies in a CUDA graph (bench_quant.time_graph); rec
    (with "bytes") gets rel_err, us and frac_copy, or the error, and goes into data["rows"];
    one line printed."""
    from bench_quant import time_graph

    try:
        if out is not None:
            out.fill_(float("nan"))
        y = fn(0)
        torch.cuda.synchronize()
        rec["rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
        if rec["rel_err"] < 1e-2:  # NaN too: never time a wrong kernel
            rec["us"] = time_graph(fn, copies, rep=40)
            rec["frac_copy"] = rec["bytes"] / (rec["us"] * 1e-6) / 1e9 / data["copy_gbs"]
        else:
            rec["error"] = f"wrong result: rel_err {rec['rel_err']:.3g}"
    except Exception as e:  # record, go on
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    data["rows"].append(rec)
    res = (f"{rec['us']:8.2f} us {100 * rec['frac_copy']:5.1f}%" if "us" in rec
           else rec["error"])
    print(f"{label} err {rec.get('rel_err', -1):.1e} {res}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gemv_i8.json")
    ap.add_argument("--configs", default="2,16,168,1,0;2,24,168,1,0;2,16,168,1,1;2,24,168,1,1",
                    help="reps,waves,maxnreg (0: uncapped),early (0/1),digits launch (0/1) of "
                         "gemv_i8, ';'-separated")
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--shapes", default=",".join(f"{n}:{k}" for n, k in SHAPES))
    args = ap.parse_args(argv)
    cfgs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    assert all(len(c) in (5, 6) for c in cfgs), "reps,waves,maxnreg,early,digits[,splits]"
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_quant import copy_bandwidth

    t0 = time.time()
    data = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__, "copy_gbs": copy_bandwidth(), "rows": []}
    for n, k in shapes:
        for bits in (int(b) for b in args.bits.split(",")):
            bench_case(n, k, bits, cfgs, data)
            data["seconds"] = time.time() - t0
            with open(args.out, "w") as f:  # after every case: a time limit keeps what ran
                json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
