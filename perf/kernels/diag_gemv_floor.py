"""Where a batch-1 GEMV's fixed ~6.5 us goes (#5): floor kernels on gemv_tc's own grid.

    python3 perf/kernels/diag_gemv_floor.py --out $OUT/gemv_floor.json      (H200: ~1 minute)

For each engine shape (N x K, bits) with the engine's gemv_tc config, one chain of C launches
per variant, captured in a CUDA graph with PDL launches as in the decode graph (weights
rotating over > 8x L2, so every call streams from HBM), us per call:

* empty        trigger + wait, nothing else (grid of gemv_tc): the launch / dependency floor
* empty 1      the same with one program (what a norm kernel's launch costs at least)
* reduce       no weight loads; split-K partial store + counter + last-program sum, as gemv_tc
* load         every weight word / scale of the program's sets loaded (128-bit loads, XOR-ed),
               one partial store per program, no reduction: streaming on this grid
* load+reduce  both: gemv_tc's memory traffic and synchronisation without its arithmetic
* gemv_tc      the engine's kernel (and with early weight loads, `early`)
* empty-nopdl  empty launched without PDL

--sweep: streaming alone (every load of a set in flight at once) over other grids (rows per
program, warps, programs per SM): which grid can stream these shapes near the copy rate.
--tiled: the same streaming against a layout with each (n tile, set) contiguous (two orders),
same bytes: whether the kernel layout's access pattern (a warp's 128-bit loads hit 4 rows of
128 bytes, N words apart) costs bandwidth.
--tma: streaming through TMA (host tensor descriptors, loop pipelined through shared memory)
over a few grids, beside the best pointer-load grids: the floor a TMA-fed GEMV would stand on.
--tma5: gemv_tc's TMA boxes (`tma=True`: per set row one box of 16-byte runs in the mma
fragment's order) streamed alone, against the whole-row boxes of --tma and the pointer loads,
beside gemv_tc with and without them: whether its TMA path (1.2-1.6x slower, run 71) loses in
the stream (the box shape; a repacked layout would fix that) or in the arithmetic.
--layer: a KDA layer's four matmuls streamed in four launches (each on its best grid) against
the same bytes in one launch: the floor of a weight stream that runs on across kernels.
--l2: gemv_tc (the engine's config) and the load / load+reduce floors reading the same layer at
every launch (L2-resident where it fits in the H200's ~50 MB: the o_proj and 2/3-bit down
shapes) against rotating copies from HBM: what a call costs without HBM, i.e. its launch,
arithmetic and latency chain, and how much of it the loads alone explain.

Differences between rows attribute the fixed cost: launch, split-K round trips, the streaming
itself, and the dequantise + mma work. A timing diagnosis, not a test: the floor kernels'
results are not checked (gemv_tc's is, against the naive reference).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from bench_quant import STREAM_BYTES, layer_bytes, random_layer, time_graph  # noqa: E402

from volundr.kernels import pdl  # noqa: E402
from volundr.kernels.quant.engine import GEMV_TC_CONFIG  # noqa: E402
from volundr.kernels.quant.gemv import _workspace, split_k, sum_splits  # noqa: E402
from volundr.kernels.quant.gemv_tc import gemv_tc  # noqa: E402
from volundr.kernels.quant.naive import naive_quant_matmul  # noqa: E402

# (N, K, bits): o_proj, KDA in_proj, gate_up (3- and 2-bit layers), down, as in the engine
SHAPES = [(5120, 5120, 4), (15680, 5120, 4), (34816, 5120, 3), (34816, 5120, 2),
          (5120, 17408, 3), (5120, 17408, 2)]


@triton.jit
def _floor_kernel(qa_ptr, qb_ptr, sz_ptr, ws_ptr, cnt_ptr, y_ptr, N, ra, rb, sets_per_split,
                  n_sets, num_splits, BN: tl.constexpr, LOAD: tl.constexpr,
                  REDUCE: tl.constexpr, HAS_B: tl.constexpr):
    """Program (n tile, split) of gemv_tc's grid; ra / rb = rows of qa / qb per set of 4
    groups (sz: 4 rows per set)."""
    pdl.trigger()
    pdl.wait()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BN], dtype=tl.int32)
    if LOAD:
        set0 = pid_k * sets_per_split
        set1 = tl.minimum(set0 + sets_per_split, n_sets)
        for st in range(set0, set1):
            for r in range(0, ra, 4):  # 4 rows x BN words per load: 128 bits per lane
                rows = st * ra + r + tl.arange(0, 4)
                acc ^= tl.xor_sum(tl.load(qa_ptr + rows[:, None] * N + cols[None, :]), axis=0)
            if HAS_B:
                for r in range(0, rb, 4):
                    rows = st * rb + r + tl.arange(0, 4)
                    w = tl.load(qb_ptr + rows[:, None] * N + cols[None, :])
                    acc ^= tl.xor_sum(w, axis=0)
            rows = st * 4 + tl.arange(0, 4)
            acc ^= tl.xor_sum(tl.load(sz_ptr + rows[:, None] * N + cols[None, :]), axis=0)
    part = acc.to(tl.float32)
    if REDUCE and num_splits > 1:  # gemv_tc's split-K ending
        tl.store(ws_ptr + pid_k.to(tl.int64) * N + cols, part)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == num_splits - 1:  # (run 15 measured the loop before sum_splits)
            tot = sum_splits(ws_ptr + cols, N, num_splits, cols >= 0, part)
            tl.store(y_ptr + cols, tot.to(y_ptr.dtype.element_ty))
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    elif LOAD or REDUCE:
        tl.store(ws_ptr + pid_k.to(tl.int64) * N + cols, part)


@triton.jit
def _program_sets(sets_per_split, n_sets):
    """The streaming kernels' prologue (PDL trigger and wait): program (n tile, split) and its
    sets set0 .. set1 - 1."""
    pdl.trigger()
    pdl.wait()
    pid_k = tl.program_id(1)
    set0 = pid_k * sets_per_split
    return tl.program_id(0), pid_k, set0, tl.minimum(set0 + sets_per_split, n_sets)


@triton.jit
def _stream_kernel(qa_ptr, qb_ptr, sz_ptr, ws_ptr, N, sets_per_split, n_sets,
                   RA: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr):
    """--sweep: a program streams its sets with every load of a set issued before any is used
    (RA / RB rows of qa / qb per set, unrolled): the most bytes in flight registers allow."""
    pid_n, pid_k, set0, set1 = _program_sets(sets_per_split, n_sets)
    cols = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BN], dtype=tl.int32)
    for st in range(set0, set1):
        rows = st * RA + tl.arange(0, RA)
        w = tl.load(qa_ptr + rows[:, None] * N + cols[None, :])
        if RB > 0:
            rows = st * RB + tl.arange(0, RB)
            w2 = tl.load(qb_ptr + rows[:, None] * N + cols[None, :])
            acc ^= tl.xor_sum(w2, axis=0)
        rows = st * 4 + tl.arange(0, 4)
        acc ^= tl.xor_sum(w, axis=0) ^ tl.xor_sum(tl.load(sz_ptr + rows[:, None] * N
                                                          + cols[None, :]), axis=0)
    tl.store(ws_ptr + pid_k.to(tl.int64) * N + cols, acc.to(tl.float32))


@triton.jit
def _stream_tiled_kernel(qa_ptr, qb_ptr, sz_ptr, ws_ptr, N, n_tiles, sets_per_split, n_sets,
                         RA: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr,
                         SET_MAJOR: tl.constexpr):
    """--tiled: _stream_kernel's bytes, but each (n tile, set) of a plane stored contiguously
    (RA x BN words of qa, RB x BN of qb, 4 x BN of sz), so a warp's 128-bit loads cover 512
    contiguous bytes instead of 4 rows x 128 bytes N words apart. SET_MAJOR: tiles ordered
    [set][n tile] (the programs resident together read neighbouring tiles), else [n tile][set]
    (a program's sets follow each other)."""
    pid_n, pid_k, set0, set1 = _program_sets(sets_per_split, n_sets)
    acc = tl.zeros([BN], dtype=tl.int32)
    for st in range(set0, set1):
        if SET_MAJOR:
            t = (st * n_tiles + pid_n).to(tl.int64)
        else:
            t = (pid_n * n_sets + st).to(tl.int64)
        # 1-D loads, reduced to a scalar (a reshape could go through shared memory)
        w = tl.load(qa_ptr + t * (RA * BN) + tl.arange(0, RA * BN))
        if RB > 0:
            w2 = tl.load(qb_ptr + t * (RB * BN) + tl.arange(0, RB * BN))
            acc ^= tl.xor_sum(w2, axis=0)
        z = tl.load(sz_ptr + t * (4 * BN) + tl.arange(0, 4 * BN))
        acc ^= tl.xor_sum(w, axis=0) ^ tl.xor_sum(z, axis=0)
    tl.store(ws_ptr + pid_k.to(tl.int64) * N + pid_n * BN + tl.arange(0, BN), acc.to(tl.float32))


@triton.jit
def _stream_tma_kernel(qa_desc, qb_desc, sz_desc, ws_ptr, N, sets_per_split, n_sets,
                       RA: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr,
                       STAGES: tl.constexpr):
    """--tma: _stream_kernel's bytes, each set's [RA, BN] / [RB, BN] / [4, BN] blocks brought
    in by TMA (host descriptors), the loop pipelined STAGES deep through shared memory: bytes
    in flight without registers held for them, a few instructions per set."""
    pid_n, pid_k, set0, set1 = _program_sets(sets_per_split, n_sets)
    acc = tl.zeros([BN], dtype=tl.int32)
    for st in tl.range(set0, set1, num_stages=STAGES):
        w = qa_desc.load([st * RA, pid_n * BN])
        if RB > 0:
            acc ^= tl.xor_sum(qb_desc.load([st * RB, pid_n * BN]), axis=0)
        acc ^= tl.xor_sum(w, axis=0) ^ tl.xor_sum(sz_desc.load([st * 4, pid_n * BN]), axis=0)
    cols = pid_n * BN + tl.arange(0, BN)
    tl.store(ws_ptr + pid_k.to(tl.int64) * N + cols, acc.to(tl.float32), mask=cols < N)


@triton.jit
def _stream_tma5_kernel(qa_desc, qb_desc, sz_desc, ws_ptr, N, sets_per_split, n_sets,
                        WA: tl.constexpr, WB: tl.constexpr, L: tl.constexpr, Q: tl.constexpr,
                        STAGES: tl.constexpr):
    """--tma5: _stream_tma_kernel's bytes through gemv_tc's TMA boxes (`tma_descs`: per
    row r of a set one [1, L, Q, 4, 4] box of 16-byte runs, 4 groups apart) instead of one
    [RA, BN] box of 256-byte rows per set: what that box shape costs the stream."""
    pid_n, pid_k, set0, set1 = _program_sets(sets_per_split, n_sets)
    acc = tl.zeros([L * Q * 16], dtype=tl.int32)
    for st in tl.range(set0, set1, num_stages=STAGES):
        for r in tl.static_range(WA):
            acc ^= tl.reshape(qa_desc.load([r, pid_n * L, 0, st * 4, 0]), [L * Q * 16])
        for r in tl.static_range(WB):
            acc ^= tl.reshape(qb_desc.load([r, pid_n * L, 0, st * 4, 0]), [L * Q * 16])
        acc ^= tl.reshape(sz_desc.load([pid_n * L, 0, st * 4, 0]), [L * Q * 16])
    tl.store(ws_ptr + pid_k.to(tl.int64) * N + pid_n * (L * Q * 4) + tl.arange(0, L * Q * 4),
             tl.xor_sum(tl.reshape(acc, [L * Q * 4, 4]), axis=1).to(tl.float32))


def stream_tma5_call(layer, n, k, bits, reps, waves, stages):
    from volundr.kernels.quant.gemv_tc import tma_descs

    qa, qb, sz = layer
    bn = 32 * reps
    n_tiles = triton.cdiv(n, bn)
    n_sets = triton.cdiv(k // 128, 4)
    wa = qa.shape[0] // (4 * n_sets)
    d = tma_descs(qa, qb, sz, bits, wa, reps, 8)
    sps, ns = split_k(n_tiles, n_sets, qa.device, waves)
    ws, _ = _workspace(qa.device, n_tiles, ns * n)
    _stream_tma5_kernel[(n_tiles, ns)](d["qa_desc"], d["qb_desc"], d["sz_desc"], ws, n, sps,
                                       n_sets, WA=wa, WB=wa // 2 if bits == 3 else 0, L=reps,
                                       Q=8, STAGES=stages, num_warps=1,
                                       launch_pdl=pdl.ON.value)


# --tma grids: (BN, warps, programs per SM, stages)
TMA = [(64, 1, 8, 3), (64, 1, 4, 4), (128, 4, 4, 3), (128, 4, 2, 4), (256, 4, 2, 3),
       (256, 8, 1, 4), (128, 2, 3, 4)]


def stream_tma_call(layer, n, k, bits, bn, num_warps, waves, stages, descs):
    """descs: a cache (per layer and BN) of the host TensorDescriptors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    qa, qb, sz = layer
    n_tiles = triton.cdiv(n, bn)
    n_sets = triton.cdiv(k // 128, 4)
    ra, rb = qa.shape[0] // n_sets, qb.shape[0] // n_sets
    key = (id(qa), bn)
    if key not in descs:
        szi = sz.view(torch.int32)
        descs[key] = tuple(TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [r, bn])
                           for t, r in ((qa, ra), (qb if rb else qa, max(rb, 1)), (szi, 4)))
    sps, ns = split_k(n_tiles, n_sets, qa.device, waves)
    ws, _ = _workspace(qa.device, n_tiles, ns * n)
    _stream_tma_kernel[(n_tiles, ns)](*descs[key], ws, n, sps, n_sets, RA=ra, RB=rb, BN=bn,
                                      STAGES=stages, num_warps=num_warps,
                                      launch_pdl=pdl.ON.value)


# --sweep grids: (BN rows per program, warps per program, programs per SM); the engine's is
# (64, 1, 24)
SWEEP = [(64, 1, 24), (64, 1, 8), (64, 1, 48), (64, 2, 12), (128, 2, 12), (256, 4, 6),
         (256, 4, 3), (128, 4, 6), (512, 8, 2)]


def stream_call(layer, n, k, bits, bn, num_warps, waves):
    qa, qb, sz = layer
    n_tiles = triton.cdiv(n, bn)
    n_sets = triton.cdiv(k // 128, 4)
    sps, ns = split_k(n_tiles, n_sets, qa.device, waves)
    ws, _ = _workspace(qa.device, n_tiles, ns * n)
    _stream_kernel[(n_tiles, ns)](qa, qb if qb.numel() else qa, sz, ws, n, sps, n_sets,
                                  RA=qa.shape[0] // n_sets, RB=qb.shape[0] // n_sets, BN=bn,
                                  num_warps=num_warps, launch_pdl=pdl.ON.value)

# --tiled grids: the strided layout (as --sweep) against the two tile-contiguous orders
TILED = [(64, 1, 24), (64, 1, 8), (64, 1, 48), (128, 2, 12), (256, 4, 6)]


def stream_tiled_call(layer, n, k, bits, bn, num_warps, waves, set_major):
    qa, qb, sz = layer
    n_tiles = n // bn  # every engine shape is a multiple of 256 rows but 15680 (see run_shape)
    n_sets = triton.cdiv(k // 128, 4)
    sps, ns = split_k(n_tiles, n_sets, qa.device, waves)
    ws, _ = _workspace(qa.device, n_tiles, ns * n)
    _stream_tiled_kernel[(n_tiles, ns)](
        qa, qb if qb.numel() else qa, sz.view(torch.int32), ws, n, n_tiles, sps, n_sets,
        RA=qa.shape[0] // n_sets, RB=qb.shape[0] // n_sets, BN=bn, SET_MAJOR=set_major,
        num_warps=num_warps, launch_pdl=pdl.ON.value)


def floor_call(layer, n, k, bits, y, mode: str, grid_one: bool = False, use_pdl: bool = True):
    cfg = GEMV_TC_CONFIG[bits]
    qa, qb, sz = layer
    bn = 32 * cfg["reps"] * cfg["num_warps"]
    n_tiles = triton.cdiv(n, bn)
    n_sets = triton.cdiv(k // 128, 4)
    sps, ns = split_k(n_tiles, n_sets, qa.device, cfg["waves"])
    ws, cnt = _workspace(qa.device, n_tiles, ns * n)
    grid = (1, 1) if grid_one else (n_tiles, ns)
    _floor_kernel[grid](qa, qb if qb.numel() else qa, sz.view(torch.int32), ws, cnt, y, n,
                        qa.shape[0] // n_sets, max(qb.shape[0] // n_sets, 4), sps, n_sets, ns,
                        BN=bn, LOAD=mode in ("load", "load+reduce"),
                        REDUCE=mode in ("reduce", "load+reduce"), HAS_B=bits == 3,
                        num_warps=cfg["num_warps"], launch_pdl=use_pdl and pdl.ON.value)


def run_shape(n: int, k: int, bits: int, sweep: bool | str) -> list[dict]:
    """Time every variant at one shape (a function of its own: the closures bind its locals)."""
    nbytes = layer_bytes(random_layer(n, k, bits))
    copies = max(2, min(64, math.ceil(STREAM_BYTES / nbytes)))
    layers = [random_layer(n, k, bits, seed=c) for c in range(copies)]
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    cfg = dict(GEMV_TC_CONFIG[bits])
    err = float("nan")

    def fl(c, mode, **kw):
        floor_call(layers[c], n, k, bits, y, mode, **kw)

    def st(c, bn, nw, w):
        stream_call(layers[c], n, k, bits, bn, nw, w)

    def tc(c, early):
        gemv_tc(x, *layers[c], bits, 128, out=y, early=early, **cfg)

    def tt(c, bn, nw, w, sm):
        stream_tiled_call(layers[c], n, k, bits, bn, nw, w, sm)

    f = functools.partial
    descs: dict = {}

    def tm(c, bn, nw, w, stages):
        stream_tma_call(layers[c], n, k, bits, bn, nw, w, stages, descs)

    def t5(c, w, stages):
        stream_tma5_call(layers[c], n, k, bits, 2, w, stages)

    def tct(c, w, stages):
        gemv_tc(x, *layers[c], bits, 128, out=y, **{**cfg, "waves": w, "stages": stages,
                                                      "tma": True})

    if sweep == "tma5":  # gemv_tc's TMA boxes: their stream, and the GEMV on them (run 71)
        variants = {"gemv_tc": f(tc, early=None), "stream 64,1,8": f(st, bn=64, nw=1, w=8)}
        for w, sg in ((8, 2), (8, 3), (24, 2)):
            variants[f"tma 64,1,{w},s{sg}"] = f(tm, bn=64, nw=1, w=w, stages=sg)
            variants[f"tma5 64,1,{w},s{sg}"] = f(t5, w=w, stages=sg)
            variants[f"gemv_tc tma {w},s{sg}"] = f(tct, w=w, stages=sg)
    elif sweep == "tma":  # TMA-fed streaming against the best pointer-load grids of run 16
        variants = {f"stream {bn},{nw},{w}": f(st, bn=bn, nw=nw, w=w)
                    for bn, nw, w in [(64, 1, 24), (64, 1, 8), (64, 1, 48)]}
        variants.update({f"tma {bn},{nw},{w},s{sg}": f(tm, bn=bn, nw=nw, w=w, stages=sg)
                         for bn, nw, w, sg in TMA})
    elif sweep == "l2":  # the same layer at every launch: L2-resident where it fits (~50 MB)
        variants = {"gemv_tc": f(tc, early=None), "load": f(fl, mode="load"),
                    "gemv_tc l2": lambda c: tc(0, None), "load l2": lambda c: fl(0, "load"),
                    "load+reduce l2": lambda c: fl(0, "load+reduce"),
                    "empty": f(fl, mode="empty")}
    elif sweep == "tiled":  # 15680 = 245 x 64: the tiled kernel streams its whole 64-row tiles
        variants = {}
        for bn, nw, w in TILED:
            if n % bn:
                continue
            variants[f"strided {bn},{nw},{w}"] = f(st, bn=bn, nw=nw, w=w)
            variants[f"tiled {bn},{nw},{w}"] = f(tt, bn=bn, nw=nw, w=w, sm=False)
            variants[f"tiled set-major {bn},{nw},{w}"] = f(tt, bn=bn, nw=nw, w=w, sm=True)
    elif sweep:
        variants = {f"stream {bn},{nw},{w}": f(st, bn=bn, nw=nw, w=w) for bn, nw, w in SWEEP}
    else:
        variants = {"empty": f(fl, mode="empty"), "empty 1": f(fl, mode="empty", grid_one=True),
                    "empty-nopdl": f(fl, mode="empty", use_pdl=False),
                    "reduce": f(fl, mode="reduce"), "load": f(fl, mode="load"),
                    "load+reduce": f(fl, mode="load+reduce"),
                    "gemv_tc": f(tc, early=False), "gemv_tc early": f(tc, early=True)}
        ref = naive_quant_matmul(x.float(), *layers[0], bits, 128, k)
        tc(0, False)
        err = ((y.float() - ref).norm() / ref.norm()).item()
    rows, line = [], [f"{n}x{k} {bits}b ({nbytes / 1e6:.1f} MB, err {err:.1e})"]
    for name, fn in variants.items():
        try:
            us = time_graph(fn, copies)
        except Exception as e:  # e.g. a TMA grid whose stages exceed shared memory
            rows.append(dict(n=n, k=k, bits=bits, variant=name, failed=str(e)[:300]))
            line.append(f"{name} FAILED {str(e)[:80]}")
            torch.cuda.synchronize()
            continue
        rows.append(dict(n=n, k=k, bits=bits, variant=name, us=us, bytes=nbytes,
                         gbs=nbytes / us / 1e3, rel_err=err, cfg=cfg))
        line.append(f"{name} {us:.2f} ({nbytes / us / 1e3:.0f} GB/s)")
    print("\n  ".join(line), flush=True)
    return rows


# --layer: a KDA layer's four matmuls as the decode step runs them (3-bit MLP), each on its
# best pointer-load streaming grid of runs 16 / 62 (BN, warps, programs per SM)
LAYER = {(15680, 5120, 4): (64, 1, 8), (5120, 5120, 4): (64, 1, 24),
         (34816, 5120, 3): (64, 1, 48), (5120, 17408, 3): (64, 1, 24)}


def run_layer() -> list[dict]:
    """Streaming floor of one layer: its four matmuls' weights in four launches (each shape on
    its best grid) against the same bytes as one 4-bit 5120 x K plane in one launch: what a
    kernel whose weight stream runs on across the layer's matmuls could reach at most."""
    per = {s: layer_bytes(random_layer(*s)) for s in LAYER}
    total = sum(per.values())
    copies = max(2, min(64, math.ceil(STREAM_BYTES / total)))
    layers = [{s: random_layer(*s, seed=c) for s in LAYER} for c in range(copies)]
    kk = round(total / (5120 * (0.5 + 4 / 128)) / 512) * 512  # 4-bit words + scales / zeros
    plane = [random_layer(5120, kk, 4, seed=100 + c) for c in range(copies)]

    def four(c):
        for (n, k, bits), (bn, nw, w) in LAYER.items():
            stream_call(layers[c][(n, k, bits)], n, k, bits, bn, nw, w)

    def one(c, w):
        stream_call(plane[c], 5120, kk, 4, 64, 1, w)

    variants = {"4 launches": (four, total)}
    variants.update({f"1 launch, 64,1,{w}": (functools.partial(one, w=w), layer_bytes(plane[0]))
                     for w in (8, 24, 48)})
    rows, line = [], [f"layer {total / 1e6:.1f} MB (one plane 5120x{kk} 4b)"]
    for name, (fn, nbytes) in variants.items():
        us = time_graph(fn, copies)
        rows.append(dict(variant=name, us=us, bytes=nbytes, gbs=nbytes / us / 1e3))
        line.append(f"{name} {us:.2f} ({nbytes / us / 1e3:.0f} GB/s)")
    print("\n  ".join(line), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gemv_floor.json")
    ap.add_argument("--sweep", action="store_true", help="streaming alone over SWEEP's grids")
    ap.add_argument("--tiled", action="store_true",
                    help="streaming: the weight layout against tile-contiguous ones")
    ap.add_argument("--l2", action="store_true",
                    help="gemv_tc and the floors with the weights L2-resident vs from HBM")
    ap.add_argument("--tma", action="store_true",
                    help="streaming with TMA loads pipelined through shared memory")
    ap.add_argument("--tma5", action="store_true",
                    help="gemv_tc's TMA boxes (16-byte runs) against whole-row TMA boxes")
    ap.add_argument("--layer", action="store_true",
                    help="a layer's weights streamed in four launches vs in one")
    args = ap.parse_args(argv)
    mode = ("tiled" if args.tiled else "l2" if args.l2 else "tma" if args.tma
            else "tma5" if args.tma5 else args.sweep)
    if args.layer:
        rows = run_layer()
    else:
        rows = [r for n, k, bits in SHAPES for r in run_shape(n, k, bits, mode)]
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
