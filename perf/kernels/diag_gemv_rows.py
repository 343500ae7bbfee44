"""gemv_i8_rows (1-16 rows of x on the integer tensor cores) against the engine's path for those
rows (gemm_tc) and the one-row gemv_i8, at Volundr-32B shapes; us per call in CUDA-graph replays
over copies of the weights (no L2 reuse), each output checked against the naive reference first.
--configs: gemv_i8_rows's (reps, waves, unroll[, prefetch 0/1]) to try, "r:w:u[:p]" separated
by ";".

    python3 perf/kernels/diag_gemv_rows.py --out $OUT/gemv_rows.json --rows 1,4,5,8,16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import triton

SHAPES = [(17408, 5120, 4), (17408, 5120, 2), (5120, 17408, 3), (34816, 5120, 3)]


CONFIGS = "2:16:1;2:16:2;1:16:2;2:8:2"


def bench_case(n: int, k: int, bits: int, rows: list[int], configs: list, data: dict) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_quant import STREAM_BYTES, layer_bytes, random_layer
    from diag_gemv_i8 import measure

    from volundr.kernels.quant import engine as qe
    from volundr.kernels.quant import gemv_i8 as gi
    from volundr.kernels.quant import gemv_i8_rows as gr
    from volundr.kernels.quant.naive import naive_quant_matmul

    nbytes = layer_bytes(random_layer(n, k, bits))
    copies = max(2, min(64, math.ceil(STREAM_BYTES / nbytes)))
    layers = [random_layer(n, k, bits, seed=c) for c in range(copies)]
    for m in rows:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = naive_quant_matmul(x.float(), *layers[0], bits, 128, k)
        variants = []
        if m == 1:
            variants.append(("gemv_i8 (engine)", lambda c, x=x: gi.gemv_i8(
                x, *layers[c], bits, 128, **gi.config(bits, n, k))))
        else:
            variants.append(("gemm_tc (engine)", lambda c, x=x: qe.gemm_tc.gemm_tc(
                x, *layers[c], bits, 128, **qe.GEMM16_TC_CONFIG[bits])))
        for reps, waves, unroll, pf in configs:
            if (k // 128) % unroll or n % (32 * reps):
                continue
            kw = dict(reps=reps, waves=waves, unroll=unroll, prefetch=bool(pf))
            variants.append((f"rows r{reps} w{waves:g} u{unroll}{' pf' if pf else ''}",
                             lambda c, x=x, kw=kw: gr.gemv_i8_rows(x, *layers[c], bits, 128,
                                                                    **kw)))
        for name, fn in variants:
            measure({"n": n, "k": k, "bits": bits, "rows": m, "variant": name, "bytes": nbytes},
                    fn, ref, copies, data, f"{n:6d}x{k:<6d} {bits}b M={m} {name:22s}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gemv_rows.json")
    ap.add_argument("--rows", default="1,4,5,8,16")
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--shapes", default=";".join(f"{n}:{k}:{b}" for n, k, b in SHAPES))
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(";")]
    configs = [(int(v[0]), float(v[1]), int(v[2]), int(v[3]) if len(v) > 3 else 0)
               for v in (c.split(":") for c in args.configs.split(";"))]
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_quant import copy_bandwidth

    t0 = time.time()
    data = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__, "copy_gbs": copy_bandwidth(), "rows": []}
    for n, k, bits in shapes:
        bench_case(n, k, bits, rows, configs, data)
        data["seconds"] = time.time() - t0
        with open(args.out, "w") as f:  # after every case: a time limit keeps what ran
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
