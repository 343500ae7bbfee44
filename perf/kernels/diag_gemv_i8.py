"""Diagnostic (#5): the batch-1 GEMV on the integer tensor cores, four codes per instruction.

gemv_tc (kernels/quant/gemv_tc.py) makes bf16 pairs of the codes (one LOP3 per two weights,
plus shifts) and multiplies them with mma.m16n8k16 bf16: ~1.2 instructions per weight at 4
bits, ~0.95 at 2. With the GEMV's weights in L2 it still runs 3-6.6 us above a pure load of
the same bytes on its grid (H200 run 25): its dependent arithmetic. Here the codes go to
mma.m16n8k32 as u8 as they are (4-bit: w & 0x0F0F0F0F and (w >> 4) & 0x0F0F0F0F, four codes
per instruction; 2-bit: (w >> 2e) & 0x03030303), against x as two s8 digits per group of G:

    xi = round(x / sx) in [-16319, 16319], sx = max|x_g| / 16319,
    xi = 128 d1 + d0, d1 = (xi + 64) >> 7 in [-127, 127], d0 in [-64, 63]
    sum_k q x ~= sx (128 sum q d1 + sum q d0)      (exact int32 sums; x to 15 bits of its max)

The fragment trick is gemv_tc's: lane (g, c) holds group c's codes as its A columns, B column
col holds group col // 2's digits only (lanes g // 2 == c supply them, the others zeros), so
D[row, 2c] and D[row, 2c + 1] are lane c's own sums, here against d1 (even columns) and d0
(odd): one mma gives both digits. Per step (a lane's 4 words of one word row): 4-bit 12 ALU +
2 mma for 32 weights (0.44 per weight), 2-bit 28 + 4 for 64 (0.5); gemv_tc 1.0-1.2.

Not counted: x's digits, sx and the quantized group sums come from the host (`prep_x`); a
kernel for the engine would make them in the producer's epilogue or a prologue. What this
measures is whether fewer instructions per weight move the time at the engine's shapes,
against gemv_tc in the same run (engine config and without early weights): `python3
perf/kernels/diag_gemv_i8.py --out $OUT/gemv_i8.json`. 3-bit (`asm_step3m`): the 2-bit
plane's codes with the 1-bit plane's bit merged into each byte, against the same digits.
Measured (H100, runs 78 and 80): 15-20% faster than gemv_tc at 2 bits, 3-9% at 4 bits (but
+5% at 5120x5120); the kernel making its own digits (XPREP) costs 1.3-4x its time.
`--selftest` (CPU) checks the operand order of the PTX against mma's fragment layout from the
PTX ISA, emulated in torch, and under TRITON_INTERPRET=1 the kernel's own digits (XPREP)
against prep_x.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.quant.gemv import _workspace, split_k, sum_splits
from volundr.kernels.quant.gemv_tc import _lane_rows, _ld

XMAX = 127 * 128 + 63  # largest |xi|: d1 in [-127, 127], d0 in [-64, 63]
XMAX_C = tl.constexpr(XMAX)


def nb(bits: int) -> int:
    """A registers (of 4 codes) per word: slot i of a word sits in register i % NB, byte i // NB."""
    return 2 if bits == 4 else 4


# ---- x as digits, in the B fragment's order ----------------------------------------------------
def _xi(xk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[groups, G] fp32 -> (sx [groups, 1], xi int32 [groups, G]), rounded as `_digits` does."""
    amax = xk.abs().amax(1, keepdim=True)
    sx = torch.where(amax > 0, amax / XMAX, torch.ones_like(amax))
    inv = XMAX / torch.where(amax > 0, amax, torch.ones_like(amax))
    return sx, torch.floor(xk * inv + 0.5).clamp(-XMAX, XMAX).to(torch.int32)


def prep_x(x: torch.Tensor, bits: int, g: int = 128, mask: bool = False):
    """x [1, K] -> (xd int32 [2, groups, WA, NB], xg fp32 [groups, 2]). xd[d, grp, r, e] packs
    the digits d (0: d1, 1: d0) of word row r's slots NB b + e, byte b = 0..3, i.e. of k = grp G
    + (NB b + e) WA + r (pack.py's slot-major layout): a step's B registers are adjacent, as
    the mma wants its B pair in consecutive registers (else two moves per mma); xg = (sx,
    sx sum xi) per group. mask, 4-bit (`asm_pair4`): per pair of steps (2p, 2p + 1) the order
    (2p, e 0), (2p + 1, e 0), (2p, e 1), (2p + 1, e 1); 2-bit (`asm_step2m`): e 0, 2, 1, 3."""
    k = x.shape[-1]
    pa = 4 if bits == 4 else 2
    wa, n_b = g * pa // 32, nb(bits)
    xk = x.float().reshape(k // g, g)
    sx, xi = _xi(xk)
    d1 = torch.div(xi + 64, 128, rounding_mode="floor")
    d0 = xi - 128 * d1
    r = torch.arange(wa).view(wa, 1, 1)
    e = torch.arange(n_b).view(1, n_b, 1)
    b = torch.arange(4).view(1, 1, 4)
    kl = ((n_b * b + e) * wa + r).reshape(-1)  # [WA * NB * 4]
    digs = torch.stack([d1, d0])[:, :, kl].reshape(2, k // g, wa, n_b, 4).to(torch.int8)
    xd = digs.contiguous().view(torch.int32).reshape(2, k // g, wa, n_b)
    xg = torch.cat([sx, sx * xi.sum(1, keepdim=True).float()], 1)
    if mask and bits == 4:
        xd = xd.reshape(2, k // g, wa // 2, 2, 2).transpose(3, 4).reshape(2, k // g, wa, 2)
    elif mask:  # asm_step2m: a step's registers in the order e 0, 2, 1, 3
        xd = xd[..., [0, 2, 1, 3]]
    return xd.contiguous(), xg.contiguous()


# ---- inline PTX ------------------------------------------------------------------------------
def asm_step(bits: int, s: int) -> str:
    """One step (word row s of a block of 4) for one lane's 4 words, pack = 4. Operands: $0..$3
    out = d1 sums of rows j = 0..3, $4..$7 = d0 sums; $8..$15 in = the same (C); $16..$19 the
    words; then NB tensors of B registers, the block's 4 steps x NB registers in (step,
    register) order, so step s's register e is $20 + NB s + e. Tile t = words 2t, 2t + 1 as
    A rows g, g + 8; its D = (row g: d1, d0; row g + 8: d1, d0) = ($2t, $4+2t, $2t+1, $5+2t)."""
    n_b, pa = nb(bits), (4 if bits == 4 else 2)
    mask = 0x0F0F0F0F if bits == 4 else 0x03030303
    lines, regs = ["{"], []
    for j in range(4):
        for e in range(n_b):
            src = f"${16 + j}"
            if e:
                lines.append(f"shr.u32 w{j}s{e}, {src}, {pa * e};")
                regs.append(f"w{j}s{e}")
                src = f"w{j}s{e}"
            lines.append(f"and.b32 w{j}e{e}, {src}, {mask:#010x};")
            regs.append(f"w{j}e{e}")
    for t in range(2):
        d = [f"${2 * t}", f"${4 + 2 * t}", f"${2 * t + 1}", f"${5 + 2 * t}"]
        c = [f"${8 + 2 * t}", f"${12 + 2 * t}", f"${9 + 2 * t}", f"${13 + 2 * t}"]
        for m in range(n_b // 2):  # mma m: A registers 2m (k 0-15), 2m + 1 (k 16-31)
            a = [f"w{2 * t}e{2 * m}", f"w{2 * t + 1}e{2 * m}", f"w{2 * t}e{2 * m + 1}",
                 f"w{2 * t + 1}e{2 * m + 1}"]
            b = [f"${20 + n_b * s + 2 * m}", f"${20 + n_b * s + 2 * m + 1}"]
            lines.append("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
                         f"{{{', '.join(d)}}}, {{{', '.join(a)}}}, {{{', '.join(b)}}}, "
                         f"{{{', '.join(c if m == 0 else d)}}};")
    lines.insert(1, f".reg .b32 {', '.join(regs)};")
    lines.append("}")
    return "\n".join(lines)


def asm_pair4(p: int) -> str:
    """4-bit without shifts: steps 2p, 2p + 1 of a block for one lane's 4 words each, pack = 4.
    The low codes w & 0x0F0F0F0F and the high ones w & 0xF0F0F0F0 (16 q: still a u8) go to
    separate sums (the high ones' divided by 16 at the end, exactly), so that one mma's A
    holds one kind: rows g, g + 8 of step 2p (k 0-15) and of step 2p + 1 (k 16-31); per two
    steps 16 ALU + 4
    mma for 64 weights (0.31 per weight). Operands: out $0..$3 / $4..$7 the low codes' d1 /
    d0 sums (rows j), $8..$15 the high codes'; in $16..$31 the same (C); $32..$35 step 2p's
    words, $36..$39 step 2p + 1's; then the block's 2 B tensors, pair p's at $40 + 4p + i:
    B(2p, e 0), B(2p + 1, e 0), B(2p, e 1), B(2p + 1, e 1) (prep_x(mask=True))."""
    lines, regs = ["{"], []
    for st in range(2):
        for j in range(4):
            w = f"${32 + 4 * st + j}"
            lines += [f"and.b32 l{st}{j}, {w}, 0x0f0f0f0f;", f"and.b32 h{st}{j}, {w}, 0xf0f0f0f0;"]
            regs += [f"l{st}{j}", f"h{st}{j}"]
    for t in range(2):
        for kind, o, bi in (("l", 0, 0), ("h", 8, 2)):
            d = [f"${o + 2 * t}", f"${o + 4 + 2 * t}", f"${o + 2 * t + 1}", f"${o + 5 + 2 * t}"]
            c = [f"${16 + o + 2 * t}", f"${16 + o + 4 + 2 * t}", f"${16 + o + 2 * t + 1}",
                 f"${16 + o + 5 + 2 * t}"]
            a = [f"{kind}0{2 * t}", f"{kind}0{2 * t + 1}", f"{kind}1{2 * t}",
                 f"{kind}1{2 * t + 1}"]
            b = [f"${40 + 4 * p + bi}", f"${40 + 4 * p + bi + 1}"]
            lines.append("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
                         f"{{{', '.join(d)}}}, {{{', '.join(a)}}}, {{{', '.join(b)}}}, "
                         f"{{{', '.join(c)}}};")
    lines.insert(1, f".reg .b32 {', '.join(regs)};")
    lines.append("}")
    return "\n".join(lines)


def asm_step2m(s: int) -> str:
    """2-bit with one shift per word: w & 0x03030303 (slots 4b, x 1), w & 0x0C0C0C0C (slots
    4b + 1, 4 q), and the same of w >> 4 (slots 4b + 2, 4b + 3); the 4 q codes go to separate
    sums (divided by 4 at the end, exactly). Per step 20 ALU + 4 mma for 64 weights (asm_step:
    28 + 4). Operands: out $0..$7 the x 1 codes' d1 / d0 sums (as asm_step), $8..$15 the 4 q
    codes'; in $16..$31 the same (C); $32..$35 the words; then the block's 4 B tensors, step s
    at $36 + 4s + i in the order e 0, 2, 1, 3 (prep_x(mask=True))."""
    lines, regs = ["{"], []
    for j in range(4):
        w = f"${32 + j}"
        lines += [f"shr.u32 s{j}, {w}, 4;", f"and.b32 m{j}0, {w}, 0x03030303;",
                  f"and.b32 m{j}1, {w}, 0x0c0c0c0c;", f"and.b32 m{j}2, s{j}, 0x03030303;",
                  f"and.b32 m{j}3, s{j}, 0x0c0c0c0c;"]
        regs += [f"s{j}"] + [f"m{j}{e}" for e in range(4)]
    for t in range(2):
        for o, (e0, e1), bi in ((0, (0, 2), 0), (8, (1, 3), 2)):
            d = [f"${o + 2 * t}", f"${o + 4 + 2 * t}", f"${o + 2 * t + 1}", f"${o + 5 + 2 * t}"]
            c = [f"${16 + o + 2 * t}", f"${16 + o + 4 + 2 * t}", f"${16 + o + 2 * t + 1}",
                 f"${16 + o + 5 + 2 * t}"]
            a = [f"m{2 * t}{e0}", f"m{2 * t + 1}{e0}", f"m{2 * t}{e1}", f"m{2 * t + 1}{e1}"]
            b = [f"${36 + 4 * s + bi}", f"${36 + 4 * s + bi + 1}"]
            lines.append("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
                         f"{{{', '.join(d)}}}, {{{', '.join(a)}}}, {{{', '.join(b)}}}, "
                         f"{{{', '.join(c)}}};")
    lines.insert(1, f".reg .b32 {', '.join(regs)};")
    lines.append("}")
    return "\n".join(lines)


def asm_step3m(s: int, h: int) -> str:
    """3-bit (2-bit plane + 1-bit plane, pack.py) as asm_step2m with each code's bit 2 merged
    in: A word row r = 4 h + s's slot i has its bit 2 at bit 2 i + 1 - h of B word s, so
    (B << (1 + h)) puts the bits of slots 4b, 4b + 1 at bits 2 and 4 of byte b, (B >> (3 - h))
    those of slots 4b + 2, 4b + 3: codes (w & 0x03) | (t & 0x04) (x 1) and (w & 0x0c) | (t &
    0x10) (4 q, as in asm_step2m; at most 28). The digits are the 2-bit plane's. Per step 44
    ALU + 4 mma for 64 weights. Operands: as asm_step2m, then $36..$39 the B words, then the
    block's 4 B tensors at $40 + 4s + i (e 0, 2, 1, 3)."""
    lines, regs = ["{"], []
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
            d = [f"${o + 2 * t}", f"${o + 4 + 2 * t}", f"${o + 2 * t + 1}", f"${o + 5 + 2 * t}"]
            c = [f"${16 + o + 2 * t}", f"${16 + o + 4 + 2 * t}", f"${16 + o + 2 * t + 1}",
                 f"${16 + o + 5 + 2 * t}"]
            a = [f"m{2 * t}{e0}", f"m{2 * t + 1}{e0}", f"m{2 * t}{e1}", f"m{2 * t + 1}{e1}"]
            b = [f"${40 + 4 * s + bi}", f"${40 + 4 * s + bi + 1}"]
            lines.append("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
                         f"{{{', '.join(d)}}}, {{{', '.join(a)}}}, {{{', '.join(b)}}}, "
                         f"{{{', '.join(c)}}};")
    lines.insert(1, f".reg .b32 {', '.join(regs)};")
    lines.append("}")
    return "\n".join(lines)


@functools.cache
def consts(bits: int, mask: bool = False) -> dict:
    if bits == 3:
        assert mask, "3-bit: the mask form only"
        return dict(ASM_STEP=tuple(asm_step3m(s, h) for h in range(2) for s in range(4)),
                    CONS=",".join(["=r"] * 16 + ["r"] * 40), MASK=True)
    if mask and bits == 4:
        return dict(ASM_STEP=(asm_pair4(0), asm_pair4(1)),
                    CONS=",".join(["=r"] * 16 + ["r"] * 32), MASK=True)
    if mask:
        return dict(ASM_STEP=tuple(asm_step2m(s) for s in range(4)),
                    CONS=",".join(["=r"] * 16 + ["r"] * 36), MASK=True)
    n_in = 8 + 4 + 4 * nb(bits)
    return dict(ASM_STEP=tuple(asm_step(bits, s) for s in range(4)),
                CONS="=r,=r,=r,=r,=r,=r,=r,=r," + ",".join(["r"] * n_in), MASK=False)


# ---- the kernel ------------------------------------------------------------------------------
@triton.jit
def _digits(x_ptr, xd_ptr, xg_ptr, st, num_groups, G: tl.constexpr, WA: tl.constexpr,
            NB: tl.constexpr, MASK: tl.constexpr):
    """XPREP: set st's 4 groups of x (bf16) as prep_x makes them, into the scratch xd / xg
    (every program of a split writes the same values there, as gemv_tc's NORM does its x')."""
    xv = tl.reshape(tl.load(x_ptr + st * 4 * G + tl.arange(0, 4 * G)).to(tl.float32), [4, G])
    amax = tl.max(tl.abs(xv), axis=1)  # [4]
    sx = tl.where(amax > 0, amax / XMAX_C, 1.0)
    inv = XMAX_C / tl.where(amax > 0, amax, 1.0)
    xi = tl.floor(xv * tl.expand_dims(inv, 1) + 0.5).to(tl.int32)
    xi = tl.minimum(tl.maximum(xi, -XMAX_C), XMAX_C)
    xq = sx * tl.sum(xi, axis=1).to(tl.float32)
    g4 = st * 4 + tl.arange(0, 4)
    tl.store(xg_ptr + g4 * 2, sx)
    tl.store(xg_ptr + g4 * 2 + 1, xq)
    d1 = (xi + 64) >> 7
    d0 = xi - 128 * d1
    sh = 8 * tl.arange(0, 4)[None, None, None, :]
    for d in tl.static_range(2):
        v = d1 if d == 0 else d0
        # k = (NB b + e) WA + r -> [c, r, e, b], bytes b packed into one int32
        v = tl.permute(tl.reshape(v, [4, 4, NB, WA]), (0, 3, 2, 1))
        w = tl.sum((v & 0xFF) << sh, axis=3)  # [4, WA, NB]
        if MASK and NB == 2:  # (pair, e, step of the pair)
            w = tl.reshape(tl.permute(tl.reshape(w, [4, WA // 2, 2, 2]), (0, 1, 3, 2)),
                           [4, WA, NB])
        elif MASK:  # e in the order 0, 2, 1, 3
            w = tl.reshape(tl.permute(tl.reshape(w, [4, WA, 2, 2]), (0, 1, 3, 2)),
                           [4, WA, NB])
        off = (((d * num_groups + st * 4 + tl.arange(0, 4))[:, None, None] * WA
                + tl.arange(0, WA)[None, :, None]) * NB + tl.arange(0, NB)[None, None, :])
        tl.store(xd_ptr + off, w)


@triton.jit
def gemv_i8_kernel(xd_ptr, xg_ptr, qa_ptr, sz_ptr, y_ptr, ws_ptr, cnt_ptr,
                   N, num_groups, sets_per_split, num_splits,
                   WA: tl.constexpr, NB: tl.constexpr, L: tl.constexpr, Q: tl.constexpr,
                   SPLIT_K: tl.constexpr, ASM_STEP: tl.constexpr, CONS: tl.constexpr,
                   MASK: tl.constexpr, NK: tl.constexpr = 0, EARLY: tl.constexpr = False,
                   XPREP: tl.constexpr = False, x_ptr=None, G: tl.constexpr = 128,
                   BITS3: tl.constexpr = False, qb_ptr=None):
    """Grid (N / BN, num_splits), BN = 4 L Q, one warp (Q = 8); N a multiple of BN and whole
    sets of 4 groups (no masks). gemv_tc's program without its options. NK > 0: N = NK known
    to the compiler, so a load's row offset is an immediate (gemv_tc spends ~4 integer
    instructions per 128-bit load on its 64-bit address). MASK: asm_pair4 / asm_step2m.
    EARLY: each set's first block of words is loaded before PDL's wait (gemv_tc's early=1).
    XPREP: the program makes its sets' digits from x itself (`_digits`) into xd / xg, then
    reads them as it reads prep_x's: what the digits cost without a producer that makes them.
    BITS3 (with MASK): 3-bit, qa the 2-bit plane, qb the 1-bit plane (asm_step3m)."""
    if NK > 0:
        N = NK
    pdl.trigger()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BN: tl.constexpr = 4 * L * Q
    set0 = pid_k * sets_per_split
    set1 = tl.minimum(set0 + sets_per_split, num_groups // 4)
    if not EARLY:
        pdl.wait()
    c4, q4, j4, n, nmask = _lane_rows(pid_n, N, BN, Q, L)
    # B: lane (quad g, c) supplies column g: group c's digits iff g // 2 == c, d1 for even g
    sel = ((q4 % 8) // 2) == c4  # [4, Q, 1, 1]
    dig = (q4 % 2) * num_groups  # [1, Q, 1, 1]
    acc = tl.zeros([4, Q, L, 4], dtype=tl.float32)
    for st in range(set0, set1):
        grp = st * 4 + c4
        pre = ()
        bws = ()
        if BITS3:  # the set's 4 B word rows serve both blocks (A rows s and 4 + s)
            for s in tl.static_range(4):
                bws = bws + (_ld(qb_ptr + (grp * (WA // 2) + s) * N + n, nmask, False),)
        if EARLY:  # weights are never written by an earlier kernel
            for s in tl.static_range(4):
                pre = pre + (_ld(qa_ptr + (grp * WA + s) * N + n, nmask, False),)
            pdl.wait()  # (a no-op after the first set)
        if XPREP:
            _digits(x_ptr, xd_ptr, xg_ptr, st, num_groups, G, WA, NB, MASK)
            tl.debug_barrier()  # the set's digits are in xd before any lane reads them
        s1 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
        s0 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
        t1 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
        t0 = tl.zeros([4, Q, L, 4], dtype=tl.int32)
        for blk in tl.static_range(WA // 4):
            xbs = ()
            for u in tl.static_range(NB):  # 4 of the block's 4 NB B registers
                xbs = xbs + (_ld(xd_ptr + (dig + grp) * (WA * NB) + blk * 4 * NB + 4 * u + j4,
                                 sel, True),)
            ws = ()
            for s in tl.static_range(4):
                if EARLY and blk == 0:
                    ws = ws + (pre[s],)
                else:
                    ws = ws + (_ld(qa_ptr + (grp * WA + blk * 4 + s) * N + n, nmask, False),)
            if BITS3:
                for s in tl.static_range(4):
                    s1, s0, t1, t0 = tl.inline_asm_elementwise(
                        ASM_STEP[blk * 4 + s], CONS, (s1, s0, t1, t0, ws[s], bws[s]) + xbs,
                        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4)
            elif MASK and NB == 4:  # 2-bit, asm_step2m
                for s in tl.static_range(4):
                    s1, s0, t1, t0 = tl.inline_asm_elementwise(
                        ASM_STEP[s], CONS, (s1, s0, t1, t0, ws[s]) + xbs,
                        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4)
            elif MASK:  # 4-bit, asm_pair4
                for pp in tl.static_range(2):
                    s1, s0, t1, t0 = tl.inline_asm_elementwise(
                        ASM_STEP[pp], CONS, (s1, s0, t1, t0, ws[2 * pp], ws[2 * pp + 1]) + xbs,
                        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4)
            else:
                for s in tl.static_range(4):
                    s1, s0 = tl.inline_asm_elementwise(ASM_STEP[s], CONS, (s1, s0, ws[s]) + xbs,
                                                       dtype=(tl.int32, tl.int32),
                                                       is_pure=True, pack=4)
        if MASK:  # the scaled codes' sums: 16 (4-bit) or 4 (2-bit) x theirs, exactly
            s1 += t1 >> (8 // NB)
            s0 += t0 >> (8 // NB)
        szw = _ld(sz_ptr + grp * N + n, nmask, False)
        sc = (szw << 16).to(tl.float32, bitcast=True)
        zr = (szw & -65536).to(tl.float32, bitcast=True)
        sx = tl.load(xg_ptr + grp * 2)
        xq = tl.load(xg_ptr + grp * 2 + 1)
        f = sx * (s1.to(tl.float32) * 128.0 + s0.to(tl.float32))
        acc += sc * (f - zr * xq)
    y = tl.sum(acc, axis=0)  # [Q, L, 4]
    n3 = pid_n * BN + 4 * (Q * tl.arange(0, L)[None, :, None] + tl.arange(0, Q)[:, None, None]) \
        + tl.arange(0, 4)[None, None, :]
    ymask = n3 < N
    if SPLIT_K:
        tl.store(ws_ptr + pid_k.to(tl.int64) * N + n3, y, mask=ymask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == num_splits - 1:
            tot = sum_splits(ws_ptr + n3, N, num_splits, ymask, y)
            tl.store(y_ptr + n3, tot.to(y_ptr.dtype.element_ty), mask=ymask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    else:
        tl.store(y_ptr + n3, y.to(y_ptr.dtype.element_ty), mask=ymask)


def gemv_i8(xd, xg, qa, sz, bits: int, group_size: int, out: torch.Tensor, reps: int = 2,
            waves: float = 24.0, maxnreg: int | None = 128, const_n: bool = False,
            mask: bool = False, early: bool = False, x: torch.Tensor | None = None,
            qb: torch.Tensor | None = None):
    """out [1, N] = x @ W^T from prep_x's (xd, xg) (made with the same `mask`); 2, 3 (mask
    only; qb the 1-bit plane) or 4 bits, one-warp programs. x given: the kernel makes the
    digits itself, into xd / xg (scratch of prep_x's shapes)."""
    n = qa.shape[1]
    pa = 4 if bits == 4 else 2
    wa = group_size * pa // 32
    num_groups = xg.shape[0]
    bn = 32 * reps
    assert n % bn == 0 and num_groups % 4 == 0 and bits in (2, 3, 4)
    assert bits != 3 or (mask and qb is not None and x is None)
    n_tiles = n // bn
    sps, ns = split_k(n_tiles, num_groups // 4, qa.device, waves)
    ws, cnt = _workspace(qa.device, n_tiles, ns * n) if ns > 1 else (out, out)
    kw = {} if maxnreg is None else {"maxnreg": maxnreg}
    gemv_i8_kernel[(n_tiles, ns)](xd, xg, qa, sz, out, ws, cnt, n, num_groups, sps, ns,
                                  WA=wa, NB=nb(bits), L=reps, Q=8, SPLIT_K=ns > 1,
                                  **consts(bits, mask), NK=n if const_n else 0,
                                  EARLY=early, XPREP=x is not None, x_ptr=x, G=group_size,
                                  BITS3=bits == 3, qb_ptr=qb,
                                  num_warps=1,
                                  launch_pdl=pdl.ON.value, **kw)
    return out


# ---- CPU check of the PTX's operand order ------------------------------------------------------
def run_asm(asm: str, ins: dict[int, list[int]], n_out: int) -> list[list[int]]:
    """Runs one of this file's PTX blocks on 32 emulated lanes: shr / shl / and / or per lane,
    each
    mma.m16n8k32 (u8 A, s8 B) with its fragments as the PTX ISA lays them out (lane = 4 g + c;
    A: a0 row g cols 4c.., a1 row g + 8, a2 row g cols 16 + 4c.., a3 row g + 8; B: b0 rows 4c..
    col g, b1 rows 16 + 4c..; C / D: row g cols 2c, 2c + 1, then row g + 8). ins: operand
    index -> its 32 lanes' values (outputs start at 0). Returns the outputs [n_out][32]."""
    regs = [{f"${i}": 0 for i in range(n_out)} for _ in range(32)]
    for i, vals in ins.items():
        for lane in range(32):
            regs[lane][f"${i}"] = int(vals[lane]) & 0xFFFFFFFF

    def u8(v: int) -> list[int]:
        return [(v >> (8 * i)) & 0xFF for i in range(4)]

    def s8(v: int) -> list[int]:
        return [b - 256 if b > 127 else b for b in u8(v)]

    def ops(line: str) -> list[str]:
        return [o.strip(" {};") for o in line.split(" ", 1)[1].split(",")]

    def cd(g: int, q: int) -> list[tuple[int, int]]:
        return [(g, 2 * q), (g, 2 * q + 1), (g + 8, 2 * q), (g + 8, 2 * q + 1)]

    for line in asm.splitlines():
        line = line.strip()
        if line.startswith(("shr.u32", "shl.b32", "and.b32", "or.b32")):
            d, x, y = ops(line)
            for r in regs:
                v = r[y] if y in r else int(y, 0)
                r[d] = {"shr": r[x] >> v, "shl": (r[x] << v) & 0xFFFFFFFF, "and": r[x] & v,
                        "or.": r[x] | v}[line[:3]]
        elif line.startswith("mma"):
            o = ops(line)
            dn, an, bn, cn = o[0:4], o[4:8], o[8:10], o[10:14]
            a = torch.zeros(16, 32, dtype=torch.int64)
            b = torch.zeros(32, 8, dtype=torch.int64)
            c = torch.zeros(16, 8, dtype=torch.int64)
            for lane, r in enumerate(regs):
                g, q = lane // 4, lane % 4
                for i, (row, col) in enumerate([(g, 4 * q), (g + 8, 4 * q), (g, 16 + 4 * q),
                                                (g + 8, 16 + 4 * q)]):
                    a[row, col:col + 4] = torch.tensor(u8(r[an[i]]))
                for i, row in enumerate([4 * q, 16 + 4 * q]):
                    b[row:row + 4, g] = torch.tensor(s8(r[bn[i]]))
                for i, (row, col) in enumerate(cd(g, q)):  # s32
                    v = r[cn[i]] & 0xFFFFFFFF
                    c[row, col] = v - (v >> 31 << 32)
            dm = c + a @ b
            for lane, r in enumerate(regs):
                for i, (row, col) in enumerate(cd(lane // 4, lane % 4)):
                    r[dn[i]] = int(dm[row, col])
        else:
            assert line in ("{", "}") or line.startswith(".reg"), line
    return [[regs[lane][f"${i}"] for lane in range(32)] for i in range(n_out)]


def selftest(bits: int, mask: bool = False, seed: int = 0) -> float:
    """One set (4 groups; rows 4 quad + j of one warp, lane c holding group c) through the
    emulated PTX of every step, against the direct sums of codes x digits. Returns the largest
    |difference| (0 when right)."""
    from volundr.kernels.quant.pack import to_kernel_layout

    gen = torch.Generator().manual_seed(seed)
    g = 128
    pa = 4 if bits == 4 else 2
    wa, n_b = g * pa // 32, nb(bits)
    q = torch.randint(0, 2**bits, (32, 4 * g), generator=gen)
    x = torch.randn(1, 4 * g, generator=gen).to(torch.bfloat16)
    xd, _ = prep_x(x, bits, g, mask)
    qa, qb = to_kernel_layout(q.to(torch.uint8), bits, g)  # [4 WA, 32], 3-bit [4 WA / 2, 32]
    n_acc = 16 if mask else 8
    acc = [[0] * 32 for _ in range(n_acc)]
    lanes = range(32)
    for blk in range(wa // 4):
        # the block's B tensors (flat: NB registers x 4 steps in xd's order), zero where the
        # lane supplies no column of its group
        xb = [[int(xd[lane // 4 % 2, lane % 4, 4 * blk:4 * blk + 4, :].reshape(-1)[f])
               if (lane // 4) // 2 == lane % 4 else 0 for lane in lanes] for f in range(4 * n_b)]

        def words(r: int) -> list[list[int]]:  # lane's 4 words j of word row r
            return [[int(qa[(lane % 4) * wa + r, 4 * (lane // 4) + j]) for lane in lanes]
                    for j in range(4)]

        if bits == 3:
            for st in range(4):
                ins = {16 + i: acc[i] for i in range(16)}
                ins.update({32 + j: v for j, v in enumerate(words(4 * blk + st))})
                ins.update({36 + j: [int(qb[(lane % 4) * (wa // 2) + st, 4 * (lane // 4) + j])
                                     for lane in lanes] for j in range(4)})
                ins.update({40 + f: xb[f] for f in range(16)})
                acc = run_asm(asm_step3m(st, blk), ins, 16)
        elif mask and bits == 2:
            for st in range(4):
                ins = {16 + i: acc[i] for i in range(16)}
                ins.update({32 + j: v for j, v in enumerate(words(4 * blk + st))})
                ins.update({36 + f: xb[f] for f in range(16)})
                acc = run_asm(asm_step2m(st), ins, 16)
        elif mask:
            for pp in range(2):
                ins = {16 + i: acc[i] for i in range(16)}
                ins.update({32 + i: v for i, v in enumerate(words(4 * blk + 2 * pp)
                                                             + words(4 * blk + 2 * pp + 1))})
                ins.update({40 + f: xb[f] for f in range(8)})
                acc = run_asm(asm_pair4(pp), ins, 16)
        else:
            for st in range(4):
                ins = {8 + i: acc[i] for i in range(8)}
                ins.update({16 + j: v for j, v in enumerate(words(4 * blk + st))})
                ins.update({20 + f: xb[f] for f in range(4 * n_b)})
                acc = run_asm(asm_step(bits, st), ins, 8)
    s1 = torch.tensor(acc[0:4]).t()  # [lane, j]
    s0 = torch.tensor(acc[4:8]).t()
    if mask:
        s1 = s1 + (torch.tensor(acc[8:12]).t() >> (8 // n_b))
        s0 = s0 + (torch.tensor(acc[12:16]).t() >> (8 // n_b))
    xi = _xi(x.float().view(4, g))[1].to(torch.int64)
    d1 = torch.div(xi + 64, 128, rounding_mode="floor")
    d0 = xi - 128 * d1
    err = 0
    for lane in lanes:
        quad, c = lane // 4, lane % 4
        for j in range(4):
            row = q[4 * quad + j, c * g:(c + 1) * g].to(torch.int64)
            err = max(err, abs(int((row * d1[c]).sum()) - int(s1[lane, j])),
                      abs(int((row * d0[c]).sum()) - int(s0[lane, j])))
    return float(err)


@triton.jit
def _digits_kernel(x_ptr, xd_ptr, xg_ptr, num_groups, G: tl.constexpr, WA: tl.constexpr,
                   NB: tl.constexpr, MASK: tl.constexpr):
    _digits(x_ptr, xd_ptr, xg_ptr, tl.program_id(0), num_groups, G, WA, NB, MASK)


@triton.jit
def _digits_pdl_kernel(x_ptr, xd_ptr, xg_ptr, num_groups, G: tl.constexpr, WA: tl.constexpr,
                       NB: tl.constexpr, MASK: tl.constexpr):
    """The digits as their own launch before the GEMV (one program per set), chained by PDL:
    what a producer-less engine would pay per x."""
    pdl.trigger()
    pdl.wait()
    _digits(x_ptr, xd_ptr, xg_ptr, tl.program_id(0), num_groups, G, WA, NB, MASK)


def prep_digits(x: torch.Tensor, xd: torch.Tensor, xg: torch.Tensor, bits: int,
                mask: bool) -> None:
    """prep_x's (xd, xg) made on the GPU by one small launch (`_digits_pdl_kernel`)."""
    pa = 4 if bits == 4 else 2
    groups = x.shape[-1] // 128
    _digits_pdl_kernel[(groups // 4,)](x, xd, xg, groups, G=128, WA=128 * pa // 32,
                                       NB=nb(bits), MASK=mask, launch_pdl=pdl.ON.value)


def digits_check(bits: int, mask: bool, k: int = 1024, seed: int = 0) -> float:
    """`_digits` (the kernel's own digits, XPREP) against prep_x: largest difference of xd
    (exact integers) and of xg. Under TRITON_INTERPRET=1 on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    x[0, :128] = 0  # a zero group: sx = 1
    xd, xg = prep_x(x, bits, mask=mask)
    od, og = torch.zeros_like(xd), torch.zeros_like(xg)
    pa = 4 if bits == 4 else 2
    _digits_kernel[(k // 512,)](x, od, og, k // 128, G=128, WA=128 * pa // 32, NB=nb(bits),
                                MASK=mask)
    return max((od - xd).abs().max().item(), (og - xg).abs().max().item())


# ---- the measurement -------------------------------------------------------------------------
SHAPES = [(5120, 5120), (15680, 5120), (17408, 5120), (34816, 5120), (5120, 17408)]


def bench_case(n: int, k: int, bits: int, cfgs: list, data: dict) -> None:
    """gemv_tc (the engine's config, and without early weights) and the i8 configs at one
    shape: each checked against the naive reference, then timed over rotating weight copies."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_quant import STREAM_BYTES, layer_bytes, random_layer, time_graph

    from volundr.kernels.quant.engine import GEMV_TC_CONFIG
    from volundr.kernels.quant.gemv_tc import gemv_tc
    from volundr.kernels.quant.naive import naive_quant_matmul

    nbytes = layer_bytes(random_layer(n, k, bits))
    copies = max(2, min(64, math.ceil(STREAM_BYTES / nbytes)))
    layers = [random_layer(n, k, bits, seed=c) for c in range(copies)]
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    ref = naive_quant_matmul(x.float(), *layers[0], bits, 128, k)
    xds = {m: prep_x(x, bits, mask=m) for m in (False, True)}
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    tc = dict(GEMV_TC_CONFIG[bits])

    def tc_fn(early: int):
        return lambda c: gemv_tc(x, *layers[c], bits, 128, out=y, early=early, **tc)

    def i8_fn(reps: int, waves: int, cap: int, cn: int, mask: int, early: int, xprep: int):
        xd, xg = xds[bool(mask)]
        if xprep:  # scratch: the kernel writes the digits there itself
            xd, xg = torch.full_like(xd, -1), torch.full_like(xg, float("nan"))
        if xprep == 2:  # a separate digits launch before each GEMV
            def fn(c):
                prep_digits(x, xd, xg, bits, bool(mask))
                return gemv_i8(xd, xg, layers[c][0], layers[c][2], bits, 128, y, reps, waves,
                               cap or None, bool(cn), bool(mask), bool(early), None,
                               layers[c][1] if bits == 3 else None)
            return fn
        return lambda c: gemv_i8(xd, xg, layers[c][0], layers[c][2], bits, 128, y, reps, waves,
                                 cap or None, bool(cn), bool(mask), bool(early),
                                 x if xprep else None, layers[c][1] if bits == 3 else None)

    variants = [("tc engine", tc_fn(pdl.EARLY_WEIGHTS.get(bits, 0))), ("tc early 0", tc_fn(0))]
    names = set()
    for r, w, cap, cn, mask, early, xprep in cfgs:
        if bits == 3 and (not mask or xprep == 1):  # (3-bit: asm_step3m only)
            continue
        name = (f"i8 r{r} w{w} cap{cap}{' N' * cn}{' mask' * mask}{' early' * early}"
                f"{['', ' xprep', ' +prep'][xprep]}")
        if name not in names:
            names.add(name)
            variants.append((name, i8_fn(r, w, cap, cn, mask, early, xprep)))
    for name, fn in variants:
        rec = {"n": n, "k": k, "bits": bits, "variant": name, "bytes": nbytes}
        try:
            y.fill_(float("nan"))
            fn(0)
            torch.cuda.synchronize()
            rec["rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
            if rec["rel_err"] < 1e-2:  # NaN too: never time a wrong kernel
                rec["us"] = time_graph(fn, copies, rep=40)
                rec["frac_copy"] = nbytes / (rec["us"] * 1e-6) / 1e9 / data["copy_gbs"]
            else:
                rec["error"] = f"wrong result: rel_err {rec['rel_err']:.3g}"
        except Exception as e:  # record, go on
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        data["rows"].append(rec)
        res = (f"{rec['us']:8.2f} us {100 * rec['frac_copy']:5.1f}%" if "us" in rec
               else rec["error"])
        print(f"{n:6d}x{k:<6d} {bits}b {name:22s} err {rec.get('rel_err', -1):.1e} {res}",
              flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gemv_i8.json")
    ap.add_argument("--selftest", action="store_true", help="CPU: the PTX's operand order")
    ap.add_argument("--configs",
                    default="2,24,168,1,1,1,0;2,16,168,1,1,1,0;2,24,128,1,1,1,0;"
                            "2,24,168,1,1,1,2;2,16,168,1,1,1,2",
                    help="reps,waves,maxnreg (0: uncapped),const_n,mask (asm_pair4 / "
                         "asm_step2m),early (0/1 each),xprep (1: in the kernel, 2: a "
                         "launch before it) of the i8 kernel, ';'-separated")
    ap.add_argument("--bits", default="2,3,4")
    args = ap.parse_args(argv)
    if args.selftest:
        errs = {"2": selftest(2), "4": selftest(4), "4 mask": selftest(4, True),
                "2 mask": selftest(2, True), "3 mask": selftest(3, True)}
        if os.environ.get("TRITON_INTERPRET") == "1":
            errs.update({f"digits {b}{' mask' * m}": digits_check(b, m)
                         for b in (2, 4) for m in (False, True)})
        print("selftest (max |emulated - direct|):", errs)
        return 0 if not any(errs.values()) else 1
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_quant import copy_bandwidth

    cfgs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    t0 = time.time()
    data = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__, "copy_gbs": copy_bandwidth(), "rows": []}
    for n, k in SHAPES:
        for bits in (int(b) for b in args.bits.split(",")):
            bench_case(n, k, bits, cfgs, data)
    data["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
