"""KDA kernels vs flash-linear-attention on the GPU, at Volundr-32B shapes (H = 40, K = V = 128).

Prefill: `chunk_kda` (ours and fla's) on one sequence of T tokens, bf16 q/k/v, fp32 g/beta, q/k
L2 norm in the kernel, initial state in and final state out. Decode: one token for each of B
sequences through `fused_recurrent_kda` (ours and fla's), and our engine path per decode step of
one KDA layer over state pools, in the engine's form (raw projections, gate and beta logits with
the activations in the kernels): conv then KDA mixer (two kernels, "layer") and the fused
`kda_decode` (one kernel, "fused"; checked against "layer" before it is timed; layer_over_fused
is the ratio of their graph times), eager and replayed from a CUDA graph.
Medians of `triton.testing.do_bench`. Writes kda_bench.{json,csv,png} under --out.

    python perf/kernels/bench_kda.py --out "$OUT" [--prefill 4096,32768,131072] [--sweep]
    python perf/kernels/bench_kda.py --out "$OUT" --decode-only [--decode 1,16] [--fused-variants]
    python perf/kernels/bench_kda.py --out /tmp/x --decode-only --smoke  # CPU: decode path check
    python perf/kernels/bench_kda.py --out "$OUT" --rows [--smoke]   # a check's / commit's rows
    python perf/kernels/bench_kda.py --out "$OUT" --intra-compare [--intra-T 4096,32768]
        [--sub-variants] [--split-variants] [--no-fla]
    python perf/kernels/bench_kda.py --out /tmp/x --intra-compare --sub-variants --smoke  # CPU
    ncu --nvtx --nvtx-include once/ ... python perf/kernels/bench_kda.py --once ours|fla \
        --intra-T 32768      # one prefill call for the profiler (after an unprofiled warm-up)

--intra-compare: our prefill with each stage-1 implementation (chunk.CONFIG["intra"], as
VOLUNDR_KDA_INTRA: "fused", "sub", "split") and fla's, checked against each other (and against
the fp32 naive reference at the first T) before timing, plus a per-kernel profile at the last T.
--sub-variants / --split-variants also time that path's launch settings (VARIANTS, one compile
each) there.
--rows: a speculative check of n sequences x L rows (check_layout's rows, states read only) and
its commit (L - 1 rows each), one KDA layer: the two kernels (conv, recurrence: "pair") against
kda_rows (one launch) at each of ROWS_VARIANTS' launch settings, graph-replayed, the check's
outputs compared first; and the check with KDA's gated output norm: kda_rows then the norm
kernel against kda_rows writing o w sigmoid(z) and the sums of squares itself (`gated`; the
head scale then rides in o_proj's digits launch, which runs either way).
--smoke runs it at tiny shapes under TRITON_INTERPRET=1 (re-executing itself with it set) so a
script error shows up without a GPU.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

from volundr.kernels.kda import chunk as ours_chunk
from volundr.kernels.kda import decode as ours_decode
from volundr.kernels.kda import engine
from volundr.kernels.kda.fused_recurrent import fused_recurrent_kda
from volundr.kernels.kda.naive import kda_gate, naive_chunk_kda

H, K, V = 40, 128, 128
dev = "cuda"
SMOKE = False  # --smoke: tiny shapes under the CPU interpreter
FUSED_VARIANTS_ON = False  # --fused-variants
# launch settings of the fused decode kernel (kda_decode) timed with --fused-variants
FUSED_VARIANTS = [{}, {"BV": 16}, {"BV": 16, "num_warps": 4}, {"num_warps": 4},
                  {"BV": 64, "num_warps": 4}, {"BV": 8, "num_warps": 1}]
QKV_DTYPE = torch.bfloat16  # fp32 in --smoke: the interpreter's bf16 tl.dot is wrong
try:
    import fla.ops.kda as fla_kda
except Exception as e:  # report and carry on with ours only
    print(f"fla not importable: {e!r}")
    fla_kda = None


def inputs(B: int, T: int):
    q, k, v = (torch.randn(B, T, H, d, device=dev, dtype=QKV_DTYPE) for d in (K, K, V))
    A_log = torch.rand(H, device=dev) * 2.0 - 1.0
    g = kda_gate(torch.randn(B, T, H, K, device=dev), A_log, torch.randn(H * K, device=dev))
    beta = torch.randn(B, T, H, device=dev).sigmoid()
    h0 = torch.randn(B, H, K, V, device=dev) * 0.1
    return q, k, v, g, beta, h0


def med(fn, rep=100) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")  # ms


def graphed(fn, rep=100) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    return med(gr.replay, rep)


def host_us(fn, n=300) -> float:
    """Host (Python + launch) time per call, with the GPU kept ahead."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def decode_sweep(log) -> None:
    """Graph-replayed time of our decode kernel per launch setting (BV, warps)."""
    for B in (1, 64):
        x = inputs(B, 1)
        kw = dict(initial_state=x[5], ssm_state_indices=torch.arange(B, device=dev),
                  use_qk_l2norm_in_kernel=True)
        for bv, nw in ((16, 1), (16, 2), (32, 2), (32, 4), (64, 4)):
            def fn(x=x, kw=kw, bv=bv, nw=nw):
                return fused_recurrent_kda(*x[:5], BV=bv, num_warps=nw, **kw)
            log(dict(kind="decode_sweep", B=B, BV=bv, warps=nw, graph_us=graphed(fn) * 1e3))


# kda_rows launch settings timed by --rows
ROWS_VARIANTS = [{"BV": 32, "num_warps": 2}, {"BV": 16, "num_warps": 2}, {"BV": 16, "num_warps": 1},
                 {"BV": 64, "num_warps": 4}, {"BV": 32, "num_warps": 4}]


def rows_case(n: int, L: int) -> dict:
    """One --rows case: n sequences x L rows (module doc)."""
    from volundr.kernels.kda.rows import kda_rows
    from volundr.kernels.norm.engine import rms_norm_gated
    from volundr.model.layers import GroupScaled

    W, C, T, slots = 4, 2 * H * K + H * V, n * L, n + 1
    x = torch.randn(T, C, device=dev, dtype=QKV_DTYPE)
    g = torch.randn(T, H, K, device=dev, dtype=QKV_DTYPE)
    beta = torch.randn(T, H, device=dev, dtype=QKV_DTYPE)
    cw = torch.randn(C, W, device=dev, dtype=QKV_DTYPE)
    cs = torch.randn(slots, C, W - 1, device=dev, dtype=QKV_DTYPE)
    st = torch.randn(slots, H, K, V, device=dev) * 0.1
    A_log = torch.rand(H, device=dev) * 2.0 - 1.0
    dt_bias = torch.randn(H * K, device=dev)
    ids = torch.tensor([x for i in range(n) for x in (i, -1)], device=dev)
    cu_l = [0] + [x for i in range(n) for x in (i * L + L, i * L + L)]
    cm_l = [0] + [x for i in range(n) for x in (i * L + L - 1, i * L + L)]  # commit: L - 1
    cu = torch.tensor(cu_l, dtype=torch.int32, device=dev)
    cm = torch.tensor(cm_l, dtype=torch.int32, device=dev)

    def pair(update: bool, c=cu, c_l=cu_l):
        y = engine.causal_conv(x, cw, cs, ids, c, "silu", update_state=update, max_len=L)
        q, k, v = y.view(T, 3, H, K).unbind(1)
        return engine.kda_mixer(q, k, v, g, beta, st, ids, c, c_l, K ** -0.5, A_log=A_log,
                                dt_bias=dt_bias, update_state=update)

    def rows(update: bool, c=cu, **kw):
        return kda_rows(x, cw, cs, g, beta, st, ids, c, K ** -0.5, A_log, dt_bias,
                        update=update, **kw)

    z = torch.randn(T, 2 * H * V, device=dev, dtype=QKV_DTYPE)[:, H * V:].view(T, H, V)
    nw = torch.rand(V, device=dev, dtype=QKV_DTYPE) + 0.5

    def normed():
        return rms_norm_gated(rows(False), nw, z, 1e-6)

    def gated():
        return rows(False, gated=(z, nw))
    u, ss = gated()
    r = dict(kind="rows", n=n, L=L, err=rel(rows(False).float(), pair(False).float()),
             gated_err=rel(GroupScaled(u.view(T, H * V), ss, 1e-6).value().float(),
                           normed().view(T, H * V).float()))
    if not SMOKE:
        r["rows_norm_check_us"] = graphed(normed) * 1e3
        r["rows_gated_check_us"] = graphed(gated) * 1e3
        r["pair_check_us"] = graphed(lambda: pair(False)) * 1e3
        r["pair_commit_us"] = graphed(lambda: pair(True, cm, cm_l)) * 1e3
        for kw in ROWS_VARIANTS:
            tag = f'bv{kw["BV"]}w{kw["num_warps"]}'
            r[f"rows_check_us_{tag}"] = graphed(lambda kw=kw: rows(False, **kw)) * 1e3
            r[f"rows_commit_us_{tag}"] = graphed(lambda kw=kw: rows(True, cm, **kw)) * 1e3
    return r


def rows_bench(log) -> list[dict]:
    """--rows (module doc): graph us of one KDA layer's check and commit, pair vs kda_rows."""
    cases = ((1, 3), (2, 2)) if SMOKE else ((1, 2), (1, 3), (1, 4), (4, 3), (16, 3))
    return [log(rows_case(n, L)) for n, L in cases]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def prefill_call(mod, x):
    q, k, v, g, beta, h0 = x
    return mod.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)


def sweep(T: int, log) -> None:
    """Pick the launch settings of our two prefill kernels at T tokens (sets chunk.CONFIG):
    first the intra kernel's, then the recurrence's with the best intra settings."""
    x = inputs(1, T)
    intra = [dict(intra_BK=bk, intra_warps=w) for bk, w in ((32, 4), (64, 8), (32, 8))]
    fwd = [dict(fwd_BV=bv, fwd_warps=w, fwd_stages=s)  # (num_stages=1 hit an illegal address)
           for bv, w, s in ((32, 4, 2), (64, 4, 2), (16, 4, 2), (64, 8, 2), (64, 4, 3))]
    for phase in (intra, fwd):
        base, best = dict(ours_chunk.CONFIG), None
        for cfg in phase:
            ours_chunk.CONFIG.update(base, **cfg)
            try:
                t = med(lambda: prefill_call(ours_chunk, x))
            except Exception as e:
                log(dict(kind="sweep", T=T, cfg=cfg, error=repr(e)[:300]))
                continue
            log(dict(kind="sweep", T=T, cfg=cfg, ms=t))
            if best is None or t < best[0]:
                best = (t, cfg)
        ours_chunk.CONFIG.update(base, **(best[1] if best else {}))
    log(dict(kind="config", config=dict(ours_chunk.CONFIG)))


def breakdown(T: int, log, impls=None) -> None:
    """Kernel times of one prefill call, ours and fla's (torch profiler)."""
    x = inputs(1, T)
    for name, mod in impls or (("ours", ours_chunk), ("fla", fla_kda)):
        if mod is None:
            continue
        ev, last = profile_call(lambda mod=mod: prefill_call(mod, x))
        log(dict(kind="breakdown", impl=name, T=T, kernels_ms=ev, launches_ms=last))


def profile_call(fn):
    """Kernel times of fn (torch profiler, mean of 3 calls) and every launch of the last call
    in order (kernels that share a name apart), ms."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    ev = {e.key: round(e.device_time_total / 3 / 1000, 4) for e in prof.key_averages()
          if e.device_time_total > 0}
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return ev, [(e.name[:40], round(e.device_time / 1000, 4)) for e in kern[-len(kern) // 3:]]


def intra_compare(Ts, log, smoke: bool = False, variants: tuple[str, ...] = (),
                  use_fla: bool = True) -> list[dict]:
    """Prefill ms per stage-1 implementation (and fla's), each checked before it is timed."""
    modes = ours_chunk.INTRA_MODES
    saved = ours_chunk.CONFIG["intra"]
    rows = []
    try:
        for n, T in enumerate(Ts):
            x = inputs(1, T)
            r = dict(kind="intra_compare", T=T, ok=True)
            outs = {}
            for mode in modes:
                ours_chunk.CONFIG["intra"] = mode
                outs[mode] = prefill_call(ours_chunk, x)
            if fla_kda is not None and use_fla and not smoke:
                outs["fla"] = prefill_call(fla_kda, x)
            base = outs["fused"]
            for name, (o, s_) in outs.items():
                if name != "fused":
                    r[f"rel_o_{name}_vs_fused"] = rel(o, base[0])
                    r[f"rel_state_{name}_vs_fused"] = rel(s_, base[1])
                    r["ok"] &= bool(torch.isfinite(o).all()) and max(rel(o, base[0]),
                                                                     rel(s_, base[1])) < 2e-2
            if n == 0:  # the fp32 reference (python loop over chunks: only at the first T)
                q, k, v, g, beta, h0 = x
                o_ref, s_ref = naive_chunk_kda(q, k, v, g, beta, initial_state=h0,
                                               output_final_state=True,
                                               use_qk_l2norm_in_kernel=True, chunk_size=64)
                for name, (o, s_) in outs.items():
                    r[f"rel_o_{name}_vs_naive"] = rel(o, o_ref)
                    r[f"rel_state_{name}_vs_naive"] = rel(s_, s_ref)
                    r["ok"] &= max(rel(o, o_ref), rel(s_, s_ref)) < 2e-2
            if not r["ok"]:
                rows.append(log(r))  # a wrong kernel's time means nothing
                continue
            for mode in modes:
                ours_chunk.CONFIG["intra"] = mode
                r[f"{mode}_ms"] = one_ms(lambda x=x: prefill_call(ours_chunk, x), smoke)
            if "fla" in outs:
                r["fla_ms"] = one_ms(lambda x=x: prefill_call(fla_kda, x), smoke)
                r["fla_over_sub"] = r["fla_ms"] / r["sub_ms"]
                r["fla_over_split"] = r["fla_ms"] / r["split_ms"]
            r["fused_over_sub"] = r["fused_ms"] / r["sub_ms"]
            rows.append(log(r))
            del outs
            if not smoke:
                torch.cuda.empty_cache()
        if variants and rows and rows[-1]["ok"]:
            for mode in variants:
                mode_variants(Ts[-1], log, smoke, mode)
        if not smoke and rows and rows[-1]["ok"]:
            for mode in modes:  # where the time goes, per kernel, at the last T
                ours_chunk.CONFIG["intra"] = mode
                breakdown(Ts[-1], log, impls=((f"ours_{mode}", ours_chunk),))
            if fla_kda is not None and use_fla:
                breakdown(Ts[-1], log, impls=(("fla", fla_kda),))
    finally:
        ours_chunk.CONFIG["intra"] = saved
    return rows


# launch settings of the sub and split paths tried at the last T (the default first); each
# checked against the fused stage 1 before it is timed
VARIANTS = {
    "sub": [{}, {"sub_maxnreg": 168}, {"sub_maxnreg": 128}, {"sub_split": True},
            {"sub_split": True, "sub_maxnreg": 168, "sub_maxnreg_wu": 128}, {"sub_BK1": 16},
            {"sub_BK": 32, "sub_BV": 64}, {"sub_warps": 8}],
    "split": [{}, {"split_M16": False, "split_stages": 1}, {"fwd_stages": 2},
              {"fwd_stages": 4}, {"split_diag": "levels"}, {"split_inv_apart": False}],
}


def mode_variants(T: int, log, smoke: bool, mode: str) -> None:
    x = inputs(1, T)
    base = dict(ours_chunk.CONFIG)
    ours_chunk.CONFIG["intra"] = "fused"
    o0, s0 = prefill_call(ours_chunk, x)
    try:
        for cfg in VARIANTS[mode]:
            ours_chunk.CONFIG.update(base, intra=mode, **cfg)
            r = dict(kind=f"{mode}_variant", T=T, cfg=cfg)
            try:
                o, s_ = prefill_call(ours_chunk, x)
                r["rel_o_vs_fused"], r["rel_state_vs_fused"] = rel(o, o0), rel(s_, s0)
                if torch.isfinite(o).all() and max(r["rel_o_vs_fused"],
                                                   r["rel_state_vs_fused"]) < 2e-2:
                    r["ms"] = one_ms(lambda: prefill_call(ours_chunk, x), smoke)
                    if not smoke:
                        r["launches_ms"] = profile_call(lambda: prefill_call(ours_chunk, x))[1]
            except Exception as e:  # a launch setting that does not compile: report, go on
                r["error"] = repr(e)[:300]
            log(r)
    finally:
        ours_chunk.CONFIG.clear()
        ours_chunk.CONFIG.update(base)


def one_ms(fn, smoke: bool) -> float:
    if not smoke:
        return med(fn, rep=200)
    t = time.perf_counter()  # interpreter: one call, only to prove the path runs
    fn()
    return (time.perf_counter() - t) * 1e3


def prefill_one(T: int) -> dict:
    x = inputs(1, T)
    r = dict(kind="prefill", T=T, ours_ms=med(lambda: prefill_call(ours_chunk, x), rep=200))
    if fla_kda is not None:
        r["fla_ms"] = med(lambda: prefill_call(fla_kda, x), rep=200)
        r["ratio"] = r["fla_ms"] / r["ours_ms"]
        (o1, s1), (o2, s2) = prefill_call(ours_chunk, x), prefill_call(fla_kda, x)
        r["rel_o_vs_fla"], r["rel_state_vs_fla"] = rel(o1, o2), rel(s1, s2)
    r["ours_Mtok_s"] = T / r["ours_ms"] / 1e3
    return r


def timings(fn) -> tuple[float, float, float]:
    """(eager, graph-replayed, host) us per call; --smoke: one eager call, the rest NaN."""
    if SMOKE:
        return one_ms(fn, True) * 1e3, float("nan"), float("nan")
    return med(fn) * 1e3, graphed(fn) * 1e3, host_us(fn)


def decode_one(B: int) -> dict:
    q, k, v, g, beta, h0 = inputs(B, 1)
    r = dict(kind="decode", B=B)

    def pub(mod):
        return lambda: mod.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                               output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    r["ours_us"], r["ours_graph_us"], _ = timings(pub(_Ours))
    if fla_kda is not None and not SMOKE:
        r["fla_us"], r["fla_graph_us"] = med(pub(fla_kda)) * 1e3, graphed(pub(fla_kda)) * 1e3
        r["ratio_eager"] = r["fla_us"] / r["ours_us"]
        r["ratio_graph"] = r["fla_graph_us"] / r["ours_graph_us"]
        (o1, s1), (o2, s2) = pub(_Ours)(), pub(fla_kda)()
        r["rel_o_vs_fla"], r["rel_state_vs_fla"] = rel(o1, o2), rel(s1, s2)
    # the engine's layer step, engine form: raw q|k|v projections (a column slice of a wider
    # output), gate and beta logits (beta a column slice), conv and KDA states updated in place
    slots = B + 7
    pool = torch.randn(slots, H, K, V, device=dev) * 0.1
    ids = torch.randperm(slots, device=dev)[:B]
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    cu_list = cu.tolist()
    C = 3 * H * K
    xc = torch.randn(B, C + 64, device=dev, dtype=QKV_DTYPE)[:, :C]
    wc = torch.randn(C, 4, device=dev, dtype=QKV_DTYPE) * 0.5
    cs = torch.randn(slots, C, 3, device=dev, dtype=QKV_DTYPE)
    g_raw = torch.randn(B, H, K, device=dev, dtype=QKV_DTYPE)
    b_raw = torch.randn(B, 2 * 16 + H, device=dev, dtype=QKV_DTYPE)[:, 2 * 16:]
    A_log = torch.rand(H, device=dev) * 2.0 - 1.0
    dt_bias = torch.randn(H * K, device=dev)
    scale = K ** -0.5

    def mixer(y=xc):
        qq, kk, vv = y.view(B, 3, H, K).unbind(1)
        return engine.kda_mixer(qq, kk, vv, g_raw, b_raw, pool, ids, cu, cu_list, scale,
                                A_log=A_log, dt_bias=dt_bias)

    def conv():
        return engine.causal_conv(xc, wc, cs, ids, cu, "silu")

    def layer():
        return mixer(conv())

    def fused():  # the kernel itself (ops.kda_decode takes the two kernels at large batch)
        return ours_decode.kda_decode(xc, wc, cs, g_raw, b_raw, pool, ids, scale, A_log, dt_bias)

    # the fused step == the two kernels (output, both states) before either is timed
    saved = pool.clone(), cs.clone()
    o_l, pool_l, cs_l = layer(), pool.clone(), cs.clone()
    pool.copy_(saved[0])
    cs.copy_(saved[1])
    o_f = fused()
    r["rel_o_fused_vs_layer"] = rel(o_f, o_l)
    r["rel_state_fused_vs_layer"] = rel(pool, pool_l)
    r["conv_state_equal"] = bool(torch.equal(cs, cs_l))
    r["fused_ok"] = (r["conv_state_equal"] and bool(torch.isfinite(o_f).all())
                     and max(r["rel_o_fused_vs_layer"], r["rel_state_fused_vs_layer"]) < 2e-2)
    del saved, pool_l, cs_l
    # (the state pools drift over the timed calls; the time does not depend on their values)
    for name, fn in (("mixer", mixer), ("conv", conv), ("layer", layer), ("fused", fused)):
        if name == "fused" and not r["fused_ok"]:
            continue  # a wrong kernel's time means nothing
        r[f"{name}_us"], r[f"{name}_graph_us"], r[f"{name}_host_us"] = timings(fn)
    if "fused_us" in r:
        r["layer_over_fused"] = r["layer_us"] / r["fused_us"]
        r["layer_over_fused_graph"] = r["layer_graph_us"] / r["fused_graph_us"]
        if FUSED_VARIANTS_ON:  # graph us per launch setting of the fused kernel (decode.CONFIG)
            base = dict(ours_decode.CONFIG)
            try:
                for cfg in FUSED_VARIANTS:
                    ours_decode.CONFIG.update(base, **cfg)
                    key = ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"
                    r[f"fused_graph_us[{key}]"] = timings(fused)[1]
            finally:
                ours_decode.CONFIG.update(base)
    r["state_GBps_graph"] = 2 * B * H * K * V * 4 / (r["mixer_graph_us"] * 1e-6) / 1e9
    return r


def prefill(Ts, log) -> list[dict]:
    rows = []
    for T in Ts:
        rows.append(log(prefill_one(T)))
        torch.cuda.empty_cache()
    return rows


def decode(Bs, log) -> list[dict]:
    return [log(decode_one(B)) for B in Bs]


class _Ours:
    fused_recurrent_kda = staticmethod(fused_recurrent_kda)


def plot(pre, dec, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    Ts = [r["T"] for r in pre]
    a.loglog(Ts, [r["ours_ms"] for r in pre], "o-", label="volundr chunk_kda")
    if pre and "fla_ms" in pre[0]:
        a.loglog(Ts, [r["fla_ms"] for r in pre], "s--", label="fla chunk_kda")
        for r in pre:
            a.annotate(f'{r["ratio"]:.2f}x', (r["T"], r["ours_ms"]), textcoords="offset points",
                       xytext=(0, -14), ha="center", fontsize=8)
    a.set(xlabel="tokens T (one sequence)", ylabel="ms per layer",
          title="KDA prefill, H=40, K=V=128 (label: fla / ours)")
    a.legend()
    Bs = [r["B"] for r in dec]
    for key, st, lab in (("ours_us", "o-", "volundr fused_recurrent (eager)"),
                         ("ours_graph_us", "o:", "volundr (CUDA graph)"),
                         ("fla_us", "s--", "fla fused_recurrent (eager)"),
                         ("fla_graph_us", "s:", "fla (CUDA graph)"),
                         ("layer_graph_us", "^-", "volundr conv+mixer layer (graph)"),
                         ("fused_graph_us", "v-", "volundr fused kda_decode (graph)")):
        if dec and key in dec[0]:
            b.loglog(Bs, [r[key] for r in dec], st, label=lab)
    b.axhline(10, color="gray", lw=0.8)
    b.set(xlabel="batch (sequences, one token each)", ylabel="us per layer",
          title="KDA decode step")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--prefill", default="4096,16384,32768,65536,131072,262144")
    ap.add_argument("--decode", default="1,8,32,64")
    ap.add_argument("--sweep", action="store_true",
                    help="tune our launch settings, write them to OUT/kda_config.json and stop")
    ap.add_argument("--intra-compare", action="store_true",
                    help="prefill with each stage-1 implementation (and fla), checked, then stop")
    ap.add_argument("--intra-T", default="4096,32768")
    ap.add_argument("--sub-variants", action="store_true",
                    help="with --intra-compare: also time the sub path's launch-setting variants")
    ap.add_argument("--split-variants", action="store_true",
                    help="with --intra-compare: also time the split path's launch settings")
    ap.add_argument("--no-fla", action="store_true", help="leave fla out (it autotunes: slow)")
    ap.add_argument("--once", choices=("ours", "fla"),
                    help="one prefill at the last --intra-T in NVTX range 'once' (after a "
                         "warm-up call), for ncu --nvtx --nvtx-include once/, then stop")
    ap.add_argument("--decode-only", action="store_true",
                    help="only the decode measurements (no prefill), then stop")
    ap.add_argument("--fused-variants", action="store_true",
                    help="decode: also time the fused kernel's launch settings (FUSED_VARIANTS)")
    ap.add_argument("--rows", action="store_true",
                    help="a speculative check's / commit's rows: the two kernels vs kda_rows")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU under TRITON_INTERPRET=1 (script check)")
    args = ap.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":  # Triton reads it when kernels are defined
            os.execve(sys.executable, [sys.executable] + sys.argv,
                      dict(os.environ, TRITON_INTERPRET="1"))
        global H, K, V, dev, QKV_DTYPE, SMOKE
        H, K, V, dev, QKV_DTYPE, SMOKE = 2, 32, 32, "cpu", torch.float32, True
    cfg_path = os.path.join(args.out, "kda_config.json")
    os.makedirs(args.out, exist_ok=True)
    name = ("kda_sweep" if args.sweep else "kda_intra" if args.intra_compare
            else "kda_rows" if args.rows else "kda_bench")
    jl = open(os.path.join(args.out, name + ".jsonl"), "w")

    def log(d):
        print(json.dumps(d), flush=True)
        jl.write(json.dumps(d) + "\n")
        jl.flush()
        return d
    gpu = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name()
    log(dict(kind="env", gpu=gpu, torch=torch.__version__,
             triton=triton.__version__, fla=getattr(sys.modules.get("fla"), "__version__", None),
             time=time.strftime("%Y-%m-%d %H:%M:%S")))
    if args.once:  # for a profiler: a warm-up call, then one call in the NVTX range "once"
        x = inputs(1, int(args.intra_T.split(",")[-1]))
        mod = globals()["fla_kda"] if args.once == "fla" else ours_chunk
        prefill_call(mod, x)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("once")
        prefill_call(mod, x)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        return
    if args.rows:
        rows_bench(log)
        return
    if args.intra_compare:
        Ts = [100, 200] if args.smoke else [int(t) for t in args.intra_T.split(",")]
        variants = tuple(m for m, on in (("sub", args.sub_variants),
                                          ("split", args.split_variants)) if on)
        rows = intra_compare(Ts, log, args.smoke, variants, not args.no_fla)
        print("intra-compare:  T  fused_ms  sub_ms  split_ms  fla_ms  fla/split  ok")
        nan = float("nan")
        for r in rows:
            print(f'{r["T"]:>8} {r.get("fused_ms", nan):8.3f} {r.get("sub_ms", nan):8.3f} '
                  f'{r.get("split_ms", nan):8.3f} {r.get("fla_ms", nan):8.3f} '
                  f'{r.get("fla_over_split", nan):6.2f} {r["ok"]}')
        return
    if args.sweep:  # in its own process: a crash here must not take the measurements with it
        decode_sweep(log)
        sweep(32768, log)
        with open(cfg_path, "w") as f:
            json.dump(ours_chunk.CONFIG, f)
        return
    if os.path.exists(cfg_path):
        ours_chunk.CONFIG.update(json.load(open(cfg_path)))
        log(dict(kind="config", config=dict(ours_chunk.CONFIG)))
    if args.no_fla:
        global fla_kda
        fla_kda = None
    global FUSED_VARIANTS_ON
    FUSED_VARIANTS_ON = args.fused_variants
    dec = decode([int(b) for b in args.decode.split(",")], log)
    if args.decode_only:
        print_decode(dec)
        return
    pre = prefill([int(t) for t in args.prefill.split(",")], log)
    breakdown(32768, log)
    with open(os.path.join(args.out, "kda_bench.json"), "w") as f:
        json.dump(dict(prefill=pre, decode=dec, config=ours_chunk.CONFIG), f, indent=1)
    with open(os.path.join(args.out, "kda_bench.csv"), "w", newline="") as f:
        keys = sorted({k for r in pre + dec for k in r})
        wr = csv.DictWriter(f, keys)
        wr.writeheader()
        wr.writerows(pre + dec)
    plot(pre, dec, os.path.join(args.out, "kda_bench.png"))
    print("prefill:  T  ours_ms  fla_ms  fla/ours")
    for r in pre:
        print(f'{r["T"]:>8} {r["ours_ms"]:8.3f} {r.get("fla_ms", float("nan")):8.3f} '
              f'{r.get("ratio", float("nan")):6.2f}')
    print_decode(dec)


def print_decode(dec) -> None:
    nan = float("nan")
    print("decode:  B  ours_us(eager/graph)  fla_us(eager/graph)  layer_us(eager/graph)  "
          "fused_us(eager/graph)  layer/fused(graph)")
    for r in dec:
        print(f'{r["B"]:>6} {r["ours_us"]:7.1f}/{r["ours_graph_us"]:6.1f} '
              f'{r.get("fla_us", nan):7.1f}/{r.get("fla_graph_us", nan):6.1f} '
              f'{r["layer_us"]:7.1f}/{r["layer_graph_us"]:6.1f} '
              f'{r.get("fused_us", nan):7.1f}/{r.get("fused_graph_us", nan):6.1f} '
              f'{r.get("layer_over_fused_graph", nan):6.2f}')


if __name__ == "__main__":
    main()
