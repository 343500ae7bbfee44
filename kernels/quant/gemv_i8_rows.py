"""gemv_i8 for 2-8 rows of x: the weights decoded once, an integer mma per row.

For M = 2..16 rows the engine's path is gemm_tc (bf16 tensor-core GEMM), which costs ~1.6-2x the
one-row gemv_i8 per weight, nearly flat in M (perf/RESULTS.md session 26: a speculative check of
5 rows takes 2.1x a decode step on Volundr-32B). Here each program streams its tile's codes once,
as gemv_i8 does, and runs gemv_i8's PTX steps (gemv_i8.consts: the codes' masks + 4 mma per 64
weights) once per row against that row's digits; the mma's B operand holds one row's digits (4
groups x 2 digits), so rows cost mmas and the masks, not bytes: at 4 bits ~16 ALU + 4 mma per 64
weights and row, under half of the issue rate at 8 rows while the loads stay gemv_i8's. The
int32 sums of a row live for one block of a group (folded into the row's fp32 accumulator
there, which the scale's linearity allows), so a row costs ~6 registers that stay (tiles of 32
rows: reps 1).

Plain y = x W^T (or the SwiGLU of x's halves first, as gemv_i8's digits do); no epilogues. The
naive reference is naive.naive_quant_matmul, row by row the same as gemv_i8's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.quant.digits import nb, plane_rows, x_digits
from volundr.kernels.quant.gemv import _workspace, split_k, sum_splits
from volundr.kernels.quant.gemv_i8 import block_steps, consts
from volundr.kernels.quant.gemv_tc import _lane_rows, _ld

MAX_ROWS = 8
# per bit width: reps (BN = 32 reps), programs per SM, register cap; not yet tuned on a GPU
CONFIG = {2: dict(reps=1, waves=16.0, maxnreg=255), 3: dict(reps=1, waves=16.0, maxnreg=255),
          4: dict(reps=1, waves=16.0, maxnreg=255)}


@triton.jit
def _add(acc, r: tl.constexpr, v, R: tl.constexpr):
    """acc with v added to its element r (a tuple of R tensors)."""
    out = ()
    for i in tl.static_range(R):
        if i == r:
            out = out + (acc[i] + v,)
        else:
            out = out + (acc[i],)
    return out


@triton.jit
def gemv_i8_rows_kernel(xd_ptr, xg_ptr, qa_ptr, qb_ptr, sz_ptr, y_ptr, ws_ptr, cnt_ptr,
                        num_groups, sets_per_split, num_splits,
                        N: tl.constexpr, BITS: tl.constexpr, WA: tl.constexpr,
                        NB: tl.constexpr, L: tl.constexpr, Q: tl.constexpr, R: tl.constexpr,
                        SPLIT_K: tl.constexpr, ASM_STEP: tl.constexpr, CONS: tl.constexpr):
    """gemv_i8_kernel's grid and lanes (its docstring) with R rows of x: row r's digits at
    xd + r 2 num_groups WA NB and xg + r 2 num_groups, its outputs y[r]; split-K partials
    [num_splits, R, N]. The first block of each set's A words loads before PDL's wait."""
    pdl.trigger()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BN: tl.constexpr = 4 * L * Q
    set0 = pid_k * sets_per_split
    set1 = tl.minimum(set0 + sets_per_split, num_groups // 4)
    c4, q4, j4, n, nmask = _lane_rows(pid_n, N, BN, Q, L)
    sel = ((q4 % 8) // 2) == c4  # B: lane (quad g, c) supplies group c's digits iff g // 2 == c
    dig = (q4 % 2) * num_groups  # d1 in even columns, d0 in odd
    xd_row = 2 * num_groups * (WA * NB)
    acc = ()
    for _ in tl.static_range(R):
        acc = acc + (tl.zeros([4, Q, L, 4], dtype=tl.float32),)
    for st in range(set0, set1):
        grp = st * 4 + c4
        bws = ()
        if BITS == 3:  # the set's 4 B word rows serve both blocks (A rows s and 4 + s)
            for s in tl.static_range(4):
                bws = bws + (_ld(qb_ptr + (grp * (WA // 2) + s) * N + n, nmask, False),)
        pre = ()
        for s in tl.static_range(4):
            pre = pre + (_ld(qa_ptr + (grp * WA + s) * N + n, nmask, False),)
        pdl.wait()  # (a no-op after the first set)
        szw = _ld(sz_ptr + grp * N + n, nmask, False)
        sc = (szw << 16).to(tl.float32, bitcast=True)
        zr = (szw & -65536).to(tl.float32, bitcast=True)
        for r in tl.static_range(R):  # the zero term of each row's group
            xq = tl.load(xg_ptr + r * 2 * num_groups + grp * 2 + 1)
            acc = _add(acc, r, -(sc * zr * xq), R)
        for blk in tl.static_range(WA // 4):
            ws = ()
            for s in tl.static_range(4):
                if blk == 0:
                    ws = ws + (pre[s],)
                else:
                    ws = ws + (_ld(qa_ptr + (grp * WA + blk * 4 + s) * N + n, nmask, False),)
            for r in tl.static_range(R):
                # one row's int32 sums live for one block only (then folded into its fp32 acc):
                # the x 1 codes' against d1, d0, the scaled codes' (16 q / 4 q) apart
                s1 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
                s0 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
                t1 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
                t0 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
                xbs = ()
                for u in tl.static_range(NB):
                    xbs = xbs + (_ld(xd_ptr + r * xd_row + (dig + grp) * (WA * NB) + blk * 4 * NB
                                     + 4 * u + j4, sel, True),)
                s1, s0, t1, t0 = block_steps(s1, s0, t1, t0, ws, bws, xbs, blk, BITS,
                                             ASM_STEP, CONS)
                s1 += t1 >> (8 // NB)  # the scaled codes' sums are exact multiples of 16 or 4
                s0 += t0 >> (8 // NB)  # (|128 s1 + s0| < 2^24: exact in fp32)
                sx = tl.load(xg_ptr + r * 2 * num_groups + grp * 2)  # (an L1 hit after the first)
                acc = _add(acc, r, sc * (sx * (s1 * 128 + s0).to(tl.float32)), R)
    pdl.wait()  # every path waits before its stores (a no-op after the loop's)
    n3 = pid_n * BN + 4 * (Q * tl.arange(0, L)[None, :, None] + tl.arange(0, Q)[:, None, None]) \
        + tl.arange(0, 4)[None, None, :]
    if SPLIT_K:
        for r in tl.static_range(R):
            tl.store(ws_ptr + (pid_k.to(tl.int64) * R + r) * N + n3, tl.sum(acc[r], axis=0))
        tl.debug_barrier()  # every thread's partials are written before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == num_splits - 1:  # the last split of this tile sums all partials
            for r in tl.static_range(R):
                like = tl.sum(acc[r], axis=0)
                tot = sum_splits(ws_ptr + r * N + n3, R * N, num_splits, n3 < N, like)
                tl.store(y_ptr + r * N + n3, tot.to(y_ptr.dtype.element_ty))
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch
    else:
        for r in tl.static_range(R):
            tl.store(y_ptr + r * N + n3, tl.sum(acc[r], axis=0).to(y_ptr.dtype.element_ty))


def supported(x: torch.Tensor, bits: int, group_size: int, n: int, k: int,
              reps: int = 1) -> bool:
    """Whether gemv_i8_rows takes x [M, K] against an N x K weight: 2 <= M <= MAX_ROWS, G =
    128, N a multiple of the tile, K of 4 groups, bf16 / fp16 x."""
    return (2 <= x.shape[0] <= MAX_ROWS and bits in (2, 3, 4) and group_size == 128
            and n % (32 * reps) == 0 and k % (4 * group_size) == 0
            and x.dtype in (torch.bfloat16, torch.float16))


def gemv_i8_rows(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor,
                 bits: int, group_size: int = 128, swiglu: bool = False, reps: int = 1,
                 waves: float = 16.0, maxnreg: int | None = 255,
                 splits: int | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype (W: pack.py's planes qa, qb, sz; `supported`);
    swiglu: x [M, 2K] = (gate, up) and y = (SiLU(gate) * up) @ W^T."""
    m = x.shape[0]
    k = x.shape[-1] // 2 if swiglu else x.shape[-1]
    n = qa.shape[1]
    assert supported(x, bits, group_size, n, k, reps), (x.shape, bits, group_size, n, k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    xd, xg = x_digits(x, bits, group_size, swiglu)
    num_groups = k // group_size
    n_tiles = n // (32 * reps)
    sps, ns = split_k(n_tiles, num_groups // 4, qa.device, waves, splits)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws, cnt = (out, out) if ns == 1 else _workspace(out.device, n_tiles, ns * m * n)
    kw = {} if maxnreg is None else {"maxnreg": maxnreg}
    gemv_i8_rows_kernel[(n_tiles, ns)](
        xd, xg, qa, qb if bits == 3 else qa, sz, out, ws, cnt, num_groups, sps, ns,
        N=n, BITS=bits, WA=plane_rows(bits, group_size), NB=nb(bits), L=reps, Q=8, R=m,
        SPLIT_K=ns > 1, **consts(bits), num_warps=1, launch_pdl=pdl.ON.value, **kw)
    return out
