"""Batch M = 2..16 (decode of up to 16 sequences) mixed-bit matmul on the tensor cores.

y [M, N] = x [M, K] @ W^T for the kernel layout of pack.py, bf16 x (`supported`). The
dequantisation and the scale/zero algebra are gemv_tc's (M = 1): one LOP3 turns two codes of a
word into a bf16x2 pair (128 + q_lo 2^o, 128 + q_hi 2^o), exact; x' = x 2^-o (exact); each
group adds s (F - B - z X), F = sum of pair x' products (mma, fp32 accumulation), B = sum 128 x',
X = sum x. What changes is the mma's role: here the weights are the A operand
[16 output rows x 16 k] and x^T is the real B operand [16 k x 8 sequences], so one dequantised
pair feeds T = ceil(M / 8) mma tiles (8 sequences each) and the dequantisation cost per weight
(~1 instruction) is shared by all M rows instead of paid per row.

Fragments (mma.m16n8k16, lane = 4 g + c, g = quad % 8). Lane (c, quad) loads 4 words j (one
128-bit load: output rows 4 quad + j) of word row r = c NS + s of the current group, s = step
(NS = WA / 4 steps per group). Its words 2t, 2t + 1 are A rows g, g + 8 of mma tile t, and two
pairs of each are its k columns 2c, 2c + 1, 2c + 8, 2c + 9; so column 2c of every A row is the
same k (word row r_c, pair 2m) and B rows 2c, 2c + 1 must hold x at that k: lane (c, g)
supplies x'[8u + g, k] (B column g of batch tile u), loaded per lane (x rows >= M load zeros).
The D fragment of tile t, batch tile u: (row 4 quad + 2t, sequence 8u + 2c), (same row,
8u + 2c + 1), (row 4 quad + 2t + 1, 8u + 2c), (..., 8u + 2c + 1): each lane ends with full
(row, sequence) sums, the mma has summed the 4 lanes' k; no shuffles, and the per-row scale and
zero are the lane's own words' rows. B and X come from one more mma per step and batch tile with
a constant A (rows g: 2^o, rows g + 8: 128), as in gemv_tc; D then holds X and B of sequences
8u + 2c, 8u + 2c + 1 in the lane that needs them.

Tensors are shaped [4, Q, L, 4] = (c, quad, rep, j) as in gemv_tc (same layout argument: j in
registers, c on lane bits 0-1, quads on lane bits 2-4 and warps); the partial sums are 2T such
tensors F[u][h] (sequence 8u + 2c + h, element j = row 4 quad + j); x pair tensors are
[4, Q, 1, 4], step s at element s (NS = 4) or 2s, 2s + 1 (NS = 2: loaded as [4, Q, 1, 2]
and widened in registers). Under TRITON_INTERPRET=1 (no PTX) the kernel runs a pure-Triton twin
(`USE_ASM=False`): the same words and pairs per lane (3-bit with the same per-lane shifts), the
mma's sum over a quad's 4 lanes as a 5-D broadcast with its own x loads, X and B as plain sums.

Per group and lane (G = 128, L reps): 128 L weights dequantised by ~0.66 (2-bit), 0.97 (3-bit),
0.91 (4-bit) SASS instructions each (sm_90, main loop), then 3 FP instructions per (row,
sequence) for the scale/zero algebra (timings: perf/kernels/bench_quant.py --m16-compare).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from volundr.kernels.quant.gemv import _workspace, split_k, sum_splits
from volundr.kernels.quant.gemv_tc import (
    _dequant_ptx,
    _hi,
    _interpreting,
    _lane_rows,
    _ld,
    _ldx,
    _lo,
    _mma,
    _plan_consts,
    _xsum_a,
    _xsum_slot,
    asm_pairs,
    n_pair_tensors,
    xsum_consts,
)

MAX_M = 16


# ---- inline PTX ------------------------------------------------------------------------------
def step_operands(bits: int, t_tiles: int) -> dict[str, int]:
    """$-indices of asm_step16's operand groups (pack = 4, 4 registers per tensor)."""
    n_f = 2 * t_tiles  # F tensors, index 2u + h
    words = 4 * n_f + 4 * n_f  # after outputs and C
    shifts = words + (8 if bits == 3 else 4)  # 3-bit: the two per-lane B shift amounts
    x = shifts + (8 if bits == 3 else 0)
    return dict(n_f=n_f, c=4 * n_f, words=words, shifts=shifts, x=x,
                total=x + 4 * t_tiles * n_pair_tensors(bits))


def asm_step16(bits: int, s: int, t_tiles: int, e: int | None = None) -> str:
    """One step s (word row c NS + s of lane c) for one lane's 4 words, pack = 4. Operands:
    out F[2u + h] ($4 (2u + h) + j: row 4 quad + j, sequence 8u + 2c + h), then C (same order),
    the 4 words (3-bit: then their B words, then the left shift (1 or 2) and right shift (1 or 0)
    that put the lane's high bits where the even / odd slot merges want them: first- and
    second-half word rows of a group differ), then the x pair tensors (u, p) (4 operands each:
    element e holds step s; e = s unless given)."""
    e = s if e is None else e
    op = step_operands(bits, t_tiles)
    npt = n_pair_tensors(bits)
    lines, regs = ["{"], []
    pairs = []
    for j in range(4):
        w = f"${op['words'] + j}"
        if bits == 3:
            b = f"${op['words'] + 4 + j}"
            # variable shifts: same count as gemv_tc's fixed ones, one asm for both halves
            lines += [f"shl.b32 b{j}e, {b}, ${op['shifts'] + j};",
                      f"shr.u32 b{j}o, {b}, ${op['shifts'] + 4 + j};"]
            regs += [f"b{j}e", f"b{j}o"]
            pairs.append(_dequant_ptx(3, [w, f"b{j}e", f"b{j}o"], f"u{j}", lines, regs))
        else:
            pairs.append(_dequant_ptx(bits, [w], f"u{j}", lines, regs))
    for t in range(2):
        pa, pb = pairs[2 * t], pairs[2 * t + 1]
        for u in range(t_tiles):
            # D regs: (word 2t, seq 2c), (word 2t, 2c + 1), (word 2t + 1, 2c), (.., 2c + 1)
            f0, f1 = 4 * (2 * u), 4 * (2 * u + 1)
            d = [f"${f0 + 2 * t}", f"${f1 + 2 * t}", f"${f0 + 2 * t + 1}", f"${f1 + 2 * t + 1}"]
            c = [f"${op['c'] + int(r[1:])}" for r in d]
            for m in range(npt // 2):
                a = [pa[2 * m], pb[2 * m], pa[2 * m + 1], pb[2 * m + 1]]
                xb = [f"${op['x'] + 4 * (u * npt + p) + e}" for p in (2 * m, 2 * m + 1)]
                lines.append(_mma(d, a, xb, c if m == 0 else d))
    lines.insert(1, f".reg .b32 {', '.join(regs)};")
    lines.append("}")
    return "\n".join(lines)


def asm_xsum16(bits: int, e: int) -> str:
    """Group sums of one batch tile for one step, pack = 4: $0, $1 = X of sequences 8u + 2c,
    8u + 2c + 1, $2, $3 = B of the same, accumulated onto C = $4..$7, from element e (the
    step's) of the x pair tensors ($24 + 4 p + e) with gemv_tc's constant A ($8 + 4 r + slot,
    `xsum_consts`)."""
    lines = ["{"]
    d = ["$0", "$1", "$2", "$3"]
    for m in range(n_pair_tensors(bits) // 2):
        a = [f"${8 + 4 * r + _xsum_slot(bits, m)}" for r in range(4)]
        b = [f"${24 + 4 * (2 * m) + e}", f"${24 + 4 * (2 * m + 1) + e}"]
        lines.append(_mma(d, a, b, ["$4", "$5", "$6", "$7"] if m == 0 else d))
    lines.append("}")
    return "\n".join(lines)


@functools.cache
def kernel_consts(bits: int, t_tiles: int, ns: int) -> dict:
    """Constexpr tables and PTX of the kernel for a bit width, batch tile count and steps per
    group (ns = 2: step s sits at elements 2s, 2s + 1 of the x pair tensors)."""
    sh, msk, offs = _plan_consts(bits)
    npt = n_pair_tensors(bits)
    op = step_operands(bits, t_tiles)
    n_f = op["n_f"]
    return dict(SH=sh, MSK=msk, OFFS=offs,
                ASM_STEP=tuple(asm_step16(bits, s, t_tiles, s * (4 // ns)) for s in range(ns)),
                ASM_XSUM=tuple(asm_xsum16(bits, s * (4 // ns)) for s in range(ns)),
                ASM_PAIRS=tuple(asm_pairs(o) for o in range(8)),
                CONS_STEP=",".join(["=f"] * (4 * n_f) + ["f"] * (4 * n_f)
                                   + ["r"] * (op["total"] - op["words"])),
                CONS_XSUM=",".join(["=f"] * 4 + ["f"] * 4 + ["r"] * (16 + 4 * npt)),
                XS=xsum_consts(bits),
                ASM_KEEP=tuple(f"mov.b32 $0, $1; // a{r}" for r in range(4)))


# ---- pure-Triton twin (TRITON_INTERPRET=1) ---------------------------------------------------
@triton.jit
def _twin_xsums(x_ptr, grp, M, K, up_off, u: tl.constexpr, h: tl.constexpr, G: tl.constexpr,
                WA: tl.constexpr, NP: tl.constexpr, OFFS: tl.constexpr, SWIGLU: tl.constexpr):
    """X = sum x and B = sum 128 x' (x' = x 2^-o of the slot's pair) over group grp for the
    sequence 8u + 2c + h of lane c: [4, 1, 1, 1] each (what the X/B mma sums)."""
    kk = tl.arange(0, G)
    pk = (kk // WA) % NP  # pair of the slot of k
    sck = tl.full([G], 1.0, tl.float32)
    for p in tl.static_range(NP):
        sck = tl.where(pk == p, 1.0 / (1 << OFFS[p]), sck)
    row = 8 * u + 2 * tl.arange(0, 4) + h
    xt = _ldx(x_ptr + row[:, None] * K + grp * G + kk[None, :], up_off, row[:, None] < M,
              True, SWIGLU).to(tl.float32)
    xs = tl.reshape(tl.sum(xt, axis=1), (4, 1, 1, 1))
    bs = tl.reshape(tl.sum(xt * sck[None, :], axis=1) * 128.0, (4, 1, 1, 1))
    return xs, bs


@triton.jit
def _twin_group(f0, f1, f2, f3, x_ptr, qa_ptr, qb_ptr, grp, n, wmask, c4, sh_e, sh_o, M, N, K,
                up_off, SWIGLU: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                WA: tl.constexpr, NS: tl.constexpr,
                NP: tl.constexpr, T: tl.constexpr, SH: tl.constexpr, MSK: tl.constexpr,
                OFFS: tl.constexpr, EVEN: tl.constexpr):
    """One group's F sums, elementwise: each lane's words and pairs as in the asm (lane c: word
    row c NS + s; 3-bit: the per-lane B shifts), then the mma's sum over the 4 lanes cp of a
    quad, F[2u + h][c] = sum_cp pairs[cp] . x'[8u + 2c + h, k(cp)], as a 5-D broadcast
    (dims (c, cp, quad, rep, j))."""
    c5 = tl.arange(0, 4)[:, None, None, None, None]
    cp5 = tl.arange(0, 4)[None, :, None, None, None]
    for s in tl.static_range(NS):
        r = c4 * NS + s  # [4, 1, 1, 1]: the lane's word row
        w = _ld(qa_ptr + (grp * WA + r) * N + n, wmask, not EVEN)
        if BITS == 3:
            b = _ld(qb_ptr + (grp * (WA // 2) + r % (WA // 2)) * N + n, wmask, not EVEN)
            m = 0x33333333
            e = (w & m) | ((b << sh_e) & ~m)
            o = ((w >> 2) & m) | ((b >> sh_o) & ~m)
        for p in tl.static_range(NP):
            if BITS == 3:
                if p % 2 == 0:
                    src = e
                else:
                    src = o
            else:
                src = w
            if SH[p] > 0:
                src = src >> SH[p]
            pr = (src & MSK[p]) | 0x43004300
            fl = _lo(pr)[None, :, :, :, :]  # [1, 4 (cp), Q, L, 4]
            fh = _hi(pr)[None, :, :, :, :]
            sc: tl.constexpr = 1.0 / (1 << OFFS[p])
            xk = x_ptr + grp * G + p * WA + cp5 * NS + s  # x of the pair's low slot
            for u in tl.static_range(T):
                for h in tl.static_range(2):
                    row = 8 * u + 2 * c5 + h  # [4 (c), 1, 1, 1, 1]
                    xl = _ldx(xk + row * K, up_off, row < M, True, SWIGLU).to(tl.float32)
                    xh = _ldx(xk + NP * WA + row * K, up_off, row < M, True,
                              SWIGLU).to(tl.float32)
                    prod = tl.sum(fl * (xl * sc) + fh * (xh * sc), axis=1)  # [4, Q, L, 4]
                    if 2 * u + h == 0:
                        f0 += prod
                    elif 2 * u + h == 1:
                        f1 += prod
                    elif 2 * u + h == 2:
                        f2 += prod
                    else:
                        f3 += prod
    return f0, f1, f2, f3


# ---- the kernel ------------------------------------------------------------------------------
@triton.jit
def _pick(v, e, j4):
    """Element e of a [4, Q, 1, 4] tensor -> [4, Q, 1, 1]."""
    return tl.sum(tl.where(j4 == e, v, 0.0), axis=3, keep_dims=True)


@triton.jit
def _store(y_ptr, ws_ptr, pid_k, v, u: tl.constexpr, h: tl.constexpr, c4, n, nmask, M, N,
           SPLIT_K: tl.constexpr):
    """F/acc tensor of sequence 8u + 2c + h -> y[seq, n] (or the split's workspace slice)."""
    row = 8 * u + 2 * c4 + h
    mask = nmask & (row < M)
    if SPLIT_K:
        tl.store(ws_ptr + (pid_k.to(tl.int64) * M + row) * N + n, v, mask=mask)
    else:
        tl.store(y_ptr + row * N + n, v.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce(y_ptr, ws_ptr, num_splits, u: tl.constexpr, h: tl.constexpr, c4, n, nmask, M, N,
            shape_like):
    row = 8 * u + 2 * c4 + h
    mask = nmask & (row < M)
    tot = sum_splits(ws_ptr + row * N + n, M * N, num_splits, mask, shape_like)
    tl.store(y_ptr + row * N + n, tot.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm_tc_kernel(x_ptr, qa_ptr, qb_ptr, sz_ptr, y_ptr, ws_ptr, cnt_ptr,
                   M, N, K, num_groups, groups_per_split, num_splits, stride_xm, up_off,
                   BITS: tl.constexpr, G: tl.constexpr, WA: tl.constexpr, L: tl.constexpr,
                   Q: tl.constexpr, T: tl.constexpr, SPLIT_K: tl.constexpr,
                   USE_ASM: tl.constexpr, SH: tl.constexpr, MSK: tl.constexpr,
                   OFFS: tl.constexpr, ASM_STEP: tl.constexpr, ASM_XSUM: tl.constexpr,
                   ASM_PAIRS: tl.constexpr, CONS_STEP: tl.constexpr, CONS_XSUM: tl.constexpr,
                   XS: tl.constexpr, ASM_KEEP: tl.constexpr, EVEN: tl.constexpr,
                   SWIGLU: tl.constexpr = False, STAGES: tl.constexpr = 1):
    """Grid (cdiv(N, BN), num_splits), BN = 4 L Q; one warp per 8 quads (Q = 8 num_warps).
    Program (n tile, split) sums groups g0 .. g1 - 1 for its BN output rows and all M <= 8 T
    sequences (T = 1 or 2 batch tiles of 8). x row m at x_ptr + m stride_xm; SWIGLU: x =
    SiLU(gate) * up, up at + up_off (x holds the gate_up output)."""
    BN: tl.constexpr = 4 * L * Q
    S: tl.constexpr = 32 // (4 if BITS == 4 else 2)  # slots per A word
    NP: tl.constexpr = S // 2  # pairs per A word
    NS: tl.constexpr = WA // 4  # steps per group (lane c: word rows c NS .. c NS + NS - 1)
    # N % 4 == 0 (`supported`), told to the compiler: with N not a multiple of 16 it would
    # otherwise not know that a lane's 4 words are one aligned 16-byte run under one mask bit,
    # and the ragged-N loads would pick a 2-wide layout that breaks the mma fragments (wrong
    # results at NS = 2 steps per group, 2/3-bit and 4-bit G = 64, on the H200 2026-12-03)
    N = (N // 4) * 4
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    c4, q4, j4, n, nmask = _lane_rows(pid_n, N, BN, Q, L)  # fragment layout (gemv_tc)
    if EVEN:  # N % BN == 0: no masks on the words (a masked load also zeroes registers)
        wmask = c4 >= 0
    else:
        wmask = nmask & (c4 >= 0)
    zero = tl.zeros([4, Q, L, 4], dtype=tl.float32)
    a0 = zero
    a1 = zero
    a2 = zero
    a3 = zero
    ka = ()
    if USE_ASM:
        ka = _xsum_a(j4, XS, ASM_KEEP, Q)
    # 3-bit: lanes c >= 2 hold word rows of the group's second half (their high bits sit one
    # position lower in the B word): per-lane shift amounts for the even / odd slot merges
    hsec = (c4 >= 2).to(tl.int32) + tl.zeros([4, Q, 1, 4], dtype=tl.int32)
    sh_e = 1 + hsec
    sh_o = 1 - hsec
    # B operand rows: lane (c, quad) supplies sequence 8u + quad % 8 at its k (x rows >= M load
    # zeros)
    xrow = q4 % 8  # [1, Q, 1, 1]
    # x loads [4, Q, 1, NS] (an NS-wide contiguous run per lane: a [.., 4] load masked to NS
    # elements would get a layout of its own and cost shuffles), widened to 4 elements after
    # the pair build
    js = tl.arange(0, NS)[None, None, None, :]
    xoff = c4 * NS + js  # [4, 1, 1, NS]: word row c NS + s of the group
    g0 = pid_k * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, num_groups)
    for grp in tl.range(g0, g1, num_stages=STAGES):
        f0 = zero
        f1 = zero
        f2 = zero
        f3 = zero
        if USE_ASM:
            xb0 = tl.zeros([4, Q, 1, 4], dtype=tl.float32)
            xb1 = tl.zeros([4, Q, 1, 4], dtype=tl.float32)
            # x pair tensors (u, p) [4, Q, 1, 4], element = step
            xps0 = ()
            xps1 = ()
            for u in tl.static_range(T):
                xm = ((xrow + 8 * u) < M) & (c4 >= 0) & (js >= 0)
                xg = x_ptr + (xrow + 8 * u) * stride_xm + grp * G + xoff  # [4, Q, 1, NS]
                for p in tl.static_range(NP):
                    xlo = _ldx(xg + p * WA, up_off, xm, True, SWIGLU)
                    xhi = _ldx(xg + (p + NP) * WA, up_off, xm, True, SWIGLU)
                    pr = tl.inline_asm_elementwise(ASM_PAIRS[OFFS[p]], "=r,=r,r,r", [xlo, xhi],
                                                   dtype=tl.int32, is_pure=True, pack=2)
                    if NS == 2:  # step s at elements 2s, 2s + 1 (registers: no data movement)
                        pr = tl.reshape(tl.broadcast_to(pr[:, :, :, :, None], (4, Q, 1, 2, 2)),
                                        (4, Q, 1, 4))
                    if u == 0:
                        xps0 = xps0 + (pr,)
                    else:
                        xps1 = xps1 + (pr,)
            for s in tl.static_range(NS):
                r = c4 * NS + s  # [4, 1, 1, 1]: the lane's word row
                w = _ld(qa_ptr + (grp * WA + r) * N + n, wmask, not EVEN)
                if BITS == 3:
                    b = _ld(qb_ptr + (grp * (WA // 2) + r % (WA // 2)) * N + n, wmask, not EVEN)
                    words = (w, b, sh_e, sh_o)
                else:
                    words = (w,)
                if T == 2:
                    f0, f1, f2, f3 = tl.inline_asm_elementwise(
                        ASM_STEP[s], CONS_STEP, (f0, f1, f2, f3) + words + xps0 + xps1,
                        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
                        pack=4)
                    xb1 = tl.inline_asm_elementwise(ASM_XSUM[s], CONS_XSUM, (xb1,) + ka + xps1,
                                                    dtype=tl.float32, is_pure=True, pack=4)
                else:
                    f0, f1 = tl.inline_asm_elementwise(
                        ASM_STEP[s], CONS_STEP, (f0, f1) + words + xps0,
                        dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
                xb0 = tl.inline_asm_elementwise(ASM_XSUM[s], CONS_XSUM, (xb0,) + ka + xps0,
                                                dtype=tl.float32, is_pure=True, pack=4)
            # D of the X/B mma: elements 0, 1 = X of sequences 2c, 2c + 1 (+ 8u), 2, 3 = B
            xs0 = _pick(xb0, 0, j4)
            xs1 = _pick(xb0, 1, j4)
            bs0 = _pick(xb0, 2, j4)
            bs1 = _pick(xb0, 3, j4)
            xs2 = _pick(xb1, 0, j4)
            xs3 = _pick(xb1, 1, j4)
            bs2 = _pick(xb1, 2, j4)
            bs3 = _pick(xb1, 3, j4)
        else:
            f0, f1, f2, f3 = _twin_group(f0, f1, f2, f3, x_ptr, qa_ptr, qb_ptr, grp, n, wmask,
                                         c4, sh_e, sh_o, M, N, stride_xm, up_off, SWIGLU, BITS, G,
                                         WA, NS, NP, T, SH, MSK, OFFS, EVEN)
            xs0, bs0 = _twin_xsums(x_ptr, grp, M, stride_xm, up_off, 0, 0, G, WA, NP, OFFS,
                                   SWIGLU)
            xs1, bs1 = _twin_xsums(x_ptr, grp, M, stride_xm, up_off, 0, 1, G, WA, NP, OFFS,
                                   SWIGLU)
            xs2, bs2 = _twin_xsums(x_ptr, grp, M, stride_xm, up_off, 1, 0, G, WA, NP, OFFS,
                                   SWIGLU)
            xs3, bs3 = _twin_xsums(x_ptr, grp, M, stride_xm, up_off, 1, 1, G, WA, NP, OFFS,
                                   SWIGLU)
        # (n broadcast over c: a [1, Q, L, 4] load would get a layout of its own and cost a
        # layout conversion of every accumulator per group)
        szw = _ld(sz_ptr + grp * N + tl.broadcast_to(n, (4, Q, L, 4)), wmask, not EVEN)
        sc = (szw << 16).to(tl.float32, bitcast=True)
        zr = (szw & -65536).to(tl.float32, bitcast=True)
        a0 += sc * (f0 - (bs0 + zr * xs0))
        a1 += sc * (f1 - (bs1 + zr * xs1))
        if T == 2:
            a2 += sc * (f2 - (bs2 + zr * xs2))
            a3 += sc * (f3 - (bs3 + zr * xs3))
    _store(y_ptr, ws_ptr, pid_k, a0, 0, 0, c4, n, nmask, M, N, SPLIT_K)
    _store(y_ptr, ws_ptr, pid_k, a1, 0, 1, c4, n, nmask, M, N, SPLIT_K)
    if T == 2:
        _store(y_ptr, ws_ptr, pid_k, a2, 1, 0, c4, n, nmask, M, N, SPLIT_K)
        _store(y_ptr, ws_ptr, pid_k, a3, 1, 1, c4, n, nmask, M, N, SPLIT_K)
    if SPLIT_K:
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == num_splits - 1:  # the last split of this tile sums all partials
            _reduce(y_ptr, ws_ptr, num_splits, 0, 0, c4, n, nmask, M, N, zero)
            _reduce(y_ptr, ws_ptr, num_splits, 0, 1, c4, n, nmask, M, N, zero)
            if T == 2:
                _reduce(y_ptr, ws_ptr, num_splits, 1, 0, c4, n, nmask, M, N, zero)
                _reduce(y_ptr, ws_ptr, num_splits, 1, 1, c4, n, nmask, M, N, zero)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch


def supported(x: torch.Tensor, bits: int, group_size: int, n: int) -> bool:
    """Whether gemm_tc handles this call: 2 <= M <= 16, bf16 x, N a multiple of 4 (128-bit
    word loads), a group of 8 or 16 A rows (4-bit G = 64, 128; 2/3-bit G = 128)."""
    pa = 4 if bits == 4 else 2
    wa = group_size * pa // 32
    return (x.dim() == 2 and 2 <= x.shape[0] <= MAX_M and x.dtype == torch.bfloat16
            and n % 4 == 0 and wa in (8, 16))


def gemm_tc(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor, bits: int,
            group_size: int, out: torch.Tensor | None = None, reps: int = 2,
            num_warps: int = 1, waves: float = 16.0, splits: int | None = None,
            swiglu: bool = False, stages: int = 1) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T, 2 <= M <= 16, x bf16 with unit stride along K (any row
    stride); out (optional) [M, N] bf16 or fp32, contiguous. swiglu: x [M, 2K] holds (gate, up)
    and y = (SiLU(gate) * up) @ W^T, the SwiGLU fused into the x loads.

    reps: 32-row slabs per warp (BN = 32 reps num_warps rows per program); split-K over groups
    to about `waves` programs per SM (or `splits`). stages > 1: the group loop software-
    pipelined by Triton (weights through shared memory by cp.async, as gemv_tc's `stages`)."""
    m, k = x.shape
    k = k // 2 if swiglu else k
    n = qa.shape[1]
    assert x.stride(1) == 1 and supported(x, bits, group_size, n), (x.shape, x.dtype, bits)
    pa = 4 if bits == 4 else 2
    wa = group_size * pa // 32
    num_groups = k // group_size
    q = 8 * num_warps
    bn = 4 * reps * q
    n_tiles = triton.cdiv(n, bn)
    t_tiles = 1 if m <= 8 else 2
    gps, ns = split_k(n_tiles, num_groups, x.device, waves, splits)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.is_contiguous()
    if ns > 1:
        ws, cnt = _workspace(x.device, n_tiles, ns * m * n)
    else:
        ws, cnt = out, out
    gemm_tc_kernel[(n_tiles, ns)](
        x, qa, qb if qb.numel() else qa, sz, out, ws, cnt, m, n, k, num_groups, gps, ns,
        x.stride(0), k, BITS=bits, G=group_size, WA=wa, L=reps, Q=q, T=t_tiles, SPLIT_K=ns > 1,
        USE_ASM=not _interpreting(), EVEN=n % bn == 0,
        **kernel_consts(bits, t_tiles, wa // 4), SWIGLU=swiglu, STAGES=stages,
        num_warps=num_warps)
    return out
