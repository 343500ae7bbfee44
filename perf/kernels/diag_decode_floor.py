"""How close batch-1 decode attention can get to the copy bandwidth at all (#4): floors beside
the kernel, same bytes, same timing as bench_attention.py's decode rows.

    python3 perf/kernels/diag_decode_floor.py --out $OUT/decode_floor.json   (H200: ~1 minute)

Per (batch, context), us per call in a CUDA graph chain of R calls over R disjoint block sets
(PDL launches as in the decode graph), K+V bytes / time against the D2D copy bandwidth:

* kernel       paged_decode_attention, the engine's config (split kernel + merge)
* load         the split kernel's grid and K/V loads (block table, pipelined), XOR-ed, one store
               per program, no dots and no merge: streaming these bytes the kernel's way
* load 1-hop   the same with the blocks in order, addressed without the table (one load of
               its first entry per program)
* load ordered the block table read as in `load`, but holding the blocks in order
* load both heads[, ordered]  one program reads all KV heads of its rows (whole rows), over
               KVH times the splits: whether half-rows read by two programs cost bandwidth
* sdpa         torch SDPA (best backend) on contiguous K/V [B, KVH, L, D], q [B, H, 1, D], GQA
* copy         torch's device-to-device copy of the same K+V bytes (read once, written once;
               runs 63-64 copied one source, L2-resident below ~50 MB)

A timing diagnosis, not a test: the floor kernels' results are not checked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from attention_prefill import BS, DT, KVH, SCALE, D, H  # noqa: E402
from bench_attention import copy_bandwidth, decode_inputs, graph_ms  # noqa: E402

from volundr.kernels import pdl  # noqa: E402
from volundr.kernels.attention.decode import (  # noqa: E402
    _num_sms,
    choose_splits,
    paged_decode_attention,
)


@triton.jit
def _load_floor_kernel(k_ptr, v_ptr, bt_ptr, ws_ptr, L, split_len,
                       stride_kb, stride_ks, stride_kh, stride_bt,
                       BS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                       PAGED: tl.constexpr):
    """Program (n, kvh, split): K and V rows of tokens sp * split_len .. + split_len, XOR-ed.
    PAGED: rows through the block table (as the split kernel), else row t of sequence n in
    block bt[0, 0] + n L / BS + t / BS (tables in order: no table load per tile). H200 runs 63
    and 64 predate the bt[0, 0] offset: their 1-hop rows read the same blocks at every call
    (L2-resident at 4K and 32K, void there)."""
    pdl.trigger()
    pdl.wait()
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    start = sp * split_len
    end = tl.minimum(start + split_len, L)
    offs_d = tl.arange(0, D)  # D: all KV heads' row (KVH * 128) with the grid's kvh dim 1
    acc = tl.zeros([BLOCK_N, D], tl.int16)
    base = tl.load(bt_ptr)  # not PAGED: the call's first block (tables in order)
    for s in range(start, end, BLOCK_N):
        offs_n = s + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        if PAGED:
            page = tl.load(bt_ptr + n.to(tl.int64) * stride_bt + offs_n // BS, mask=nmask,
                           other=0).to(tl.int64)
        else:
            page = (base + n * (L // BS) + offs_n // BS).to(tl.int64)
        off = page[:, None] * stride_kb + (offs_n % BS)[:, None] * stride_ks \
            + kvh * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + off, mask=nmask[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=nmask[:, None], other=0.0)
        acc ^= k.to(tl.int16, bitcast=True) ^ v.to(tl.int16, bitcast=True)
    r = tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0)
    tl.store(ws_ptr + (n * tl.num_programs(1) + kvh) * tl.num_programs(2) + sp, r)


def load_floor(kc, vc, bt, B, L, paged, ws, block_n=64, num_warps=4, num_stages=5,
               both_heads=False):
    """both_heads: a program reads every KV head's part of its rows (whole rows, KVH x 256
    contiguous bytes), over twice as many splits of half the length: the same bytes and
    programs, but no row read half by one program and half by another."""
    splits = choose_splits(B, KVH, L, _num_sms(0))
    split_len = triton.cdiv(triton.cdiv(L, splits), block_n) * block_n
    heads, d = (1, KVH * D) if both_heads else (KVH, D)
    if both_heads:
        splits, split_len = splits * KVH, split_len // KVH
    _load_floor_kernel[(B, heads, splits)](
        kc, vc, bt, ws, L, split_len, kc.stride(0), kc.stride(1), kc.stride(2), bt.stride(0),
        BS=BS, D=d, BLOCK_N=block_n, PAGED=paged, num_warps=num_warps, num_stages=num_stages,
        launch_pdl=pdl.ON.value)


def run(B: int, L: int, bw: float) -> list[dict]:
    kv_bytes = B * L * KVH * D * 2 * 2
    R = max(1, min(64, math.ceil((512 << 20) / kv_bytes)))
    q, kc, vc, bts, cu, ctx = decode_inputs(B, L, R)
    nb = B * L // BS
    ordered = [torch.arange(r * nb, (r + 1) * nb, device="cuda", dtype=torch.int32)
               .view(B, L // BS) for r in range(R)]
    ws = torch.empty(B * KVH * 512, device="cuda", dtype=torch.int16)
    # contiguous K/V per call for SDPA: [B, KVH, L, D] (the same bytes, no paging)
    kd = [torch.randn(B, KVH, L, D, device="cuda", dtype=DT) for _ in range(R)]
    vd = [torch.randn_like(t) for t in kd]
    q4 = q.view(B, H, 1, D)
    nd = max(2, min(R, (1 << 30) // kv_bytes))  # rotating copies: > L2 in all
    src = [torch.randn(kv_bytes // 2, device="cuda", dtype=DT) for _ in range(nd)]
    dst = [torch.empty_like(t) for t in src]

    def sdpa():
        return [F.scaled_dot_product_attention(q4, kd[r], vd[r], scale=SCALE, enable_gqa=True)
                for r in range(R)]

    variants = {
        "kernel": lambda: [paged_decode_attention(q, kc, vc, bt, cu, ctx, SCALE, L)
                           for bt in bts],
        "load": lambda: [load_floor(kc, vc, bt, B, L, True, ws) for bt in bts],
        "load 1-hop": lambda: [load_floor(kc, vc, bt, B, L, False, ws) for bt in ordered],
        "load ordered": lambda: [load_floor(kc, vc, bt, B, L, True, ws) for bt in ordered],
        "load both heads": lambda: [load_floor(kc, vc, bt, B, L, True, ws, both_heads=True)
                                    for bt in bts],
        "load both heads, ordered": lambda: [load_floor(kc, vc, bt, B, L, True, ws,
                                                        both_heads=True) for bt in ordered],
        "sdpa": sdpa,
    }
    rows = []
    for name, fn in variants.items():
        try:
            us = graph_ms(fn) / R * 1e3
        except Exception as e:  # an SDPA backend refusing the shape, say
            rows.append(dict(batch=B, context=L, variant=name, failed=str(e)[:300]))
            print(f"B={B} L={L} {name}: FAILED {str(e)[:120]}", flush=True)
            continue
        rows.append(dict(batch=B, context=L, variant=name, us=us, bytes=kv_bytes,
                         frac_of_copy=kv_bytes / (us * 1e-6) / bw))
    us = graph_ms(lambda: [dst[i % nd].copy_(src[i % nd]) for i in range(R)]) / R * 1e3
    rows.append(dict(batch=B, context=L, variant="copy", us=us, bytes=kv_bytes,
                     frac_of_copy=2 * kv_bytes / (us * 1e-6) / bw))
    print(f"B={B:2d} L={L:6d} " + "  ".join(
        f"{r['variant']} {r['us']:.1f} us ({r['frac_of_copy']:.2f})" for r in rows
        if "us" in r), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="decode_floor.json")
    ap.add_argument("--batches", type=lambda t: [int(v) for v in t.split(",")], default=[1, 16])
    ap.add_argument("--contexts", type=lambda t: [int(v) for v in t.split(",")],
                    default=[4096, 32768, 131072, 262144])
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    rows = [r for B in args.batches for L in args.contexts for r in run(B, L, bw)]
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bytes_per_s=bw, rows=rows), f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
