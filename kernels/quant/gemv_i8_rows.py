"""gemv_i8 for 2-16 rows of x: the rows in the integer mma's N, one group per mma.

For M = 2..16 rows the engine's path was gemm_tc (bf16 tensor-core GEMM), ~1.6-2x the one-row
gemv_i8 per weight and nearly flat in M (perf/RESULTS.md session 26: a speculative check of 5 rows
took 2.1x a decode step on Volundr-32B); this kernel is since session 27. gemv_i8 (M = 1) gives each
lane column c of the mma's K its own group c, so the 8 columns of B hold 4 groups x 2 digits of one
x row, block-diagonal: a second row of x costs a second mma (session 26's first gemv_i8_rows did
that, and ran out of registers from 4 rows on).

Here the 4 lane columns share one group g: lane (quad, c) takes word rows 4c..4c + 3 of g's A
plane at 4 bits and rows c, 4 + c at 2 and 3 bits (3-bit: both share B-plane row c), so one mma
sums over 32 inputs of g, and B's column 2 r + d holds digit d of x row r (B lane (quad, c)
supplies row quad // 2's digit quad % 2 for lane c's word rows: the digits layout is gemv_i8's,
read at those rows). D lane (quad, c) then holds row c's (d1, d0) sums for its output rows:

    acc[r, n] += s[n, g] (sx[r, g] (128 S1 + S0) - z[n, g] sx[r, g] sum xi[r, g])

after every group. Four rows of x cost what one does (the same mmas and masks per weight as
gemv_i8, gemv_i8.consts' PTX steps, fed other registers); each further 4 rows add the mmas and
the fold (RB blocks of 4 rows, sequential inside a group). y = x W^T (or the SwiGLU of x's
halves first, as gemv_i8's digits do), optionally with the residual add + next RMSNorm per row
in the epilogue or the norm's 1 / rms per row (`_epilogue`). The naive reference is
naive.naive_quant_matmul; tests/test_gemv_i8_rows.py emulates these lanes on the CPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.quant.digits import nb, plane_rows, x_digits
from volundr.kernels.quant.gemv import _workspace, split_k, sum_splits
from volundr.kernels.quant.gemv_i8 import asm_pair4, asm_step2m, asm_step3m, tiles
from volundr.kernels.quant.gemv_tc import _lane_rows, _ld, residual_h

MAX_ROWS = 16
# reps (BN = 32 reps), programs per SM, groups per loop trip: up to 4 rows (one B) and beyond
# (H100 run 116, diag_gemv_rows at 17408x5120 4 / 2-bit and 5120x17408 3-bit: the best of 4
# configs or within 3% of it, but 2-bit at 5-8 rows, where the 4-row config is best)
FEW = dict(reps=2, waves=16.0, unroll=1)
MANY = dict(reps=2, waves=8.0, unroll=2)
# per (N, K, bits) where another config measured faster above 4 rows (H100 run 121, an MLP's
# gate_up: 544 tiles of 64 rows fill the SMs at waves 8 without split-K, 4 programs an SM): 3-bit
# 8 rows 40.2 vs 52.6 us, 16 rows 56.4 vs 68.8; 2-bit 16 rows 47.2 vs 62.1 (8 rows: FEW, 31.5)
SHAPE_CONFIG = {(34816, 5120, 3): dict(reps=4, waves=8.0, unroll=1),
                (34816, 5120, 2): dict(reps=4, waves=8.0, unroll=1)}
# 4-bit up to 4 rows, each trip's words loaded during the one before (H100 runs 126-127 at
# 15680x5120, 5120x17408 and 17408x5120, 2 and 4 rows: 19.1-22.6 vs FEW's 20.7-25.5 us; at 8
# rows within 2% of MANY, at 2 and 3 bits no better); 2 groups a trip: K / 128 even
FEW4 = dict(reps=2, waves=8.0, unroll=2, prefetch=True)


def config(bits: int, m: int, n: int = 0, k: int = 0) -> dict:
    """gemv_i8_rows's keyword arguments for m rows of x at `bits` against an N x K weight."""
    if m <= 4 and bits == 4 and k % (FEW4["unroll"] * 128) == 0:
        return dict(FEW4)
    if m <= 4 or (bits == 2 and m <= 8):
        return dict(FEW)
    return dict(SHAPE_CONFIG.get((n, k, bits), MANY))


@functools.cache
def consts(bits: int) -> dict:
    """The PTX steps of one lane's word rows of a group (gemv_i8's, their B operands renumbered
    for 2 digit tensors at 2 and 3 bits) and the constraint string."""
    if bits == 4:  # rows 4c + 2p, 4c + 2p + 1 per pair p; B tensor p at $40 + 4p
        return dict(ASM_STEP=(asm_pair4(0), asm_pair4(1)),
                    CONS=",".join(["=r"] * 16 + ["r"] * 32))
    if bits == 2:  # rows c, 4 + c: steps "0" and "1" read B tensors 0 and 1 at $36, $40
        return dict(ASM_STEP=(asm_step2m(0), asm_step2m(1)),
                    CONS=",".join(["=r"] * 16 + ["r"] * 28))
    # 3-bit: row c is block 0's step, row 4 + c block 1's (its B-plane bit one lower)
    return dict(ASM_STEP=(asm_step3m(0, 0), asm_step3m(1, 1)),
                CONS=",".join(["=r"] * 16 + ["r"] * 32))


@triton.jit
def _group_sums(ws, bws, xbs, BITS: tl.constexpr, NB: tl.constexpr, Q: tl.constexpr,
                L: tl.constexpr, ASM_STEP: tl.constexpr, CONS: tl.constexpr):
    """One group's int32 sums (S1, S0) [4, Q, L, 4] of a lane's word rows ws against the digits
    xbs (2 tensors), 3-bit's B-plane row bws."""
    s1 = tl.zeros([4, Q, L, 4], dtype=tl.int32)  # x 1 codes' sums against d1, d0
    s0 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
    t1 = tl.zeros([4, Q, L, 4], dtype=tl.int32)  # scaled codes' (16 q or 4 q)
    t0 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
    for i in tl.static_range(2):
        if BITS == 4:
            args = (s1, s0, t1, t0, ws[2 * i], ws[2 * i + 1]) + xbs
        elif BITS == 2:
            args = (s1, s0, t1, t0, ws[i]) + xbs
        else:
            args = (s1, s0, t1, t0, ws[i], bws) + xbs
        s1, s0, t1, t0 = tl.inline_asm_elementwise(
            ASM_STEP[i], CONS, args, dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=4)
    return s1 + (t1 >> (8 // NB)), s0 + (t0 >> (8 // NB))  # (exact multiples of 16 or 4)


@triton.jit
def _load_trip(gu, g1, qa_ptr, qb_ptr, sz_ptr, c4, n, nmask, N: tl.constexpr,
               BITS: tl.constexpr, WA: tl.constexpr, UNROLL: tl.constexpr, MASKED: tl.constexpr):
    """The words of groups gu .. gu + UNROLL - 1 for lane c's word rows: (A words, 3-bit's
    B-plane row, scale | zero) per group; MASKED: none past g1 (a prefetch past the split)."""
    wss = ()
    for u in tl.static_range(UNROLL):  # every word of the trip in flight before the mmas
        grp = gu + u
        m = nmask & (grp < g1) if MASKED else nmask
        ws = ()
        if BITS == 4:
            for s in tl.static_range(4):
                ws = ws + (_ld(qa_ptr + (grp * WA + 4 * c4 + s) * N + n, m, MASKED),)
        else:
            for i in tl.static_range(2):
                ws = ws + (_ld(qa_ptr + (grp * WA + 4 * i + c4) * N + n, m, MASKED),)
        bws = ws[0]
        if BITS == 3:
            bws = _ld(qb_ptr + (grp * (WA // 2) + c4) * N + n, m, MASKED)
        szw = _ld(sz_ptr + grp * N + n, m, MASKED)
        wss = wss + ((ws, bws, szw),)
    return wss


@triton.jit
def _trip(acc, wss, gu, xd_b, xoff, xrow_b, c4, xg_ptr, num_groups, BITS: tl.constexpr,
          WA: tl.constexpr, NB: tl.constexpr, Q: tl.constexpr, L: tl.constexpr,
          R: tl.constexpr, RB: tl.constexpr, UNROLL: tl.constexpr, ASM_STEP: tl.constexpr,
          CONS: tl.constexpr):
    """acc (RB tensors [4, Q, L, 4]) after the groups gu .. gu + UNROLL - 1 of `_load_trip`."""
    for u in tl.static_range(UNROLL):
        grp = gu + u
        ws, bws, szw = wss[u]
        sc = (szw << 16).to(tl.float32, bitcast=True)
        zr = (szw & -65536).to(tl.float32, bitcast=True)
        new = ()
        for b in tl.static_range(RB):
            xr = 4 * b + xrow_b
            xp = xd_b + (xr * 2 * num_groups + grp) * (WA * NB)
            xbs = (_ld(xp + xoff[0], xr < R, True), _ld(xp + xoff[1], xr < R, True))
            s1, s0 = _group_sums(ws, bws, xbs, BITS, NB, Q, L, ASM_STEP, CONS)
            xc = 4 * b + c4  # D: lane (quad, c) holds x row c's sums
            sx = tl.load(xg_ptr + xc * 2 * num_groups + grp * 2, mask=xc < R, other=0.0)
            xq = tl.load(xg_ptr + xc * 2 * num_groups + grp * 2 + 1, mask=xc < R, other=0.0)
            new = new + (acc[b] + sc * (sx * (s1 * 128 + s0).to(tl.float32) - zr * xq),)
        acc = new
    return acc


@triton.jit
def _epilogue(y, b: tl.constexpr, c4, n, pid_n, N: tl.constexpr, R: tl.constexpr, K, y_ptr,
              rs_ptr, n_rs, eps, RSCALE: tl.constexpr, NRS: tl.constexpr, r_ptr, nw_ptr, xs_ptr,
              ss_ptr, RES: tl.constexpr):
    """x rows 4 b .. 4 b + 3's final sums y [4, Q, L, 4] (lane c: row 4 b + c; columns n) out.
    RSCALE: y times the row's rsqrt(sum(rs[row, :n_rs]) / K + eps) (the norm of a residual
    epilogue before, rs [R, n_rs]). RES, per row as gemv_tc's `_residual_epilogue`: h = y
    rounded to x's dtype plus r[row], rounded again, into y; h w into xs[row]; the tile's sum of
    h^2 into ss[row, pid_n] (ss [R, N / BN])."""
    xc = 4 * b + c4  # [4, 1, 1, 1]
    rows = 4 * b + tl.arange(0, 4)
    if RSCALE:
        cols = tl.arange(0, NRS)
        rsv = tl.load(rs_ptr + rows[:, None] * n_rs + cols[None, :],
                      mask=(rows[:, None] < R) & (cols[None, :] < n_rs), other=0.0)
        y = y * tl.rsqrt(tl.sum(rsv, axis=1) / K + eps)[:, None, None, None]
    out = xc * N + n
    if RES:
        r = tl.load(r_ptr + out, mask=xc < R, other=0.0)
        hf, xs = residual_h(y, r, tl.load(nw_ptr + n), xs_ptr)
        tl.store(xs_ptr + out, xs, mask=xc < R)
        sq = tl.sum(tl.sum(tl.sum(hf * hf, axis=3), axis=2), axis=1)  # [4]
        tl.store(ss_ptr + rows * tl.num_programs(0) + pid_n, sq, mask=rows < R)
        y = hf
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=xc < R)


@triton.jit
def gemv_i8_rows_kernel(xd_ptr, xg_ptr, qa_ptr, qb_ptr, sz_ptr, y_ptr, ws_ptr, cnt_ptr,
                        num_groups, groups_per_split, num_splits,
                        N: tl.constexpr, BITS: tl.constexpr, WA: tl.constexpr,
                        NB: tl.constexpr, L: tl.constexpr, Q: tl.constexpr, R: tl.constexpr,
                        RB: tl.constexpr, UNROLL: tl.constexpr, SPLIT_K: tl.constexpr,
                        ASM_STEP: tl.constexpr, CONS: tl.constexpr, PF: tl.constexpr,
                        rs_ptr=None, n_rs=1, eps=0.0, RSCALE: tl.constexpr = False,
                        NRS: tl.constexpr = 1, r_ptr=None, nw_ptr=None, xs_ptr=None,
                        ss_ptr=None, RES: tl.constexpr = False):
    """Grid (N / BN, num_splits), BN = 4 L Q, one warp (Q = 8); x row r's digits at xd +
    r 2 num_groups WA NB, xg + r 2 num_groups; y [R, N]; split-K partials [num_splits, R, N].
    Lane (quad, c) computes rows 4 (Q l + quad) + j of y for x rows 4 b + c (b < RB). Each trip
    takes UNROLL groups (a split's groups are a multiple of it), their words loaded first.
    RSCALE: row r of y times rsqrt(sum(rs[r, :n_rs]) / K + eps); RES: `_epilogue`'s residual
    add and norm per row (gemv_tc's `_residual_epilogue` row by row). PF: each trip's words
    loaded during the trip before (a loop-carried prefetch), not at its top."""
    pdl.trigger()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BN: tl.constexpr = 4 * L * Q
    g0 = pid_k * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, num_groups)
    c4, q4, j4, n, nmask = _lane_rows(pid_n, N, BN, Q, L)
    xrow_b = (q4 % 8) // 2  # B: lane (quad, c) supplies x row quad // 2's digit quad % 2
    xd_b = xd_ptr + (q4 % 2) * num_groups * (WA * NB) + j4
    if BITS == 4:  # the digits of lane c's word rows (gemv_i8's layout of block c)
        xoff = (8 * c4, 8 * c4 + 4)
    else:
        xoff = (4 * c4, 16 + 4 * c4)
    acc = ()
    for _ in tl.static_range(RB):
        acc = acc + (tl.zeros([4, Q, L, 4], dtype=tl.float32),)
    if PF:  # the next trip's words in flight while this trip's mmas run
        nxt = _load_trip(g0, g1, qa_ptr, qb_ptr, sz_ptr, c4, n, nmask, N, BITS, WA, UNROLL,
                         True)
        for gu in range(g0, g1, UNROLL):
            wss = nxt
            nxt = _load_trip(gu + UNROLL, g1, qa_ptr, qb_ptr, sz_ptr, c4, n, nmask, N, BITS,
                             WA, UNROLL, True)
            pdl.wait()  # (a no-op after the first trip)
            acc = _trip(acc, wss, gu, xd_b, xoff, xrow_b, c4, xg_ptr, num_groups, BITS, WA,
                        NB, Q, L, R, RB, UNROLL, ASM_STEP, CONS)
    else:
        for gu in range(g0, g1, UNROLL):
            wss = _load_trip(gu, g1, qa_ptr, qb_ptr, sz_ptr, c4, n, nmask, N, BITS, WA, UNROLL,
                             False)
            pdl.wait()  # (x's digits come from the kernel before; a no-op after the first trip)
            acc = _trip(acc, wss, gu, xd_b, xoff, xrow_b, c4, xg_ptr, num_groups, BITS, WA,
                        NB, Q, L, R, RB, UNROLL, ASM_STEP, CONS)
    pdl.wait()  # every path waits before its stores (a no-op after the loop's)
    for b in tl.static_range(RB):
        xc = 4 * b + c4
        out = xc * N + n
        if SPLIT_K:
            tl.store(ws_ptr + pid_k.to(tl.int64) * R * N + out, acc[b], mask=xc < R)
        else:
            _epilogue(acc[b], b, c4, n, pid_n, N, R, num_groups * 128, y_ptr, rs_ptr, n_rs,
                      eps, RSCALE, NRS, r_ptr, nw_ptr, xs_ptr, ss_ptr, RES)
    if SPLIT_K:
        tl.debug_barrier()  # every thread's partials are written before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == num_splits - 1:  # the last split of this tile sums all partials
            for b in tl.static_range(RB):
                xc = 4 * b + c4
                tot = sum_splits(ws_ptr + xc * N + n, R * N, num_splits, xc < R, acc[b])
                _epilogue(tot, b, c4, n, pid_n, N, R, num_groups * 128, y_ptr, rs_ptr, n_rs,
                          eps, RSCALE, NRS, r_ptr, nw_ptr, xs_ptr, ss_ptr, RES)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch


def supported(x: torch.Tensor, bits: int, group_size: int, n: int, k: int,
              reps: int = 2, unroll: int = 1) -> bool:
    """Whether gemv_i8_rows takes x [M, K] against an N x K weight: 1 <= M <= MAX_ROWS, G =
    128, N a multiple of the tile, K / G a multiple of unroll, bf16 / fp16 x."""
    return (1 <= x.shape[0] <= MAX_ROWS and bits in (2, 3, 4) and group_size == 128
            and n % (32 * reps) == 0 and k % (unroll * group_size) == 0
            and x.dtype in (torch.bfloat16, torch.float16))


def gemv_i8_rows(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor,
                 bits: int, group_size: int = 128, swiglu: bool = False, reps: int = 2,
                 waves: float = 16.0, unroll: int = 1, maxnreg: int | None = None,
                 splits: int | None = None, out: torch.Tensor | None = None,
                 rscale: tuple | None = None, residual: tuple | None = None,
                 prefetch: bool = False, gscale: tuple | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype (W: pack.py's planes qa, qb, sz; `supported`);
    swiglu: x [M, 2K] = (gate, up) and y = (SiLU(gate) * up) @ W^T. rscale = (rs [M, P] fp32,
    eps): row r of y times rsqrt(sum(rs[r]) / K + eps) (engine.quant_matmul_rscaled).
    residual = (r, w, xs, ss): out = h = y + r [M, N], xs = h w [M, N], ss [M, tiles(N, reps)]
    fp32 each row's tile sums of h^2 (engine.quant_matmul_residual_norm). prefetch: each trip's
    words loaded during the one before (not yet measured on a GPU). gscale = (gs [M, K / G, P]
    fp32, eps): KDA's gated output norm per head, in x's digits (`x_digits`)."""
    m = x.shape[0]
    k = x.shape[-1] // 2 if swiglu else x.shape[-1]
    n = qa.shape[1]
    assert supported(x, bits, group_size, n, k, reps, unroll), (x.shape, bits, n, k, unroll)
    if x.stride(-1) != 1:
        x = x.contiguous()
    xd, xg = x_digits(x, bits, group_size, swiglu, gscale)
    num_groups = k // group_size
    n_tiles = tiles(n, reps)
    gps, ns = split_k(n_tiles, num_groups // unroll, qa.device, waves, splits)
    gps *= unroll  # (split_k counts trips of unroll groups)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype == x.dtype and out.is_contiguous()
    ws, cnt = (out, out) if ns == 1 else _workspace(out.device, n_tiles, ns * m * n)
    kw = {} if maxnreg is None else {"maxnreg": maxnreg}
    if rscale is not None:
        rs, eps = rscale
        assert rs.dtype == torch.float32 and rs.dim() == 2 and rs.shape[0] == m, rs.shape
        rs = rs.contiguous()
        kw.update(rs_ptr=rs, n_rs=rs.shape[1], eps=eps, RSCALE=True,
                  NRS=triton.next_power_of_2(rs.shape[1]))
    if residual is not None:
        r, w, xs, ss = residual
        assert (ss.dtype == torch.float32 and ss.shape == (m, n_tiles) and ss.is_contiguous()
                and w.numel() == n and w.dtype == x.dtype and w.is_contiguous()
                and all(t.shape == (m, n) and t.dtype == x.dtype and t.is_contiguous()
                        for t in (r, xs))), "residual: r, xs [M, N], w [N] x's dtype, ss [M, tiles]"
        kw.update(r_ptr=r, nw_ptr=w, xs_ptr=xs, ss_ptr=ss, RES=True)
    gemv_i8_rows_kernel[(n_tiles, ns)](
        xd, xg, qa, qb if bits == 3 else qa, sz, out, ws, cnt, num_groups, gps, ns,
        N=n, BITS=bits, WA=plane_rows(bits, group_size), NB=nb(bits), L=reps, Q=8, R=m,
        RB=triton.cdiv(m, 4), UNROLL=unroll, SPLIT_K=ns > 1, **consts(bits), PF=prefetch,
        num_warps=1, launch_pdl=pdl.ON.value, **kw)
    return out
