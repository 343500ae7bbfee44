"""Dependent batch-1 GEMVs as separate launches vs one persistent launch (gemv_chain.py), at
Volundr-32B shapes, on the GPU.

    python perf/kernels/bench_chain.py --out $OUT/chain.json [--bits 2,3,4] [--programs 12,16]
    TRITON_INTERPRET=1 python perf/kernels/bench_chain.py --smoke --out /tmp/chain.json

Per bit width, two chains, each with the engine's GEMV configs (kernels/quant/engine.py):
  mlp:  gate_up 34816x5120 (x = h w, the norm's scale from the sums of squares) -> down
        5120x17408 (SwiGLU in its x loads, the residual add and the next norm in its epilogue):
        engine.quant_mlp_chain against quant_matmul_rscaled + quant_matmul_residual_norm;
  tail: o_proj 5120x5120 (4-bit, residual epilogue) -> the same MLP: a KDA layer's last three
        GEMVs (o_proj's per-head scale left out).
Variants: "launches" (one gemv_tc launch per GEMV, PDL between them as in the engine), "chain"
(P = as many programs as fit at once, one block of weight words per set loaded before each
barrier wait), "chain+pf1" / "chain+pfall" (also each item's first set / all its sets of
weights into L2 before the wait), "chain early=2" / "early=0" (two blocks / none before the
wait), "chain nocoop" (a plain launch, P still sized to fit) and "chain P=N/SM" for each
--programs entry. Every variant's first call is checked against the launches' output
(relative error < 1e-2: the chain splits K into other parts, so its sums run in another
order) before it is timed.
Weights rotate over copies (> 4x L2) so that every call streams from HBM; C calls are one
CUDA graph timed with triton's do_bench (median). Reports us per chain, GB/s of weight bytes
and the fraction of a large D2D copy measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

from volundr.kernels.quant import engine
from volundr.kernels.quant.gemv import _num_sms
from volundr.kernels.quant.gemv_chain import gemv_chain
from volundr.kernels.quant.gemv_tc import tiles

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant import copy_bandwidth, cpu_time, layer_bytes, random_layer, time_graph  # noqa: E402

D, F = 5120, 17408  # Volundr-32B hidden and intermediate sizes
STREAM_BYTES = 1 << 29


def _mlp_args(layers, bits_up, bits_down, d, c, io):
    """The stages of chain copy c as gemv_chain dicts (engine configs), writing into io[c]."""
    (up, down) = layers[c][-2:]
    xw, ss, res, nw, gate_up, h, xw2, ss2 = io[c][-8:]
    cfg_u = engine.tc_config(bits_up, up[0].shape[1], d)
    cfg_d = engine.tc_config(bits_down, d, up[0].shape[1] // 2)
    return (dict(x=xw, qa=up[0], qb=up[1], sz=up[2], bits=bits_up, group_size=128, out=gate_up,
                 rscale=(ss, 1e-6), **cfg_u),
            dict(x=gate_up, qa=down[0], qb=down[1], sz=down[2], bits=bits_down, group_size=128,
                 out=h, swiglu=True, residual=(res, nw, xw2, ss2), **cfg_d))


def bench(bits: int, kind: str, d: int, f: int, copies: int, smoke: bool, programs: list,
          copy_gbs: float) -> list[dict]:
    from volundr.kernels.quant.gemv_tc import gemv_tc

    dev = "cpu" if smoke else "cuda"
    bf = torch.bfloat16
    rows = []
    layers, io = [], []
    for c in range(copies):
        up = random_layer(2 * f, d, bits, seed=3 * c, device=dev)
        down = random_layer(d, f, bits, seed=3 * c + 1, device=dev)
        o = random_layer(d, d, 4, seed=3 * c + 2, device=dev) if kind == "tail" else None
        layers.append((o, up, down) if o else (up, down))
        cfg_d = engine.tc_config(bits, d, f)
        n_ss = tiles(d, cfg_d["reps"], cfg_d["num_warps"])
        t = [torch.randn(1, d, device=dev).to(bf) / 4, torch.rand(n_ss, device=dev) * d,
             torch.randn(1, d, device=dev).to(bf), torch.randn(d, device=dev).to(bf),
             torch.empty(1, 2 * f, device=dev, dtype=bf), torch.empty(1, d, device=dev, dtype=bf),
             torch.empty(1, d, device=dev, dtype=bf),
             torch.empty(n_ss, device=dev, dtype=torch.float32)]
        if kind == "tail":  # o_proj: x -> h0 (residual epilogue), then h0 w0 into the MLP
            xo, r0, nw0 = (torch.randn(1, d, device=dev).to(bf) for _ in range(3))
            t = [xo, r0, nw0, *t]
            # the MLP's xw, ss and residual are o_proj's outputs: xw0, ss0, h0
            t[3], t[4], t[5] = (torch.empty(1, d, device=dev, dtype=bf),
                                torch.empty(tiles(d, engine.tc_config(4, d, d)["reps"]),
                                            device=dev, dtype=torch.float32),
                                torch.empty(1, d, device=dev, dtype=bf))
        io.append(t)

    def stages(c):
        mlp = _mlp_args(layers, bits, bits, d, c, io)
        if kind != "tail":
            return list(mlp)
        xo, r0, nw0, xw0, ss0, h0 = io[c][:6]
        o = layers[c][0]
        first = dict(x=xo, qa=o[0], qb=o[1], sz=o[2], bits=4, group_size=128, out=h0,
                     residual=(r0, nw0, xw0, ss0), **engine.tc_config(4, d, d))
        return [first, *mlp]

    def launches(c):
        for s in stages(c):
            s = dict(s)
            gemv_tc(s.pop("x"), s.pop("qa"), s.pop("qb"), s.pop("sz"), s.pop("bits"),
                    s.pop("group_size"), **s)

    def chain(c, **kw):  # (gemv_chain sets the waves and the one register cap)
        gemv_chain(stages(c), **kw)

    nbytes = sum(layer_bytes(lay) for lay in layers[0] if lay is not None)
    out = io[0][-3]  # the last stage's h
    launches(0)
    if not smoke:
        torch.cuda.synchronize()
    ref = out.clone()
    sms = _num_sms(out.device)
    variants = [("launches", launches), ("chain", chain),
                ("chain+pf1", lambda c: chain(c, prefetch=1)),
                ("chain+pfall", lambda c: chain(c, prefetch=-1)),
                ("chain early=2", lambda c: chain(c, early=2)),
                ("chain early=0", lambda c: chain(c, early=0)),
                ("chain nocoop", lambda c: chain(c, cooperative=False))]
    variants += [(f"chain P={p}/SM", lambda c, p=p: chain(c, programs=p * sms))
                 for p in programs]
    for name, fn in variants:
        rec = dict(bits=bits, chain=kind, variant=name, bytes=nbytes, copies=copies)
        try:
            out.fill_(float("nan"))
            fn(0)
            if not smoke:
                torch.cuda.synchronize()
            # (the chain splits K differently from the launches: same sums, another order)
            rec["rel_err"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not rec["rel_err"] < 1e-2:  # NaN too: never time a wrong kernel
                rec["error"] = f"differs from the launches: rel_err {rec['rel_err']:.3g}"
            else:
                rec["us"] = cpu_time(fn) if smoke else time_graph(fn, copies)
                rec["gbs"] = nbytes / (rec["us"] * 1e-6) / 1e9
                rec["frac_copy"] = rec["gbs"] / copy_gbs
        except Exception as e:  # record, go on
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--chains", default="mlp,tail")
    ap.add_argument("--programs", default="", help="extra P per SM to time, e.g. 8,12")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    args = ap.parse_args(argv)
    t0 = time.time()
    d, f = (256, 256) if args.smoke else (D, F)
    copy_gbs = float("nan") if args.smoke else copy_bandwidth()
    data = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(0),
            "torch": torch.__version__, "triton": triton.__version__, "copy_gbs": copy_gbs,
            "rows": []}
    programs = [int(p) for p in args.programs.split(",") if p]
    for kind in args.chains.split(","):
        for bits in (int(b) for b in args.bits.split(",")):
            per_copy = (2 * f * d + f * d + (d * d if kind == "tail" else 0)) * bits // 8
            copies = 1 if args.smoke else max(2, -(-STREAM_BYTES // per_copy))
            data["rows"] += bench(bits, kind, d, f, copies, args.smoke, programs, copy_gbs)
    data["seconds"] = time.time() - t0
    path = args.out if args.out.endswith(".json") else os.path.join(args.out, "chain.json")
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1)
    bad = [r for r in data["rows"] if "error" in r]
    print(f"done in {data['seconds']:.0f} s, {len(bad)} variant(s) failed -> {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
