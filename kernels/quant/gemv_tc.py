"""M = 1 (decode) mixed-bit GEMV on the tensor cores: two weights per dequantising instruction.

y [1, N] = x [1, K] @ W^T for the kernel layout of pack.py, bf16 x only (`supported`). Same
result as the FMA path of gemv.py (which is issue-bound at M = 1, ~3.3-4.4 SASS instructions
per weight, see perf/RESULTS.md) with ~0.95 (2-bit), 1.25 (3-bit), 1.2 (4-bit):

* Dequantise pairs. One LOP3 turns two codes of a word (slots i and i + S/2 of its S slots sit
  at the same bit offset of the low and the high 16 bits) into a bf16x2 pair
      ((w >> sh) & (m | m << 16)) | 0x43004300  =  (128 + q_lo 2^o, 128 + q_hi 2^o)   (exact)
  with the code at mantissa offset o <= 7 - b. One shift serves the slots of a window: per
  32-bit word 4-bit takes 3 shifts + 4 LOP3 (8 weights), 2-bit 2 + 8 (16 weights); 3-bit first
  merges the high-bit plane into the low bits with one select LOP3 per 8 weights (~14.5
  instructions per 16 weights: per step one A word and its B word).
* Multiply-add on the tensor cores: mma.m16n8k16 bf16 x bf16 -> fp32 (exact products, fp32
  accumulation: the precision of the FMA path). x' = x 2^-o (exact) so each product is
  128 x' + q x; the per-group sums B = sum 128 x' and X = sum x come from one more mma per
  step with a constant A, and a group adds s (F - B - z X), F = the mma sum.
* Fragments. Lane = 4 quad + c holds 4 words j (one 128-bit load, output rows 4 quad + j) of
  group 4 set + c: a warp covers 32 rows (per rep) and 4 groups at once. mma tile t of a quad
  takes words 2t, 2t + 1 as A rows g, g + 8 (g = quad % 8) and two pairs of each as its k
  columns; B column col holds x' only for the k of group col // 2 (lane (g, c) supplies x' iff
  g // 2 == c, else zeros: its x loads are masked). So D[row, 2c] is exactly lane c's own
  sum: per lane the mma is an elementwise "acc += sum of its pairs times x'", and each lane
  ends with its own (row, group) sums, not replicated ones.

Triton has no mma on register fragments, so dequantisation + mma of a step is inline PTX
(`tl.inline_asm_elementwise`, pack = 4: one lane's 4 words per call). Tensors are shaped
[4, Q, L, 4] = (c, quad, rep, j) (x pairs [4, Q, 1, 4], element = one of 4 A rows of a block):
with contiguity only along j, Triton 3.6's blocked layout orders the dims (3, 0, 1, 2), which
puts j in registers, c on lane bits 0-1 and quads on lane bits 2-4 and on warps, i.e. the
fragment layout above (tests/test_quant.py checks it on CUDA). Under TRITON_INTERPRET=1 (no
PTX) the same kernel runs a pure-Triton twin of each asm block (`USE_ASM=False`, the x loads
unmasked) computing the same per-lane sums.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.grid_sync import grid_wait
from volundr.kernels.quant.digits import epilogue as digits_epilogue
from volundr.kernels.quant.digits import swiglu_epilogue as digits_swiglu_epilogue
from volundr.kernels.quant.digits import workspace as digits_workspace
from volundr.kernels.quant.gemv import split_k, sum_splits

MAGIC = 0x43004300  # bf16x2 (128, 128): a code OR-ed into the mantissa reads 128 + q 2^o
NEG0 = 0x80008000  # bf16x2 (-0, -0): fma(a, b, -0) = a * b exactly, sign of 0 kept


# ---- pair tables: which slots share a LOP3 and where they land ---------------------------------
def pair_plan(bits: int) -> list[tuple[int, int, int, int]]:
    """The bf16x2 pairs of one word, in mma order: (slot i of the low half (the high half holds
    slot i + S/2), right shift of the source word, mask of one half, offset o = code position
    in the bf16 mantissa). 3-bit: the sources are the merged words of even (i % 2 == 0) and odd
    slots, slot i at bit 4 (i // 2) of its merged word (see `_step_ref`)."""
    if bits == 4:  # slot i at 4i: each moved to offset 0 (a bf16 mantissa holds 7 bits)
        return [(i, 4 * i, 0xF, 0) for i in range(4)]
    if bits == 2:  # slot i at 2i: one shift per window of 3 slots, at offsets 0, 2, 4
        return [(i, 6 * (i // 3), 0x3 << (2 * (i % 3)), 2 * (i % 3)) for i in range(8)]
    e = [i // 2 for i in range(8)]
    return [(i, 8 * (e[i] // 2), 0x7 << (4 * (e[i] % 2)), 4 * (e[i] % 2)) for i in range(8)]


def _plan_consts(bits: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """pair_plan as the kernel's constexpr tables: shifts, 32-bit masks, offsets."""
    plan = pair_plan(bits)
    return (tuple(p[1] for p in plan), tuple(p[2] | p[2] << 16 for p in plan),
            tuple(p[3] for p in plan))


# ---- inline PTX ------------------------------------------------------------------------------
def _bf16x2(v: float) -> int:
    """Bit pattern of the bf16x2 (v, v)."""
    b = int(torch.tensor(v, dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    return b | b << 16


def _mma(d: list[str], a: list[str], b: list[str], c: list[str]) -> str:
    return (f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{', '.join(d)}}}, "
            f"{{{', '.join(a)}}}, {{{', '.join(b)}}}, {{{', '.join(c)}}};")


def asm_pairs(off: int) -> str:
    """Pair builder, pack = 2: x of slot i at two block rows ($2, bf16x2) and of slot i + S/2
    ($3) -> the (slot i, slot i + S/2) bf16x2 pairs of the two rows ($0, $1), times 2^-off
    (exact: a power of two)."""
    lines = ["prmt.b32 $0, $2, $3, 0x5410;", "prmt.b32 $1, $2, $3, 0x7632;"]
    if not off:
        return "\n".join(lines)
    return "\n".join(["{", ".reg .b32 sc, nz;", f"mov.b32 sc, {_bf16x2(2.0 ** -off):#010x};",
                      f"mov.b32 nz, {NEG0:#010x};", *lines, "fma.rn.bf16x2 $0, $0, sc, nz;",
                      "fma.rn.bf16x2 $1, $1, sc, nz;", "}"])


def _dequant_ptx(bits: int, srcs: list[str], pre: str, lines: list[str], regs: list[str]):
    """PTX for the pairs of `pair_plan` of one word (3-bit: srcs = A word, its B word moved
    for the even-slot merge, for the odd-slot merge). Returns the pair register names."""
    if bits == 3:
        a, b_even, b_odd = srcs
        # merged words: select (LUT 0xE4 = a & c | b & ~c) of the low bits of a and the high
        # bit of b, 3-bit codes of even (odd) slots at 4e, 16 + 4e
        lines += [f"lop3.b32 {pre}e, {a}, {b_even}, 0x33333333, 0xE4;",
                  f"shr.u32 {pre}a, {a}, 2;",
                  f"lop3.b32 {pre}o, {pre}a, {b_odd}, 0x33333333, 0xE4;",
                  f"shr.u32 {pre}e8, {pre}e, 8;", f"shr.u32 {pre}o8, {pre}o, 8;"]
        regs += [f"{pre}{t}" for t in ("e", "a", "o", "e8", "o8")]
        src = {(i, sh): f"{pre}{'o' if i % 2 else 'e'}{'8' if sh else ''}"
               for i, sh, _, _ in pair_plan(3)}
    else:
        (w,) = srcs
        shifts = sorted({sh for _, sh, _, _ in pair_plan(bits) if sh})
        lines += [f"shr.u32 {pre}s{sh}, {w}, {sh};" for sh in shifts]
        regs += [f"{pre}s{sh}" for sh in shifts]
        src = {(i, sh): f"{pre}s{sh}" if sh else w for i, sh, _, _ in pair_plan(bits)}
    names = []
    for i, sh, m, _ in pair_plan(bits):
        # (src & mask) | MAGIC in one LOP3 (LUT 0xEA = a & b | c)
        lines.append(f"lop3.b32 {pre}p{i}, {src[(i, sh)]}, {m | m << 16:#010x}, {MAGIC:#010x}, "
                     f"0xEA;")
        names.append(f"{pre}p{i}")
    regs += names
    return names


def n_pair_tensors(bits: int) -> int:
    """x pair tensors per block of 4 A rows: one per pair of a word."""
    return {2: 8, 3: 8, 4: 4}[bits]


def asm_step(bits: int, s: int, h: int = 0) -> str:
    """One step (block row s) for one lane's 4 words, pack = 4. Operands: $0..$3 out = D of
    words j = 0..3 (output rows 4 quad + j, the lane's group); $4..$7 in = C; then the words
    ($8..$11; 3-bit: then their B words $12..$15, h = 0 for an A row of the first half of the
    group, 1 for the second); then the x pair tensors (n_pair_tensors), 4 operands each
    (elements = block rows), of which element s is used. Words 0, 1 are A rows g, g + 8 of the
    first mma tile, words 2, 3 of the second."""
    lines, regs, fregs = ["{"], [], []
    base = 16 if bits == 3 else 12
    pairs = []
    for j in range(4):
        if bits == 3:
            # high bit of slot i at 2i + 1 of b for a first-half A row, at 2i for the second;
            # the even-slot merge wants it at 2i + 2, the odd-slot merge (a >> 2) at 2i
            b = f"${12 + j}"
            if h == 0:
                lines += [f"shl.b32 b{j}e, {b}, 1;", f"shr.u32 b{j}o, {b}, 1;"]
                regs += [f"b{j}e", f"b{j}o"]
                srcs = [f"${8 + j}", f"b{j}e", f"b{j}o"]
            else:
                lines += [f"shl.b32 b{j}e, {b}, 2;"]
                regs += [f"b{j}e"]
                srcs = [f"${8 + j}", f"b{j}e", b]
            pairs.append(_dequant_ptx(3, srcs, f"u{j}", lines, regs))
        else:
            pairs.append(_dequant_ptx(bits, [f"${8 + j}"], f"u{j}", lines, regs))
    for t in range(2):
        pa, pb = pairs[2 * t], pairs[2 * t + 1]
        d = [f"d{t}{i}" for i in range(4)]
        fregs += d
        # columns 2c + 1 duplicate 2c: their C is left undefined (k<t>), which spares ptxas
        # two register copies per mma tile
        c = [f"${4 + 2 * t}", f"k{t}1", f"${5 + 2 * t}", f"k{t}3"]
        fregs += [f"k{t}1", f"k{t}3"]
        for m in range(len(pa) // 2):
            a = [pa[2 * m], pb[2 * m], pa[2 * m + 1], pb[2 * m + 1]]
            b = [f"${base + 4 * (2 * m) + s}", f"${base + 4 * (2 * m + 1) + s}"]
            lines.append(_mma(d, a, b, c if m == 0 else d))
        lines += [f"mov.f32 ${2 * t}, {d[0]};", f"mov.f32 ${2 * t + 1}, {d[2]};"]
    lines.insert(1, f".reg .b32 {', '.join(regs)};")
    lines.insert(2, f".reg .f32 {', '.join(fregs)};")
    lines.append("}")
    return "\n".join(lines)


def asm_xsum(bits: int, s: int) -> str:
    """Group sums for block row s, pack = 4: $0 = X + sum x, $1 = B + sum 128 x' (X, B = $4,
    $5; $2, $3 = 0) from the x pair tensors ($24 + 4 p + s) with a constant A: rows g hold
    2^o (x' 2^o = x), rows g + 8 hold 128. A comes in as operands ($8 + 4 r, r = register of
    the fragment, one (offsets of pairs 2m, 2m + 1) per mma: `xsum_consts`) so that ptxas keeps
    it in registers across the loop."""
    n_mma = n_pair_tensors(bits) // 2
    lines = ["{", ".reg .f32 d0, d1, d2, d3, k1, k3;"]
    d = ["d0", "d1", "d2", "d3"]
    for m in range(n_mma):
        a = [f"${8 + 4 * r + _xsum_slot(bits, m)}" for r in range(4)]
        b = [f"${24 + 4 * (2 * m) + s}", f"${24 + 4 * (2 * m + 1) + s}"]
        lines.append(_mma(d, a, b, ["$4", "k1", "$5", "k3"] if m == 0 else d))
    lines += ["mov.f32 $0, d0;", "mov.f32 $1, d2;", "mov.f32 $2, 0f00000000;",
              "mov.f32 $3, 0f00000000;", "}"]
    return "\n".join(lines)


def _xsum_slot(bits: int, m: int) -> int:
    """Which element (of 4) of the constant A operands holds mma m's fragment."""
    offs = [p[3] for p in pair_plan(bits)]
    kinds = sorted({(offs[2 * i], offs[2 * i + 1]) for i in range(len(offs) // 2)})
    return kinds.index((offs[2 * m], offs[2 * m + 1]))


def xsum_consts(bits: int) -> tuple[tuple[int, int, int, int], ...]:
    """Constant A registers (a0, a1, a2, a3) of the X/B mma: element e of the 4 operand
    tensors = the fragment for the e-th distinct (offset, offset) pair of pairs (<= 4)."""
    offs = [p[3] for p in pair_plan(bits)]
    kinds = sorted({(offs[2 * i], offs[2 * i + 1]) for i in range(len(offs) // 2)})
    assert len(kinds) <= 4
    kinds += [kinds[0]] * (4 - len(kinds))
    return tuple((_bf16x2(2.0 ** o0), MAGIC, _bf16x2(2.0 ** o1), MAGIC) for o0, o1 in kinds)


# ---- pure-Triton versions of the asm blocks (TRITON_INTERPRET=1) -------------------------------
@triton.jit
def _lo(p):
    """bf16 of the low half of an int32 pair as fp32."""
    return (p << 16).to(tl.float32, bitcast=True)


@triton.jit
def _hi(p):
    return (p & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _pairs_ref(xlo, xhi, OFF: tl.constexpr):
    sc: tl.constexpr = 1.0 / (1 << OFF)
    lo = (xlo.to(tl.float32) * sc).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    hi = (xhi.to(tl.float32) * sc).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    return (lo & 0xFFFF) | (hi << 16)


@triton.jit
def _row(xp, s, j4):
    """Element s (block row) of a pair tensor [4, Q, 1, 4] -> [4, Q, 1, 1]."""
    return tl.sum(tl.where(j4 == s, xp, 0), axis=3, keep_dims=True)


@triton.jit
def _dot_pairs_ref(d, ws, xps, x0: tl.constexpr, s, j4, SH: tl.constexpr, MSK: tl.constexpr,
                   NP: tl.constexpr):
    """d + sum over the NP pairs of word ws (pair_plan order) times x pair tensors xps[x0 + p]."""
    for p in tl.static_range(NP):
        if SH[p] > 0:
            src = ws[p] >> SH[p]
        else:
            src = ws[p]
        pr = (src & MSK[p]) | 0x43004300
        xr = _row(xps[x0 + p], s, j4)
        d += _lo(pr) * _lo(xr) + _hi(pr) * _hi(xr)
    return d


@triton.jit
def _step_ref(d, words, xps, s, j4, BITS: tl.constexpr, SH: tl.constexpr, MSK: tl.constexpr,
              NP: tl.constexpr, H: tl.constexpr):
    """What asm_step computes, elementwise per lane."""
    if BITS == 3:
        a = words[0]
        b = words[1]
        m = 0x33333333
        # merged words as in _dequant_ptx: even / odd slots, high bit of slot i at 2i + 1 of b
        # for a first-half A row (H = 0), at 2i for the second
        if H == 0:
            e = (a & m) | ((b << 1) & ~m)
            o = ((a >> 2) & m) | ((b >> 1) & ~m)
        else:
            e = (a & m) | ((b << 2) & ~m)
            o = ((a >> 2) & m) | (b & ~m)
        d = _dot_pairs_ref(d, (e, o, e, o, e, o, e, o), xps, 0, s, j4, SH, MSK, NP)
    else:
        w = words[0]
        ws = (w, w, w, w, w, w, w, w)
        d = _dot_pairs_ref(d, ws, xps, 0, s, j4, SH, MSK, NP)
    return d


@triton.jit
def _xsum_ref(xsum, bsum, xps, s, j4, OFFS: tl.constexpr, NPT: tl.constexpr, NP: tl.constexpr):
    for p in tl.static_range(NPT):
        xr = _row(xps[p], s, j4)
        xv = _lo(xr) + _hi(xr)
        xsum += xv * (1 << OFFS[p % NP])
        bsum += xv * 128.0
    return xsum, bsum


@triton.jit
def _ld(ptr, mask, MASKED: tl.constexpr, CG: tl.constexpr = False):
    """A load, masked where MASKED; CG: past L1 (data another SM wrote in this launch)."""
    if CG:
        if MASKED:
            return tl.load(ptr, mask=mask, other=0, cache_modifier=".cg")
        return tl.load(ptr, cache_modifier=".cg")
    if MASKED:
        return tl.load(ptr, mask=mask, other=0)
    return tl.load(ptr)


@triton.jit
def _ldx(ptr, up_off, mask, MASKED: tl.constexpr, SWIGLU: tl.constexpr,
         CG: tl.constexpr = False):
    """An x load; SWIGLU: x = SiLU(gate) * up with up at ptr + up_off (the down projection reads
    the gate_up output directly: one SwiGLU launch less per MLP), in fp32 and rounded to x's
    dtype, as the SwiGLU kernel does. Masked elements read 0 (SiLU(0) * 0 = 0)."""
    if SWIGLU:
        g = _ld(ptr, mask, MASKED, CG).to(tl.float32)
        u = _ld(ptr + up_off, mask, MASKED, CG).to(tl.float32)
        return (g * tl.sigmoid(g) * u).to(ptr.dtype.element_ty)
    return _ld(ptr, mask, MASKED, CG)


@triton.jit
def _norm_prologue(x_ptr, r_ptr, w_ptr, h_ptr, xs_ptr, set0, set1, K, write, G: tl.constexpr):
    """NORM, over this program's K range (sets set0 .. set1 - 1 of 4 groups): v = x + r rounded
    to x's dtype (as the norm kernel rounds the residual add), x' = v w into the scratch xs
    (the main loop's x: its loads then cost what plain x loads cost; the programs of one split
    all write the same values there), v into h where `write` (the first N tile's programs:
    every K range is some split's, so h is written once, completely). Returns sum(v^2)."""
    kk = tl.arange(0, 4 * G)
    acc = tl.zeros([4 * G], dtype=tl.float32)
    for st in range(set0, set1):
        k = st * 4 * G + kk
        km = k < K
        v = (tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
             + tl.load(r_ptr + k, mask=km, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + k, v, mask=km & write)
        v = v.to(tl.float32)
        acc += v * v
        w = tl.load(w_ptr + k, mask=km, other=0.0).to(tl.float32)
        tl.store(xs_ptr + k, (v * w).to(x_ptr.dtype.element_ty), mask=km)
    return tl.sum(acc, axis=0)


@triton.jit
def residual_h(y, r, w, xs_ptr):
    """h = y rounded to x's dtype dt (xs_ptr's) plus the residual r, rounded again, as float32,
    and h w in dt (the next GEMV's x): the unfolded path's bf16 output, then the norm kernel's
    add."""
    dt = xs_ptr.dtype.element_ty
    hf = (y.to(dt).to(tl.float32) + r.to(tl.float32)).to(dt).to(tl.float32)
    return hf, (hf * w.to(tl.float32)).to(dt)


@triton.jit
def _residual_epilogue(y, n3, ymask, r_ptr, nw_ptr, xs_ptr, ss_ptr, pid_n,
                       CG: tl.constexpr = False):
    """RES, on a tile's final sums y [Q, L, 4] (rows n3): h = y rounded to x's dtype plus the
    residual r, rounded again (the unfolded path's bf16 output, then the norm kernel's add);
    x' = h w into xs (the next GEMV's x) and this tile's sum of h^2 into ss[pid_n] (the next
    GEMV adds the tiles' sums in a fixed order: no atomics, no zeroing). Returns h (fp32)."""
    r = _ld(r_ptr + n3, ymask, True, CG)
    w = tl.load(nw_ptr + n3, mask=ymask, other=0.0)
    hf, xs = residual_h(y, r, w, xs_ptr)
    tl.store(xs_ptr + n3, xs, mask=ymask)
    sq = tl.sum(tl.sum(tl.where(ymask, hf * hf, 0.0), axis=2), axis=1)
    tl.store(ss_ptr + pid_n, tl.sum(sq, axis=0))
    return hf


@triton.jit
def _store_out(y, n3, ymask, y_ptr, pid_n, N, BN: tl.constexpr, r_ptr, nw_ptr, xs_ptr, ss_ptr,
               dg_ptr, dcnt_ptr, RES: tl.constexpr, DIGITS: tl.constexpr, SWD: tl.constexpr,
               CG: tl.constexpr, MASKED: tl.constexpr):
    """A tile's final sums y [Q, L, 4] (rows n3) out, for gemv_tc and gemv_i8: RES's epilogue
    (with DIGITS, x' = h w's digits: digits.epilogue), y's store (masked where MASKED), then
    SWD's digits of SiLU(gate) * up, which read the stored y back (digits.swiglu_epilogue)."""
    if RES:
        y = _residual_epilogue(y, n3, ymask, r_ptr, nw_ptr, xs_ptr, ss_ptr, pid_n, CG)
        if DIGITS:
            digits_epilogue(xs_ptr, dg_ptr, dcnt_ptr, pid_n, N, BN)
    if MASKED:
        tl.store(y_ptr + n3, y.to(y_ptr.dtype.element_ty), mask=ymask)
    else:
        tl.store(y_ptr + n3, y.to(y_ptr.dtype.element_ty))
    if SWD:
        digits_swiglu_epilogue(y_ptr, dg_ptr, dcnt_ptr, pid_n, N, BN)


@triton.jit
def _prefetch_rows(ptr, row0, row1, col0, N, PF_ASM: tl.constexpr):
    """L2 prefetch of int32 rows row0 .. row1 - 1, columns col0 .. col0 + BN (PF_ASM's size),
    of a [rows, N] plane: 32 rows per pass, a lane each."""
    r = tl.arange(0, 32)
    for r0 in range(row0, row1, 32):
        rows = tl.minimum(r0 + r, row1 - 1)  # past the end: the last row again (harmless)
        addr = (ptr + rows.to(tl.int64) * N + col0).to(tl.int64, bitcast=True)
        tl.inline_asm_elementwise(PF_ASM, "=r,l", [addr], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _lane_rows(pid_n, N, BN: tl.constexpr, Q: tl.constexpr, L: tl.constexpr):
    """Index tensors of the fragment layout, dims (c, quad, rep, j): with contiguity only along
    j, Triton orders the layout's dims (3, 0, 1, 2), so lane = 4 quad + c as the mma fragments
    need (see the module docstring). Returns c4, q4, j4 and the output rows n [1, Q, L, 4] (4
    adjacent rows per lane) with their mask."""
    c4 = tl.arange(0, 4)[:, None, None, None]
    q4 = tl.arange(0, Q)[None, :, None, None]
    l4 = tl.arange(0, L)[None, None, :, None]
    j4 = tl.arange(0, 4)[None, None, None, :]
    n = pid_n * BN + 4 * (Q * l4 + q4) + j4
    return c4, q4, j4, n, n < N


@triton.jit
def _xsum_a(j4, XS: tl.constexpr, ASM_KEEP: tl.constexpr, Q: tl.constexpr):
    """The constant A operand of the X/B mma (xsum_consts), made opaque so that it is
    materialised once: 4 int32 tensors [4, Q, 1, 4]."""
    ka = ()
    for kr in tl.static_range(4):
        v = tl.where(j4 == 0, XS[0][kr], tl.where(j4 == 1, XS[1][kr],
                                                  tl.where(j4 == 2, XS[2][kr], XS[3][kr])))
        v = v + tl.zeros([4, Q, 1, 4], dtype=tl.int32)
        ka = ka + (tl.inline_asm_elementwise(ASM_KEEP[kr], "=r,r", [v], dtype=tl.int32,
                                             is_pure=True, pack=1),)
    return ka


@triton.jit
def _pre_words(qa_ptr, qb_ptr, grp, n, N, mask, MASKED: tl.constexpr, BITS: tl.constexpr,
               WA: tl.constexpr, PRE: tl.constexpr):
    """The words of a set's first PRE blocks (rows 0 .. 4 PRE - 1 of each lane's group), in
    step order; 3-bit: each A word followed by its B word."""
    pre = ()
    for r in tl.static_range(PRE * 4):
        pre = pre + (_ld(qa_ptr + (grp * WA + r) * N + n, mask, MASKED),)
        if BITS == 3:
            pre = pre + (_ld(qb_ptr + (grp * (WA // 2) + r % (WA // 2)) * N + n, mask,
                             MASKED),)
    return pre


@triton.jit
def _tma_words(desc, r, g0, pid_n, L: tl.constexpr):
    """TMA: row r of groups g0 .. g0 + 3 of a plane, tile pid_n's columns, as the fragment
    tensor [4, Q, L, 4] (see `tma_descs`: the box [1, L, Q, 4, 4] is already in the layout's
    order, lane = 4 q + c, registers (l, j), so the permute is a relabelling)."""
    w = desc.load([r, pid_n * L, 0, g0, 0])
    return tl.permute(tl.reshape(w, w.shape[1:]), (2, 1, 0, 3))


@triton.jit
def _tma_scales(desc, g0, pid_n, L: tl.constexpr):
    """TMA: the scale / zero words of groups g0 .. g0 + 3, tile pid_n, as [4, Q, L, 4]."""
    return tl.permute(desc.load([pid_n * L, 0, g0, 0]), (2, 1, 0, 3))


# ---- the kernel ------------------------------------------------------------------------------
@triton.jit
def _dep_wait(GRID_WAIT: tl.constexpr, bar_ptr, target, now):
    """Wait for what this tile reads: PDL's wait for the kernel before, or (GRID_WAIT, in a
    chain of GEMVs in one launch, gemv_chain.py) where `now`, until the barrier counter at
    bar_ptr reaches target (every program of the launch has finished the stage before)."""
    if GRID_WAIT:
        if now:
            grid_wait(bar_ptr, target)
    else:
        pdl.wait()


@triton.jit
def _tile(pid_n, pid_k, x_ptr, qa_ptr, qb_ptr, sz_ptr, y_ptr, ws_ptr, cnt_ptr,
          N, num_groups, sets_per_split, num_splits, up_off,
          BITS: tl.constexpr, G: tl.constexpr, WA: tl.constexpr, L: tl.constexpr,
          Q: tl.constexpr, SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr,
          SH: tl.constexpr, MSK: tl.constexpr, OFFS: tl.constexpr,
          ASM_STEP: tl.constexpr, ASM_XSUM: tl.constexpr, ASM_PAIRS: tl.constexpr,
          CONS_STEP: tl.constexpr, CONS_XSUM: tl.constexpr, XS: tl.constexpr,
          ASM_KEEP: tl.constexpr, EVEN: tl.constexpr,
          PREFETCH_L2: tl.constexpr = False, PF_ASM: tl.constexpr = "",
          SWIGLU: tl.constexpr = False, LATE_TRIGGER: tl.constexpr = False,
          r_ptr=None, nw_ptr=None, h_ptr=None, xs_ptr=None, ss_ptr=None, eps=0.0,
          NORM: tl.constexpr = False, STAGES: tl.constexpr = 1,
          EARLY_W: tl.constexpr = 0, gs_ptr=None, GSCALE: tl.constexpr = False,
          NPART: tl.constexpr = 1, RES: tl.constexpr = False, rs_ptr=None, n_rs=1,
          RSCALE: tl.constexpr = False, NRS: tl.constexpr = 1,
          GRID_WAIT: tl.constexpr = False, bar_ptr=None, bar_target=0, wait_now=True,
          CG: tl.constexpr = False, PF_SETS: tl.constexpr = 0, TMA: tl.constexpr = False,
          qa_desc=None, qb_desc=None, sz_desc=None, dg_ptr=None, dcnt_ptr=None,
          DIGITS: tl.constexpr = False, SWD: tl.constexpr = False):
    """Program (pid_n, pid_k) of gemv_tc_kernel (see there), the PDL trigger excepted. With
    GRID_WAIT (a stage of a GEMV chain, gemv_chain.py) it waits, where wait_now, on the barrier
    bar_ptr (>= bar_target) instead of PDL's wait, and CG: x, rs and the residual r, which an
    earlier stage of the same launch may have written, are read past L1 (not coherent across
    SMs within a launch). PF_SETS > 0: PREFETCH_L2 takes the first PF_SETS sets only."""
    tl.static_assert(not (NORM and GRID_WAIT), "NORM's split sums index by the launch grid")
    BN: tl.constexpr = 4 * L * Q
    S: tl.constexpr = 32 // (4 if BITS == 4 else 2)  # slots per A word
    NP: tl.constexpr = S // 2  # pairs per A word
    NPT: tl.constexpr = NP  # x pair tensors per block
    NBLK: tl.constexpr = WA // 4  # blocks of 4 A rows
    set0 = pid_k * sets_per_split
    set1 = tl.minimum(set0 + sets_per_split, (num_groups + 3) // 4)
    if PREFETCH_L2:  # PDL: this program's weights head for L2 while the kernel before runs
        # (PF_SETS > 0: its first PF_SETS sets only)
        pf1 = set1 if PF_SETS == 0 else tl.minimum(set1, set0 + PF_SETS)
        _prefetch_rows(qa_ptr, set0 * 4 * WA, pf1 * 4 * WA, pid_n * BN, N, PF_ASM)
        if BITS == 3:
            _prefetch_rows(qb_ptr, set0 * 2 * WA, pf1 * 2 * WA, pid_n * BN, N, PF_ASM)
        _prefetch_rows(sz_ptr, set0 * 4, pf1 * 4, pid_n * BN, N, PF_ASM)
    # not with NORM (its prologue reads x before the loop) nor STAGES > 1 (the pipeliner hoists
    # the first set's loads, x's too, above the loop and so above its wait)
    PRE: tl.constexpr = (EARLY_W if EARLY_W < NBLK else NBLK) if not NORM and STAGES == 1 else 0
    EARLY: tl.constexpr = PRE > 0
    if not EARLY:
        # x and the split-K workspace come from earlier kernels (GRID_WAIT: earlier stages)
        _dep_wait(GRID_WAIT, bar_ptr, bar_target, wait_now)
    c4, q4, j4, n, nmask = _lane_rows(pid_n, N, BN, Q, L)
    # mma B operand: lane (quad g, c) supplies column g, which must hold only group c's x
    sel = ((q4 % 8) // 2) == c4  # [4, Q, 1, 1]
    acc = tl.zeros([4, Q, L, 4], dtype=tl.float32)
    ka = ()
    if USE_ASM:
        ka = _xsum_a(j4, XS, ASM_KEEP, Q)
    ss = 0.0
    rsv = tl.zeros([NRS], dtype=tl.float32)
    if RSCALE and not EARLY:
        rsv = _ld(rs_ptr + tl.arange(0, NRS), tl.arange(0, NRS) < n_rs, True, CG)
    if NORM:
        ss = _norm_prologue(x_ptr, r_ptr, nw_ptr, h_ptr, xs_ptr, set0, set1, num_groups * G,
                            pid_n == 0, G)
        tl.debug_barrier()  # the whole program's x' is in xs before any lane reads it
        x_ptr = xs_ptr
    for st in tl.range(set0, set1, num_stages=STAGES):
        grp = st * 4 + c4  # [4, 1, 1, 1]: lane c's group
        if EVEN:  # N % BN == 0 and whole sets: no masks (a masked load also zeroes registers)
            ok = c4 >= 0
            wmask = nmask
        else:
            ok = grp < num_groups
            wmask = nmask & ok
        if USE_ASM:
            xmask = ok & sel
        else:
            xmask = ok & (q4 >= 0)
        d = tl.zeros([4, Q, L, 4], dtype=tl.float32)
        xb = tl.zeros([4, Q, 1, 4], dtype=tl.float32)
        xsum = tl.zeros([4, Q, 1, 1], dtype=tl.float32)
        bsum = tl.zeros([4, Q, 1, 1], dtype=tl.float32)
        xo = grp * G + j4 + 0 * q4  # [4, Q, 1, 4]: element j4 = block row
        pre = ()
        if EARLY:  # the first PRE blocks' words before the wait (see the docstring)
            pre = _pre_words(qa_ptr, qb_ptr, grp, n, N, wmask, not EVEN, BITS, WA, PRE)
            _dep_wait(GRID_WAIT, bar_ptr, bar_target, wait_now & (st == set0))
            if RSCALE:  # (after the wait: the producer's sums; each set, harmless)
                rsv = _ld(rs_ptr + tl.arange(0, NRS), tl.arange(0, NRS) < n_rs, True, CG)
        for blk in tl.static_range(NBLK):
            # x pair tensors [4, Q, 1, 4] (element = block row): one 64-bit x load per slot
            xps = ()
            for p in tl.static_range(NP):
                xlo = _ldx(x_ptr + xo + p * WA + blk * 4, up_off, xmask, USE_ASM or not EVEN,
                           SWIGLU, CG)
                xhi = _ldx(x_ptr + xo + (p + NP) * WA + blk * 4, up_off, xmask,
                           USE_ASM or not EVEN, SWIGLU, CG)
                if USE_ASM:
                    pr = tl.inline_asm_elementwise(ASM_PAIRS[OFFS[p]], "=r,=r,r,r", [xlo, xhi],
                                                   dtype=tl.int32, is_pure=True, pack=2)
                else:
                    pr = _pairs_ref(xlo, xhi, OFFS[p])
                xps = xps + (pr,)
            # 3-bit: A row r of the group's first (H = 0) or second half, B row r mod WA / 2;
            # H = (blk * 4) // (WA // 2) (spelt out: a constexpr assigned in this runtime loop
            # would turn into a tensor)
            for s in tl.static_range(4):
                r = blk * 4 + s
                if blk < PRE:  # (indices spelt out: r is a tensor in this runtime loop)
                    if BITS == 3:
                        words = (pre[2 * (blk * 4 + s)], pre[2 * (blk * 4 + s) + 1])
                    else:
                        words = (pre[blk * 4 + s],)
                elif TMA:  # (EVEN only) the words come through shared memory
                    w0 = _tma_words(qa_desc, r, st * 4, pid_n, L)
                    if BITS == 3:
                        words = (w0, _tma_words(qb_desc, r % (WA // 2), st * 4, pid_n, L))
                    else:
                        words = (w0,)
                else:
                    w0 = _ld(qa_ptr + (grp * WA + r) * N + n, wmask, not EVEN)
                    if BITS == 3:
                        b = _ld(qb_ptr + (grp * (WA // 2) + r % (WA // 2)) * N + n, wmask,
                                not EVEN)
                        words = (w0, b)
                    else:
                        words = (w0,)
                if USE_ASM:
                    d = tl.inline_asm_elementwise(ASM_STEP[(blk * 4) // (WA // 2) * 4 + s],
                                                  CONS_STEP, (d,) + words + xps,
                                                  dtype=tl.float32, is_pure=True, pack=4)
                    xb = tl.inline_asm_elementwise(ASM_XSUM[s], CONS_XSUM, (xb,) + ka + xps,
                                                   dtype=tl.float32, is_pure=True, pack=4)
                else:
                    d = _step_ref(d, words, xps, s, j4, BITS, SH, MSK, NP,
                                  (blk * 4) // (WA // 2))
                    xsum, bsum = _xsum_ref(xsum, bsum, xps, s, j4, OFFS, NPT, NP)
        if USE_ASM:
            xsum = tl.sum(tl.where(j4 == 0, xb, 0.0), axis=3, keep_dims=True)
            bsum = tl.sum(tl.where(j4 == 1, xb, 0.0), axis=3, keep_dims=True)
        # loaded after the steps in program order: ptxas hoists it as far as registers allow
        if TMA:
            szw = _tma_scales(sz_desc, st * 4, pid_n, L)
        else:
            szw = _ld(sz_ptr + grp * N + n, wmask, not EVEN)
        sc = (szw << 16).to(tl.float32, bitcast=True)
        zr = (szw & -65536).to(tl.float32, bitcast=True)
        # d = B + sum q x over the lane's group; masked groups: s = 0
        if GSCALE:  # the lane's group's partial sums of squares (masked groups: s = 0)
            ssq = tl.zeros([4, 1, 1, 1], dtype=tl.float32)
            for i in tl.static_range(NPART):
                ssq += _ld(gs_ptr + grp * NPART + i, ok, not EVEN)
            sc = sc * tl.rsqrt(ssq / G + eps)
        acc += sc * (d - (bsum + zr * xsum))
    if EARLY:  # every path waits before its stores and atomics (a no-op after the loop's)
        _dep_wait(GRID_WAIT, bar_ptr, bar_target, wait_now & (set1 <= set0))
    if LATE_TRIGGER:  # the successor's programs become resident only as this one winds down
        pdl.trigger()
    y = tl.sum(acc, axis=0)  # [Q, L, 4]: the 4 groups of a set (lanes c)
    n3 = pid_n * BN + 4 * (Q * tl.arange(0, L)[None, :, None] + tl.arange(0, Q)[:, None, None]) \
        + tl.arange(0, 4)[None, None, :]
    ymask = n3 < N
    if RSCALE:
        ss = tl.sum(rsv, axis=0)
    if SPLIT_K:
        tl.store(ws_ptr + pid_k.to(tl.int64) * N + n3, y, mask=ymask)
        if NORM:  # this split's sum of squares, for the tile's last split
            tl.store(ss_ptr + pid_k * tl.num_programs(0) + pid_n, ss)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == num_splits - 1:  # the last split of this tile sums all partials
            tot = sum_splits(ws_ptr + n3, N, num_splits, ymask, y)
            if NORM:
                sst = 0.0
                for k in range(0, num_splits):
                    sst += tl.load(ss_ptr + k * tl.num_programs(0) + pid_n, cache_modifier=".cg")
                tot = tot * tl.rsqrt(sst / (num_groups * G) + eps)
            if RSCALE:
                tot = tot * tl.rsqrt(ss / (num_groups * G) + eps)
            _store_out(tot, n3, ymask, y_ptr, pid_n, N, BN, r_ptr, nw_ptr, xs_ptr, ss_ptr,
                       dg_ptr, dcnt_ptr, RES, DIGITS, SWD, CG, True)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch
    else:
        if NORM or RSCALE:
            y = y * tl.rsqrt(ss / (num_groups * G) + eps)
        _store_out(y, n3, ymask, y_ptr, pid_n, N, BN, r_ptr, nw_ptr, xs_ptr, ss_ptr, dg_ptr,
                   dcnt_ptr, RES, DIGITS, SWD, CG, True)


@triton.jit
def gemv_tc_kernel(x_ptr, qa_ptr, qb_ptr, sz_ptr, y_ptr, ws_ptr, cnt_ptr,
                   N, num_groups, sets_per_split, num_splits, up_off,
                   BITS: tl.constexpr, G: tl.constexpr, WA: tl.constexpr, L: tl.constexpr,
                   Q: tl.constexpr, SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr,
                   SH: tl.constexpr, MSK: tl.constexpr, OFFS: tl.constexpr,
                   ASM_STEP: tl.constexpr, ASM_XSUM: tl.constexpr, ASM_PAIRS: tl.constexpr,
                   CONS_STEP: tl.constexpr, CONS_XSUM: tl.constexpr, XS: tl.constexpr,
                   ASM_KEEP: tl.constexpr, EVEN: tl.constexpr,
                   PREFETCH_L2: tl.constexpr = False, PF_ASM: tl.constexpr = "",
                   SWIGLU: tl.constexpr = False, LATE_TRIGGER: tl.constexpr = False,
                   r_ptr=None, nw_ptr=None, h_ptr=None, xs_ptr=None, ss_ptr=None, eps=0.0,
                   NORM: tl.constexpr = False, STAGES: tl.constexpr = 1,
                   EARLY_W: tl.constexpr = 0, gs_ptr=None, GSCALE: tl.constexpr = False,
                   NPART: tl.constexpr = 1, RES: tl.constexpr = False, rs_ptr=None, n_rs=1,
                   RSCALE: tl.constexpr = False, NRS: tl.constexpr = 1,
                   TMA: tl.constexpr = False, qa_desc=None, qb_desc=None, sz_desc=None,
                   dg_ptr=None, dcnt_ptr=None, DIGITS: tl.constexpr = False,
                   SWD: tl.constexpr = False):
    """Grid (cdiv(N, BN), num_splits), BN = 4 L Q; one warp per 8 quads (Q = 8 num_warps).
    Program (n tile, split) sums sets of 4 groups set0 .. set1 - 1 for its BN output rows.
    SWIGLU: x = SiLU(x[:K]) * x[up_off:] (x holds gate and up, up_off = K).
    NORM: y = RMSNorm(x + r) W^T, with norm weight nw, and h = x + r written: RMSNorm(v) =
    v w / rms(v) and 1 / rms(v) is one scalar, so the matmul runs on v w (staged in the scratch
    xs) and y is scaled at the end by the sum of squares of all K (split-K: a partial per split,
    in ss_ptr).
    EARLY_W = e > 0 (PDL): each set's first e blocks of weight words (of NBLK) are loaded at the
    top of the set, before `griddepcontrol.wait` (weights are never written by an earlier
    kernel), so a program made resident while the kernel before drains has its first HBM trip
    under way, and e blocks of loads are in flight at once; later sets wait again (a no-op).
    GSCALE: group g's sums scaled by rsqrt(sum_i gs[g, i] / G + eps), gs [num_groups, NPART]
    fp32 partial sums of squares: KDA's gated output norm (per head, head dim = G) folded into
    its o_proj, x = o w sigmoid(gate) and gs written by the KDA decode kernel (a program holds
    whole groups: nothing to combine across programs).
    RES (the residual add and the next RMSNorm in the epilogue; with SWIGLU or GSCALE too):
    y = h = y + r written, and x' = h nw into xs, tile pid_n's sum of h^2 into ss_ptr[pid_n].
    RSCALE (that norm's scale, in the GEMV that reads x = xs): y scaled by
    rsqrt(sum(rs[:n_rs]) / K + eps), rs = the producer's per-tile sums (NRS >= n_rs, a power
    of two); read early (they come from a finished kernel), used at the end.
    TMA (EVEN only): the weight words and scales come through host tensor descriptors
    (`tma_descs`: 5-D / 4-D views whose boxes arrive in the fragment's order), with STAGES > 1
    pipelined through shared memory by the TMA unit."""
    if not LATE_TRIGGER:
        pdl.trigger()
    _tile(tl.program_id(0), tl.program_id(1), x_ptr, qa_ptr, qb_ptr, sz_ptr, y_ptr, ws_ptr,
          cnt_ptr, N, num_groups, sets_per_split, num_splits, up_off, BITS, G, WA, L, Q, SPLIT_K,
          USE_ASM, SH, MSK, OFFS, ASM_STEP, ASM_XSUM, ASM_PAIRS, CONS_STEP, CONS_XSUM, XS,
          ASM_KEEP, EVEN, PREFETCH_L2, PF_ASM, SWIGLU, LATE_TRIGGER, r_ptr, nw_ptr, h_ptr, xs_ptr,
          ss_ptr, eps, NORM, STAGES, EARLY_W, gs_ptr, GSCALE, NPART, RES, rs_ptr, n_rs, RSCALE,
          NRS, TMA=TMA, qa_desc=qa_desc, qb_desc=qb_desc, sz_desc=sz_desc, dg_ptr=dg_ptr,
          dcnt_ptr=dcnt_ptr, DIGITS=DIGITS, SWD=SWD)


@functools.cache
def kernel_consts(bits: int) -> dict:
    """Constexpr tables and PTX of the kernel for a bit width."""
    sh, msk, offs = _plan_consts(bits)
    npt = n_pair_tensors(bits)
    n_in = 4 * (2 if bits == 3 else 1) + 4 * npt
    return dict(SH=sh, MSK=msk, OFFS=offs,
                ASM_STEP=tuple(asm_step(bits, s, h) for h in range(2) for s in range(4)),
                ASM_XSUM=tuple(asm_xsum(bits, s) for s in range(4)),
                ASM_PAIRS=tuple(asm_pairs(o) for o in range(8)),
                CONS_STEP="=f,=f,=f,=f,f,f,f,f," + ",".join(["r"] * n_in),
                CONS_XSUM="=f,=f,=f,=f,f,f,f,f," + ",".join(["r"] * (16 + 4 * npt)),
                XS=xsum_consts(bits),
                ASM_KEEP=tuple(f"mov.b32 $0, $1; // a{r}" for r in range(4)))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def supported(x: torch.Tensor, bits: int, group_size: int, n: int) -> bool:
    """Whether gemv_tc handles this call: M = 1, bf16 x, blocks of 4 A rows (G >= 32 at 4-bit,
    64 at 2-bit, 128 at 3-bit) and N a multiple of 4 (128-bit word loads)."""
    pa = 4 if bits == 4 else 2
    wa = group_size * pa // 32
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 and n % 4 == 0
            and wa % (8 if bits == 3 else 4) == 0)


def residual_kwargs(residual: tuple, out: torch.Tensor, dtype: torch.dtype, n: int,
                    n_tiles: int) -> dict:
    """The RES epilogue's kernel arguments (`_residual_epilogue`) from residual = (r, nw, xs,
    ss), checked: r, nw, xs [N] and out in x's dtype, ss [tiles] fp32."""
    res, w, xs, ss = residual
    assert (out.dtype == dtype and ss.dtype == torch.float32 and ss.numel() == n_tiles
            and all(t.dtype == dtype and t.is_contiguous() and t.numel() == n
                    for t in (res, w, xs))), "residual: r, nw, xs [N] x's dtype, ss [tiles]"
    return dict(r_ptr=res, nw_ptr=w, xs_ptr=xs, ss_ptr=ss, RES=True)


def tiles(n: int, reps: int = 4, num_warps: int = 1) -> int:
    """Programs along N (output tiles of 32 reps num_warps rows) of a gemv_tc call."""
    return triton.cdiv(n, 32 * reps * num_warps)


def gemv_tc(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor, bits: int,
            group_size: int, out: torch.Tensor | None = None, reps: int = 4,
            num_warps: int = 1, waves: float = 8.0, splits: int | None = None,
            swiglu: bool = False, maxnreg: int | None = None,
            norm: tuple | None = None, stages: int = 1,
            early: bool | int | None = None, gscale: tuple | None = None,
            residual: tuple | None = None, rscale: tuple | None = None,
            tma: bool = False, out_digits: torch.Tensor | None = None,
            out_swiglu_digits: torch.Tensor | None = None) -> torch.Tensor:
    """y [1, N] = x [1, K] @ W^T, x bf16 with unit stride; out (optional) [1, N] bf16 or fp32.
    swiglu: x [1, 2K] holds (gate, up) and y = (SiLU(gate) * up) @ W^T, the SwiGLU fused into
    the x loads.

    reps: 32-row slabs per warp (BN = 32 reps num_warps rows per program); split-K over sets
    of 4 groups to about `waves` programs per SM (or `splits`). maxnreg: a register cap per
    thread (more resident warps per SM, so more weight loads in flight; spills if too low).
    norm = (residual [1, K], weight [K], eps, h [1, K]): y = RMSNorm(x + residual) @ W^T with
    that norm weight, and h = x + residual written (the layer's residual add and RMSNorm folded
    into the matmul: two launches less per layer); all bf16 with unit stride.
    stages > 1: the loop over a program's sets is software-pipelined by Triton (the weights go
    through shared memory by cp.async, `stages` sets in flight, no registers held for them):
    more bytes in flight per warp, fewer programs per SM (shared memory). On the H200 (session
    6) 1.5-2.3x slower than stages=1 at every engine shape: kept as an option, not used.
    early: each set's first `early` blocks of words (True: 1; at most WA / 4) loaded before the
    PDL wait (EARLY_W); default pdl.EARLY_WEIGHTS[bits]: 1 at 4 bits, none at 2 and 3 (H200: the
    kernel bench of run 14 had 1 block 3-bit 9-20% faster and 4-bit 1-6%, 2-bit 1-6% slower
    (spills under its cap); in the engine, run 15, 3-bit lost, 4-bit won; run 19: 2 or 4
    blocks lost at every engine shape).
    gscale = (gs [num_groups, P] fp32, eps): group g's contribution times rsqrt(sum(gs[g]) / G
    + eps) (KDA's gated output norm over its heads, head dim G, folded into o_proj with x = o w
    sigmoid(gate) and gs from the KDA decode kernel: a norm launch less per KDA layer).
    residual = (r [1, N], nw [N], xs [1, N], ss [tiles(N, reps, num_warps)] fp32): the layer's
    residual add and the next RMSNorm (weight nw) in the epilogue, with swiglu or gscale or
    neither: y = h = y + r (bf16 out), xs = h nw (bf16) and ss[t] = tile t's sum of h^2.
    rscale = (rs [P] fp32, eps), for x = such an xs and rs = its ss: y = x @ W^T times
    rsqrt(sum(rs) / K + eps), i.e. RMSNorm(h) @ W^T: the norm's launch saved at each boundary
    between a layer's output projection and the next input projection.
    tma (one warp, N a multiple of the tile, K of 4 groups; with stages > 1): the words, scales
    loaded by the TMA unit through shared memory (host tensor descriptors, `tma_descs`):
    bytes in flight without registers or per-lane load instructions held for them. On an H100
    (run 71, perf/RESULTS.md session 18) 1.2-1.6x slower than the default at every engine
    shape, best at stages 2 (deeper pipelines leave fewer one-warp programs per SM): opt-in.
    out_digits (with residual; `digits.empty(N)`): the epilogue also writes x' = h nw's int8
    digits for a next GEMV on gemv_i8 (`digits.epilogue`; read with `digits.views`);
    out_swiglu_digits (y = an MLP's (gate, up); `digits.empty(N / 2)`): those of SiLU(gate) *
    up for the down projection (`digits.swiglu_epilogue`)."""
    grid, args, kw = launch_args(x, qa, qb, sz, bits, group_size, out, reps, num_warps, waves,
                                 splits, swiglu, maxnreg, norm, stages, early, gscale, residual,
                                 rscale, tma, out_digits, out_swiglu_digits)
    gemv_tc_kernel[grid](*args, **kw)
    return args[4]


def launch_args(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor, bits: int,
                group_size: int, out: torch.Tensor | None = None, reps: int = 4,
                num_warps: int = 1, waves: float = 8.0, splits: int | None = None,
                swiglu: bool = False, maxnreg: int | None = None,
                norm: tuple | None = None, stages: int = 1,
                early: bool | int | None = None, gscale: tuple | None = None,
                residual: tuple | None = None,
                rscale: tuple | None = None, tma: bool = False,
                out_digits: torch.Tensor | None = None,
                out_swiglu_digits: torch.Tensor | None = None) -> tuple[tuple, tuple, dict]:
    """gemv_tc_kernel's (grid, positional args, keyword args) for a gemv_tc call (see
    there); also the stages of a GEMV chain (gemv_chain.py)."""
    m, k = x.shape
    k = k // 2 if swiglu else k
    n = qa.shape[1]
    assert x.stride(1) == 1 and supported(x, bits, group_size, n), (x.shape, x.dtype, bits)
    assert (swiglu, norm is not None, gscale is not None, rscale is not None).count(True) <= 1, \
        "swiglu, norm, gscale and rscale exclude each other"
    assert residual is None or (norm is None and rscale is None), "residual: not with norm"
    pa = 4 if bits == 4 else 2
    wa = group_size * pa // 32
    num_groups = k // group_size
    n_sets = triton.cdiv(num_groups, 4)
    q = 8 * num_warps
    bn = 4 * reps * q
    n_tiles = tiles(n, reps, num_warps)
    sps, ns = split_k(n_tiles, n_sets, x.device, waves, splits)
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    ws, cnt, dkw = digits_workspace(out, n, n_tiles, ns, bn, residual, out_digits,
                                    out_swiglu_digits)
    nkw = {}
    if norm is not None:
        res, w, eps, h = norm
        assert all(t.dtype == x.dtype and t.is_contiguous() and t.numel() == k
                   for t in (res, w, h)), "norm tensors: x's dtype, contiguous, K elements"
        ss = torch.empty(ns * n_tiles, dtype=torch.float32, device=x.device)
        nkw = dict(r_ptr=res, nw_ptr=w, h_ptr=h, xs_ptr=torch.empty_like(x), ss_ptr=ss,
                   eps=float(eps), NORM=True)
    if gscale is not None:
        gs, eps = gscale
        assert (gs.dtype == torch.float32 and gs.is_contiguous() and gs.dim() == 2
                and gs.shape[0] == num_groups), "gscale: gs [num_groups, P] fp32, contiguous"
        nkw = dict(gs_ptr=gs, eps=float(eps), GSCALE=True, NPART=gs.shape[1])
    if residual is not None:
        nkw.update(residual_kwargs(residual, out, x.dtype, n, n_tiles))
    if rscale is not None:
        rs, eps = rscale
        assert rs.dtype == torch.float32 and rs.dim() == 1, "rscale: rs [P] fp32"
        nkw = dict(rs_ptr=rs, n_rs=rs.numel(), eps=float(eps), RSCALE=True,
                   NRS=triton.next_power_of_2(rs.numel()))
    nkw.update(dkw)  # (after rscale's, which replaces nkw)
    even = n % bn == 0 and num_groups % 4 == 0
    # whole tiles keep the prefetches inside the planes (a prefetch takes the 128-byte line
    # holding its address: rows off the line grid lose at most a line)
    prefetch = pdl.ON.value and pdl.PREFETCH and even and bn % 32 == 0 and not _interpreting()
    args = (x, qa, qb if qb.numel() else qa, sz, out, ws, cnt, n, num_groups, sps, ns, k)
    kw = dict(BITS=bits, G=group_size, WA=wa, L=reps, Q=q, SPLIT_K=ns > 1,
              USE_ASM=not _interpreting(), EVEN=even, **kernel_consts(bits),
              PREFETCH_L2=prefetch, PF_ASM=pdl.prefetch_l2_asm(4 * bn) if prefetch else "",
              SWIGLU=swiglu, LATE_TRIGGER=pdl.LATE_TRIGGER, STAGES=stages, num_warps=num_warps,
              EARLY_W=int(pdl.EARLY_WEIGHTS.get(bits, 0) if early is None else early),
              launch_pdl=pdl.ON.value, **nkw,
              **({} if maxnreg is None else {"maxnreg": maxnreg}))
    if tma:
        assert even and num_warps == 1, "tma: one warp, N a multiple of the tile, K of 4 groups"
        kw.update(TMA=True, **tma_descs(qa, qb, sz, bits, wa, reps, q))
    return (n_tiles, ns), args, kw


def tma_descs(qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor, bits: int, wa: int,
              reps: int, q: int) -> dict:
    """Host tensor descriptors of a weight for the TMA path (plain records: the launch encodes
    them, so one per call costs little and pins no tensor). A plane [groups * R, N] is viewed
    5-D as (r, l, q, c, j) = word (c R + r, 4 (Q l + q) + j), box [1, L, Q, 4, 4]: one TMA
    brings row r of 4 groups for a tile, in shared memory in the order of the mma fragment
    (lane 4 q + c, registers (l, j); Triton's layout for it then needs no conversion).
    sz [groups, N] likewise as (l, q, c, j), box [L, Q, 4, 4]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n = qa.shape[1]
    groups = sz.shape[0]

    def view(t: torch.Tensor, rows: int) -> TensorDescriptor:
        return TensorDescriptor(t, [rows, n // (4 * q), q, groups, 4],
                                [n, 4 * q, 4, rows * n, 1], [1, reps, q, 4, 4])

    qd = view(qa, wa)
    return dict(qa_desc=qd, qb_desc=view(qb, wa // 2) if bits == 3 else qd,
                sz_desc=TensorDescriptor(sz.view(torch.int32), [n // (4 * q), q, groups, 4],
                                         [4 * q, 4, n, 1], [reps, q, 4, 4]))


