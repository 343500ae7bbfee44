"""Batch-1 GEMV on the integer tensor cores: u8 codes x s8 digits of x (mma.m16n8k32).

gemv_tc (gemv_tc.py) makes bf16 pairs of the codes and multiplies them with mma.m16n8k16
bf16: ~1.0-1.2 SASS instructions per weight, and at M = 1 the kernel is bound by its warps'
dependent instructions (perf/RESULTS.md, sessions 6-18). Here the codes go to the integer
mma as the bytes they already are in pack.py's words, against x as two int8 digits per
element (per group g of G inputs):

    xi = floor(x * XMAX / max|x_g| + 1/2) in [-XMAX, XMAX],   sx = max|x_g| / XMAX
    xi = 128 d1 + d0,   d1 = (xi + 64) >> 7 in [-127, 127],   d0 = xi - 128 d1 in [-64, 63]
    sum_k q x ~= sx (128 sum q d1 + sum q d0)      (int32 sums, exact)
    y[n] = sum_g s[n, g] (sx_g (128 S1 + S0) - z[n, g] sx_g sum xi_g)

so x is kept to 15 bits of its group's maximum (the result's error equals gemv_tc's).
digits.py makes (xd, xg) from x in one small launch (`x_digits`), or the GEMV that produced
x writes them in its epilogue (`out_digits`, `out_swiglu_digits`); the naive reference is
naive.naive_x_digits. The fragment trick is gemv_tc's: lane (g, c) holds group c's codes as
its A columns; B column col holds group col // 2's digits (lanes g // 2 == c supply them),
d1 in even columns and d0 in odd, so one mma gives a lane both digits' sums for its rows.

Codes per A register (4 bytes = 4 weights of one word, bytes b -> slots NB b + e):
  4-bit (`asm_pair4`): w & 0x0F0F0F0F and w & 0xF0F0F0F0 (16 q: summed apart, / 16 at the end)
  2-bit (`asm_step2m`): w, w >> 4 each & 0x03030303 (x 1) and & 0x0C0C0C0C (4 q, apart, / 4)
  3-bit (`asm_step3m`): the 2-bit plane's bytes with the 1-bit plane's bit merged in
0.3-0.75 ALU instructions per weight. H100 (run 82): 0.71-0.86x gemv_tc's time at 2 and 3
bits, 0.86-0.90x at 4 bits (1.02x at 5120x5120), the digits launch adding ~1.1 us. The PTX's
operand order is checked on the CPU against mma's fragment layout (tests/test_gemv_i8.py
emulates the lanes).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.quant.digits import nb, plane_rows, x_digits  # noqa: F401
from volundr.kernels.quant.digits import workspace as digits_workspace
from volundr.kernels.quant.gemv import split_k, sum_splits
from volundr.kernels.quant.gemv_tc import _lane_rows, _ld, _store_out, residual_kwargs

# per bit width (H100 run 82): reps (BN = 32 reps), programs per SM, register cap
CONFIG = {2: dict(reps=2, waves=16.0, maxnreg=168), 3: dict(reps=2, waves=16.0, maxnreg=168),
          4: dict(reps=2, waves=24.0, maxnreg=168)}
# per (N, K, bits) where another config measured faster (H100 run 101, diag_gemv_i8's sweep of
# reps, splits and caps; elsewhere CONFIG was best or within 1%): 4-bit at K = 5120 in 128-row
# tiles, 1360 programs of one set (17408: 19.45 vs 20.23 us) or two (34816: 36.06 vs 36.46 us)
SHAPE_CONFIG = {(17408, 5120, 4): dict(reps=4, splits=10),
                (34816, 5120, 4): dict(reps=4, splits=5)}


def config(bits: int, n: int, k: int) -> dict:
    """gemv_i8's keyword arguments for an N x K weight at `bits` (CONFIG, SHAPE_CONFIG)."""
    return {**CONFIG[bits], **SHAPE_CONFIG.get((n, k, bits), {})}


# PDL's trigger at the kernel's top (the default: the next kernel's programs, e.g. the next
# digits launch and GEMV, may become resident while this one runs; run 86's reading of its
# decode gain over gemv_tc, whose trigger is late) or after its main loop:
# VOLUNDR_I8_LATE_TRIGGER=1 (bench_decode +i8late). Measured (H100 runs 92-93): 6.044 /
# 6.046 vs 6.027 ms per token, no faster; the top stays.
LATE_TRIGGER = os.environ.get("VOLUNDR_I8_LATE_TRIGGER", "0") == "1"


def tiles(n: int, reps: int = 2) -> int:
    """Programs along N (output tiles of 32 reps rows): the residual epilogue's ss entries."""
    return n // (32 * reps)


# ---- inline PTX (operands: see each docstring; D / C of tile t = words 2t, 2t + 1 as A rows
# g, g + 8: (row g: d1, d0; row g + 8: d1, d0) = ($2t, $4+2t, $2t+1, $5+2t)) ----------------
def _mma(o: int, t: int, a: list[str], b: list[str]) -> str:
    d = [f"${o + 2 * t}", f"${o + 4 + 2 * t}", f"${o + 2 * t + 1}", f"${o + 5 + 2 * t}"]
    c = [f"${16 + o + 2 * t}", f"${16 + o + 4 + 2 * t}", f"${16 + o + 2 * t + 1}",
         f"${16 + o + 5 + 2 * t}"]
    return ("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
            f"{{{', '.join(d)}}}, {{{', '.join(a)}}}, {{{', '.join(b)}}}, {{{', '.join(c)}}};")


def _block(lines: list[str], regs: list[str]) -> str:
    return "\n".join(["{", f".reg .b32 {', '.join(regs)};"] + lines + ["}"])


def asm_pair4(p: int) -> str:
    """4-bit, steps 2p, 2p + 1 of a block (a lane's 4 words each), pack = 4. The low codes
    w & 0x0F0F0F0F and the high ones w & 0xF0F0F0F0 (16 q, still a u8) go to separate sums;
    one mma's A holds rows g, g + 8 of step 2p (k 0-15) and of step 2p + 1 (k 16-31): 16 ALU
    + 4 mma per 64 weights. Operands: out $0..$7 the low codes' d1 / d0 sums (rows j), $8..$15
    the high codes'; in $16..$31 the same (C); $32..$35 step 2p's words, $36..$39 step 2p + 1's;
    the block's 2 B tensors, pair p's at $40 + 4p + i: B(2p, e 0), B(2p + 1, e 0), B(2p, e 1),
    B(2p + 1, e 1)."""
    lines, regs = [], []
    for st in range(2):
        for j in range(4):
            w = f"${32 + 4 * st + j}"
            lines += [f"and.b32 l{st}{j}, {w}, 0x0f0f0f0f;", f"and.b32 h{st}{j}, {w}, 0xf0f0f0f0;"]
            regs += [f"l{st}{j}", f"h{st}{j}"]
    for t in range(2):
        for kind, o, bi in (("l", 0, 0), ("h", 8, 2)):
            a = [f"{kind}0{2 * t}", f"{kind}0{2 * t + 1}", f"{kind}1{2 * t}",
                 f"{kind}1{2 * t + 1}"]
            lines.append(_mma(o, t, a, [f"${40 + 4 * p + bi}", f"${40 + 4 * p + bi + 1}"]))
    return _block(lines, regs)


def asm_step2m(s: int) -> str:
    """2-bit, step s (word row s of a block): w & 0x03030303 (slots 4b, x 1), w & 0x0C0C0C0C
    (slots 4b + 1, 4 q), the same of w >> 4 (slots 4b + 2, 4b + 3); the 4 q codes to separate
    sums. 20 ALU + 4 mma per 64 weights. Operands: out $0..$7 the x 1 codes' d1 / d0 sums,
    $8..$15 the 4 q codes'; in $16..$31 (C); $32..$35 the words; the block's 4 B tensors, step
    s at $36 + 4s + i in the order e 0, 2, 1, 3."""
    lines, regs = [], []
    for j in range(4):
        w = f"${32 + j}"
        lines += [f"shr.u32 s{j}, {w}, 4;", f"and.b32 m{j}0, {w}, 0x03030303;",
                  f"and.b32 m{j}1, {w}, 0x0c0c0c0c;", f"and.b32 m{j}2, s{j}, 0x03030303;",
                  f"and.b32 m{j}3, s{j}, 0x0c0c0c0c;"]
        regs += [f"s{j}"] + [f"m{j}{e}" for e in range(4)]
    for t in range(2):
        for o, (e0, e1), bi in ((0, (0, 2), 0), (8, (1, 3), 2)):
            a = [f"m{2 * t}{e0}", f"m{2 * t + 1}{e0}", f"m{2 * t}{e1}", f"m{2 * t + 1}{e1}"]
            lines.append(_mma(o, t, a, [f"${36 + 4 * s + bi}", f"${36 + 4 * s + bi + 1}"]))
    return _block(lines, regs)


def asm_step3m(s: int, h: int) -> str:
    """3-bit, step s of block h: asm_step2m with each code's bit 2 merged in. A word row
    r = 4 h + s's slot i has its bit 2 at bit 2 i + 1 - h of B word s (pack.py), so
    (B << (1 + h)) puts the bits of slots 4b, 4b + 1 at bits 2 and 4 of byte b, (B >> (3 - h))
    those of slots 4b + 2, 4b + 3: codes (w & 0x03) | (t & 0x04) (x 1) and (w & 0x0c) |
    (t & 0x10) (4 q, at most 28). 44 ALU + 4 mma per 64 weights. Operands: as asm_step2m, then
    $36..$39 the B words, the block's 4 B tensors at $40 + 4s + i (e 0, 2, 1, 3)."""
    lines, regs = [], []
    for j in range(4):
        w, b = f"${32 + j}", f"${36 + j}"
        lines += [f"shr.u32 s{j}, {w}, 4;", f"shl.b32 u{j}, {b}, {1 + h};",
                  f"shr.u32 v{j}, {b}, {3 - h};"]
        regs += [f"s{j}", f"u{j}", f"v{j}"]
        for e, (src, t, lo, hi) in enumerate(((w, "u", 0x03030303, 0x04040404),
                                              (w, "u", 0x0C0C0C0C, 0x10101010),
                                              (f"s{j}", "v", 0x03030303, 0x04040404),
                                              (f"s{j}", "v", 0x0C0C0C0C, 0x10101010))):
            lines += [f"and.b32 a{j}{e}, {src}, {lo:#010x};",
                      f"and.b32 b{j}{e}, {t}{j}, {hi:#010x};",
                      f"or.b32 m{j}{e}, a{j}{e}, b{j}{e};"]
            regs += [f"a{j}{e}", f"b{j}{e}", f"m{j}{e}"]
    for t in range(2):
        for o, (e0, e1), bi in ((0, (0, 2), 0), (8, (1, 3), 2)):
            a = [f"m{2 * t}{e0}", f"m{2 * t + 1}{e0}", f"m{2 * t}{e1}", f"m{2 * t + 1}{e1}"]
            lines.append(_mma(o, t, a, [f"${40 + 4 * s + bi}", f"${40 + 4 * s + bi + 1}"]))
    return _block(lines, regs)


@functools.cache
def consts(bits: int) -> dict:
    """The kernel's PTX per step and its constraint string."""
    if bits == 4:
        return dict(ASM_STEP=(asm_pair4(0), asm_pair4(1)),
                    CONS=",".join(["=r"] * 16 + ["r"] * 32))
    if bits == 2:
        return dict(ASM_STEP=tuple(asm_step2m(s) for s in range(4)),
                    CONS=",".join(["=r"] * 16 + ["r"] * 36))
    return dict(ASM_STEP=tuple(asm_step3m(s, h) for h in range(2) for s in range(4)),
                CONS=",".join(["=r"] * 16 + ["r"] * 40))


# ---- the GEMV ------------------------------------------------------------------------------------
@triton.jit
def block_steps(s1, s0, t1, t0, ws, bws, xbs, blk: tl.constexpr, BITS: tl.constexpr,
                ASM_STEP: tl.constexpr, CONS: tl.constexpr):
    """Block blk of a group (`consts`' PTX steps): the sums (s1, s0, t1, t0) [4, Q, L, 4] int32
    after the block's A words ws (4), 3-bit's B words bws (4; () otherwise) against x's digits
    xbs (NB registers). gemv_i8_kernel and gemv_i8_rows (per row) run it."""
    if BITS == 4:
        for pp in tl.static_range(2):
            s1, s0, t1, t0 = tl.inline_asm_elementwise(
                ASM_STEP[pp], CONS, (s1, s0, t1, t0, ws[2 * pp], ws[2 * pp + 1]) + xbs,
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4)
    elif BITS == 2:
        for s in tl.static_range(4):
            s1, s0, t1, t0 = tl.inline_asm_elementwise(
                ASM_STEP[s], CONS, (s1, s0, t1, t0, ws[s]) + xbs,
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4)
    else:
        for s in tl.static_range(4):
            s1, s0, t1, t0 = tl.inline_asm_elementwise(
                ASM_STEP[blk * 4 + s], CONS, (s1, s0, t1, t0, ws[s], bws[s]) + xbs,
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4)
    return s1, s0, t1, t0


@triton.jit
def gemv_i8_kernel(xd_ptr, xg_ptr, qa_ptr, qb_ptr, sz_ptr, y_ptr, ws_ptr, cnt_ptr, rs_ptr,
                   num_groups, sets_per_split, num_splits, n_rs, eps,
                   N: tl.constexpr, BITS: tl.constexpr, WA: tl.constexpr, NB: tl.constexpr,
                   L: tl.constexpr, Q: tl.constexpr, G: tl.constexpr, SPLIT_K: tl.constexpr,
                   ASM_STEP: tl.constexpr, CONS: tl.constexpr, EARLY: tl.constexpr,
                   RSCALE: tl.constexpr, NRS: tl.constexpr, RES: tl.constexpr = False,
                   r_ptr=None, nw_ptr=None, xs_ptr=None, ss_ptr=None, dg_ptr=None,
                   dcnt_ptr=None, DIGITS: tl.constexpr = False, SWD: tl.constexpr = False,
                   LATE: tl.constexpr = False):
    """Grid (N / BN, num_splits), BN = 4 L Q, one warp (Q = 8); N a multiple of BN (known to
    the compiler: a load's row offset is an immediate) and whole sets of 4 groups, so no masks.
    Lane (quad, c) accumulates rows 4 (Q l + quad) + j over group c of each set. EARLY: each
    set's first block of A words (and 3-bit's B words) is loaded before PDL's wait (weights are
    never written by an earlier kernel). RSCALE: y times rsqrt(sum(rs[:n_rs]) / K + eps).
    RES: gemv_tc's residual epilogue (h = y + r into y, h w into xs, the tile's sum of h^2 into
    ss[pid_n]); DIGITS: with xs's digits for the next gemv_i8 (digits.epilogue); SWD: y is an
    MLP's (gate, up) and the digits of SiLU(gate) * up are written (digits.swiglu_epilogue).
    LATE: PDL's trigger after the loop instead of at the top (gemv_tc's default)."""
    if not LATE:
        pdl.trigger()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BN: tl.constexpr = 4 * L * Q
    set0 = pid_k * sets_per_split
    set1 = tl.minimum(set0 + sets_per_split, num_groups // 4)
    if not EARLY:
        pdl.wait()
    c4, q4, j4, n, nmask = _lane_rows(pid_n, N, BN, Q, L)
    sel = ((q4 % 8) // 2) == c4  # B: lane (quad g, c) supplies group c's digits iff g // 2 == c
    dig = (q4 % 2) * num_groups  # d1 in even columns, d0 in odd
    acc = tl.zeros([4, Q, L, 4], dtype=tl.float32)
    for st in range(set0, set1):
        grp = st * 4 + c4
        bws = ()
        if BITS == 3:  # the set's 4 B word rows serve both blocks (A rows s and 4 + s)
            for s in tl.static_range(4):
                bws = bws + (_ld(qb_ptr + (grp * (WA // 2) + s) * N + n, nmask, False),)
        pre = ()
        if EARLY:
            for s in tl.static_range(4):
                pre = pre + (_ld(qa_ptr + (grp * WA + s) * N + n, nmask, False),)
            pdl.wait()  # (a no-op after the first set)
        s1 = tl.zeros([4, Q, L, 4], dtype=tl.int32)  # x 1 codes' sums against d1, d0
        s0 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
        t1 = tl.zeros([4, Q, L, 4], dtype=tl.int32)  # scaled codes' (16 q or 4 q)
        t0 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
        for blk in tl.static_range(WA // 4):
            xbs = ()
            for u in tl.static_range(NB):
                xbs = xbs + (_ld(xd_ptr + (dig + grp) * (WA * NB) + blk * 4 * NB + 4 * u + j4,
                                 sel, True),)
            ws = ()
            for s in tl.static_range(4):
                if EARLY and blk == 0:
                    ws = ws + (pre[s],)
                else:
                    ws = ws + (_ld(qa_ptr + (grp * WA + blk * 4 + s) * N + n, nmask, False),)
            s1, s0, t1, t0 = block_steps(s1, s0, t1, t0, ws, bws, xbs, blk, BITS, ASM_STEP,
                                         CONS)
        s1 += t1 >> (8 // NB)  # the scaled codes' sums are exact multiples of 16 or 4
        s0 += t0 >> (8 // NB)
        szw = _ld(sz_ptr + grp * N + n, nmask, False)
        sc = (szw << 16).to(tl.float32, bitcast=True)
        zr = (szw & -65536).to(tl.float32, bitcast=True)
        sx = tl.load(xg_ptr + grp * 2)
        xq = tl.load(xg_ptr + grp * 2 + 1)
        acc += sc * (sx * (s1.to(tl.float32) * 128.0 + s0.to(tl.float32)) - zr * xq)
    if EARLY:  # every path waits before its stores (a no-op after the loop's)
        pdl.wait()
    if LATE:
        pdl.trigger()
    y = tl.sum(acc, axis=0)  # [Q, L, 4]
    n3 = pid_n * BN + 4 * (Q * tl.arange(0, L)[None, :, None] + tl.arange(0, Q)[:, None, None]) \
        + tl.arange(0, 4)[None, None, :]
    f = 1.0
    if RSCALE:
        rsv = tl.load(rs_ptr + tl.arange(0, NRS), mask=tl.arange(0, NRS) < n_rs, other=0.0)
        f = tl.rsqrt(tl.sum(rsv, axis=0) / (num_groups * G) + eps)
    if SPLIT_K:
        tl.store(ws_ptr + pid_k.to(tl.int64) * N + n3, y)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == num_splits - 1:  # the last split of this tile sums all partials
            tot = sum_splits(ws_ptr + n3, N, num_splits, n3 < N, y) * f
            _store_out(tot, n3, n3 < N, y_ptr, pid_n, N, BN, r_ptr, nw_ptr, xs_ptr, ss_ptr,
                       dg_ptr, dcnt_ptr, RES, DIGITS, SWD, False, False)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch
    else:
        _store_out(y * f, n3, n3 < N, y_ptr, pid_n, N, BN, r_ptr, nw_ptr, xs_ptr, ss_ptr,
                   dg_ptr, dcnt_ptr, RES, DIGITS, SWD, False, False)


def supported(x: torch.Tensor, bits: int, group_size: int, n: int, k: int,
              reps: int = 2) -> bool:
    """Whether gemv_i8 takes an N x K weight for x: M = 1, G = 128, N a multiple of the tile,
    K of 4 groups."""
    return (x.shape[0] == 1 and bits in (2, 3, 4) and group_size == 128
            and n % (32 * reps) == 0 and k % (4 * group_size) == 0
            and x.dtype in (torch.bfloat16, torch.float16))


def gemv_i8(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor, bits: int,
            group_size: int = 128, out: torch.Tensor | None = None, swiglu: bool = False,
            digits: tuple | None = None, rscale: tuple | None = None, reps: int = 2,
            waves: float = 24.0, maxnreg: int | None = 168, early: bool = True,
            splits: int | None = None, residual: tuple | None = None,
            out_digits: torch.Tensor | None = None,
            out_swiglu_digits: torch.Tensor | None = None,
            late: bool | None = None, gscale: tuple | None = None) -> torch.Tensor:
    """y [1, N] = x [1, K] @ W^T in x's dtype (W: pack.py's planes qa, qb, sz; `supported`).
    x's digits from `x_digits` (one launch; swiglu: x [1, 2K] = (gate, up) and y = (SiLU(gate)
    * up) @ W^T), or `digits` = (xd, xg) made before (one x feeding several GEMVs). rscale =
    (rs [P] fp32, eps): y times rsqrt(sum(rs) / K + eps) (engine.quant_matmul_rscaled).
    residual = (r, w, xs, ss): out = h = y + r, xs = h w, ss [N / 32 reps] fp32 the tiles'
    sums of h^2 (engine.quant_matmul_residual_norm; gemv_tc's epilogue). out_digits (with
    residual; `digits.empty(N)`): xs's digits written too, for the next gemv_i8
    (`digits.views`), so that its digits launch goes. out_swiglu_digits (y = an MLP's fused
    (gate, up), N even; `digits.empty(N / 2)`): the digits of SiLU(gate) * up written, for the
    down projection's gemv_i8 (`digits.views`). late: PDL's trigger after the main loop
    instead of at the top (None: LATE_TRIGGER). gscale = (gs [K / G, P] fp32, eps): KDA's
    gated output norm per head, in x's digits (`x_digits`; gemv_tc's `gscale`)."""
    k = x.shape[-1] // 2 if swiglu else x.shape[-1]
    n = qa.shape[1]
    assert supported(x, bits, group_size, n, k, reps), (x.shape, bits, group_size, n, k)
    assert digits is None or gscale is None
    xd, xg = digits if digits is not None else x_digits(x, bits, group_size, swiglu,
                                                        gscale)
    num_groups = k // group_size
    n_tiles = tiles(n, reps)
    sps, ns = split_k(n_tiles, num_groups // 4, qa.device, waves, splits)
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    ws, cnt, dkw = digits_workspace(out, n, n_tiles, ns, 32 * reps, residual, out_digits,
                                    out_swiglu_digits)
    rs, eps = rscale if rscale is not None else (xg[0], 0.0)  # (unread without rscale)
    assert rs.dtype == torch.float32 and rs.dim() == 1
    n_rs = rs.numel() if rscale is not None else 1
    kw = {} if maxnreg is None else {"maxnreg": maxnreg}
    if residual is not None:
        kw.update(residual_kwargs(residual, out, x.dtype, n, n_tiles))
    kw.update(dkw)
    gemv_i8_kernel[(n_tiles, ns)](
        xd, xg, qa, qb if bits == 3 else qa, sz, out, ws, cnt, rs, num_groups, sps, ns,
        n_rs, eps, N=n, BITS=bits, WA=plane_rows(bits, group_size), NB=nb(bits), L=reps,
        Q=8, G=group_size, SPLIT_K=ns > 1, **consts(bits), EARLY=early,
        RSCALE=rscale is not None, NRS=triton.next_power_of_2(n_rs), num_warps=1,
        LATE=LATE_TRIGGER if late is None else late,
        launch_pdl=pdl.ON.value, **kw)
    return out
