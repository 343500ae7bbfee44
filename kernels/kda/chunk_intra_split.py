"""KDA prefill, stage 1, with the A matrices in one program per 16-row block-row
(VOLUNDR_KDA_INTRA=split).

Same outputs as `_chunk_kda_intra_kernel` (chunk_intra.py; w, u, qg, kg, Aqk in head-major
chunk slots, gl = 2^G_last), same math. The "sub" kernel does everything for one (chunk, head)
in one long program: ~150 dependent small steps at 2 CTAs per SM, latency-bound (H200, T = 32K,
H = 40: ~93 us per program, 7.2 ms). Here four launches:

1. the sub kernel's phase 0 (PHASES=1): G = in-chunk cumsum of the log2 decay and the row norms
   of q and k to scratch;
2. `_kda_intra_diag_kernel` below (split_diag="elem", the default), grid (chunks x BT / 16, H):
   the diagonal 16 x 16 blocks of Aqk and Akk element-wise, then X_i = (I + L_ii)^-1 of the
   Akk block: L is strictly lower 16 x 16, so L^16 = 0 and X_i = (I - L)(I + L^2)(I + L^4)
   (I + L^8), six dependent fp32 dots (`inverse16`);
   `_kda_intra_a_kernel` below, the same grid: block-row i of a chunk per program (the sub
   kernel's phase-1 step, `_block_row`), the blocks left of the diagonal (and zeros right of
   it in Aqk), one warp each (no CTA barriers in the layout changes of the small dots; H200
   runs 34-35: fewest warps fastest). With split_diag="levels" it also does the diagonal
   blocks by levels of small dots and X_i, and the diagonal kernel is not launched.
   Together they write Aqk and, to scratch Ms, X_i on the diagonal blocks and Akk left of them;
3. M = (I + Akk)^-1 from Ms in four [BT, BT] dots (`block_inverse`; the sub kernel with
   PHASES=8, written back to Ms: for 16-bit inputs as 16-bit values in Ms's memory, split_M16),
   then the sub kernel's phase 3 (PHASES=4, num_stages 3): w = M (beta k 2^G), u = M (beta v)
   (16-bit dots with split_M16, as fla's), qg, kg, gl. (split_inv_apart=False: the inverse
   inside phase 3, BLOCK_INV; 222 registers instead of 128 there, 4% slower at T = 128K.)

As everywhere in stage 1, G is non-increasing (log decays <= 0): no exponent formed is positive.
"""

from __future__ import annotations

import triton
import triton.language as tl

from volundr.kernels.kda.chunk_intra import _chunk_bounds
from volundr.kernels.kda.chunk_intra_sub import _block_row, inverse16


@triton.jit
def _sub_chunk_program(chunk_idx, cu_seqlens, NC, BT: tl.constexpr):
    """Program (chunk x BT / 16 + i, head) of the kernels below: sub-chunk i, head i_h, the
    chunk's first token t0, its sequence's end eos and the chunk's head-major slot row0."""
    NS: tl.constexpr = BT // 16
    i_ci, i_h = tl.program_id(0), tl.program_id(1)
    i_c = i_ci // NS
    t0, eos = _chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    return i_ci % NS, i_h, t0, eos, (i_h * NC + i_c).to(tl.int64) * BT


@triton.jit(do_not_specialize=["T", "NC"])
def _kda_intra_a_kernel(
    q, k, beta, Aqk, Gs, Ms, rn, cu_seqlens, chunk_idx, scale, T, NC, s_qt, s_qh,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, DIAG: tl.constexpr,
):
    """DIAG=False: only the blocks off the diagonal (`_kda_intra_diag_kernel` does the rest)."""
    i, i_h, t0, eos, row0 = _sub_chunk_program(chunk_idx, cu_seqlens, NC, BT)
    Ms_c = Ms + row0 * BT
    b_L = _block_row(q, k, beta, Aqk, Ms_c, Gs + row0 * K, rn, t0, eos, row0, i, i_h, scale, T,
                     s_qt, s_qh, H, K, BT, BK, BETA_SIGMOID, DIAG)
    if DIAG:
        # X = (I + L)^-1, L = the beta-scaled strictly lower Akk block
        p_X = tl.make_block_ptr(Ms_c, (BT, BT), (BT, 1), (i * 16, i * 16), (16, 16), (1, 0))
        tl.store(p_X, inverse16(b_L))


@triton.jit
def _half_tiles(q, k, beta, Gs_c, rn, t0, eos, row0, r, i_h, scale, s_qt, s_qh,
                H: tl.constexpr, K: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """Rows r (8 chunk rows) of a sub-chunk, all K channels: q with its norm and the scale,
    k with its norm and beta (zero past the sequence end), G."""
    o_k = tl.arange(0, K)
    m = (t0 + r) < eos
    tok = (t0 + r) * s_qt + i_h * s_qh
    b_q = tl.load(q + tok[:, None] + o_k[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    b_k = tl.load(k + tok[:, None] + o_k[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    b_b = tl.load(beta + (t0 + r) * H + i_h, mask=m, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b_b = tl.where(m, tl.sigmoid(b_b), 0.0)
    b_rq = tl.load(rn + (row0 + r) * 2)
    b_rk = tl.load(rn + (row0 + r) * 2 + 1)
    b_G = tl.load(Gs_c + r[:, None] * K + o_k[None, :])
    return b_q * (b_rq * scale)[:, None], b_k * (b_b * b_rk)[:, None], b_G


@triton.jit
def _key_row(k, Gs_c, rn, t0, eos, row0, j, i_h, s_qt, s_qh, K: tl.constexpr):
    """Chunk row j: k with its norm (zero past the sequence end) and G, each broadcast to an
    [8, K] tile: loaded in the layout of the resident tiles (a [K] vector would be loaded in
    a 1-D layout and moved through shared memory, with barriers, for every column)."""
    o_k = tl.arange(0, K)[None, :] + tl.zeros([8, 1], dtype=tl.int32)
    b_kj = tl.load(k + (t0 + j) * s_qt + i_h * s_qh + o_k, mask=(t0 + j) < eos, other=0.0)
    return b_kj.to(tl.float32) * tl.load(rn + (row0 + j) * 2 + 1), tl.load(Gs_c + j * K + o_k)


@triton.jit
def _put(b_acc, b_a, jj):
    """Column jj (0..15) of an [8, 16] tile := b_a [8] (kept in registers: a store per column
    would move each column through shared memory into the store's layout)."""
    c16 = tl.arange(0, 16)
    return tl.where((c16 == jj)[None, :], b_a[:, None], b_acc)


@triton.jit
def _elem_column(b_q, b_k, b_G, r, b_kj, b_Gj, j):
    """Column j for rows r, one exponent per element: Aqk[t, j] = sum_c q_t k_j 2^(G_t - G_j)
    (norms, beta and the scale are in the operands), Akk's the same with k_t. Masked before
    exp2: for t < j the exponent would be positive."""
    b_kg = tl.exp2(tl.where((r >= j)[:, None], b_G - b_Gj, float("-inf"))) * b_kj
    return tl.sum(b_q * b_kg, axis=1), tl.sum(b_k * b_kg, axis=1)


@triton.jit
def _lower_column(k, Gs_c, rn, t0, eos, row0, j, jj, i_h, s_qt, s_qh, b_qb, b_kb, b_Gb, bot,
                  b_Aqb, b_Akb, K: tl.constexpr):
    """Columns 8-15: only the lower half's rows can be at or below the diagonal."""
    b_kj, b_Gj = _key_row(k, Gs_c, rn, t0, eos, row0, j, i_h, s_qt, s_qh, K)
    b_aq, b_ak = _elem_column(b_qb, b_kb, b_Gb, bot, b_kj, b_Gj, j)
    return _put(b_Aqb, b_aq, jj), _put(b_Akb, b_ak, jj)


@triton.jit
def _upper_column(k, Gs_c, rn, t0, eos, row0, j, jj, i_h, s_qt, s_qh, b_qt, b_kt, b_Gt, top,
                  b_qa, b_ka, b_Ga, b_Aqt, b_Akt, b_Aqb, b_Akb, K: tl.constexpr):
    """Columns 0-7: the upper half's rows element-wise; the lower half's through the anchor a
    (first lower row): 2^(G_t - G_j) = 2^(G_t - G_a) 2^(G_a - G_j), both factors <= 1, the
    first already in b_qa / b_ka."""
    b_kj, b_Gj = _key_row(k, Gs_c, rn, t0, eos, row0, j, i_h, s_qt, s_qh, K)
    b_aq, b_ak = _elem_column(b_qt, b_kt, b_Gt, top, b_kj, b_Gj, j)
    b_Aqt, b_Akt = _put(b_Aqt, b_aq, jj), _put(b_Akt, b_ak, jj)
    b_kq = b_kj * tl.exp2(b_Ga - b_Gj)
    b_Aqb = _put(b_Aqb, tl.sum(b_qa * b_kq, axis=1), jj)
    b_Akb = _put(b_Akb, tl.sum(b_ka * b_kq, axis=1), jj)
    return b_Aqt, b_Akt, b_Aqb, b_Akb


@triton.jit(do_not_specialize=["T", "NC"])
def _kda_intra_diag_kernel(
    q, k, beta, Aqk, Gs, Ms, rn, cu_seqlens, chunk_idx, scale, T, NC, s_qt, s_qh,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """The 16 x 16 diagonal blocks of Aqk and Akk element-wise (fla's token-parallel form,
    here one program per (sub-chunk, head)): column j of the block is one pass over the rows
    t >= j of q, k, G held in registers, with the per-element exponent G_t - G_j <= 0, so no
    levels, no dots and no layout changes. Rows in two halves of 8: columns 8-15 run over the
    lower half only, columns 0-7 over the upper half element-wise and over the lower half
    through an anchor row (one [K] exponent per column). Exponents: 8 x 8 x K per half
    where the triangle needs 36 x K, none for the lower-left quarter (64 pairs).
    Then X_i = (I + L_ii)^-1 of the Akk block (read back from Ms) on Ms's diagonal.
    Grid (chunks x BT / 16, H), as `_kda_intra_a_kernel` with DIAG=False, which does the rest."""
    i, i_h, t0, eos, row0 = _sub_chunk_program(chunk_idx, cu_seqlens, NC, BT)
    Gs_c = Gs + row0 * K
    Ms_c = Ms + row0 * BT
    r8 = tl.arange(0, 8)
    top = i * 16 + r8                                  # chunk rows
    bot = top + 8
    b_qt, b_kt, b_Gt = _half_tiles(q, k, beta, Gs_c, rn, t0, eos, row0, top, i_h, scale, s_qt,
                                   s_qh, H, K, BETA_SIGMOID)
    b_qb, b_kb, b_Gb = _half_tiles(q, k, beta, Gs_c, rn, t0, eos, row0, bot, i_h, scale, s_qt,
                                   s_qh, H, K, BETA_SIGMOID)
    # one column at a time (UNROLL: the compiler may issue later columns' row loads early)
    b_Aqt = tl.zeros([8, 16], dtype=tl.float32)
    b_Akt = tl.zeros([8, 16], dtype=tl.float32)
    b_Aqb = tl.zeros([8, 16], dtype=tl.float32)
    b_Akb = tl.zeros([8, 16], dtype=tl.float32)
    if UNROLL:
        for jj in tl.static_range(8, 16):
            b_Aqb, b_Akb = _lower_column(k, Gs_c, rn, t0, eos, row0, i * 16 + jj, jj, i_h, s_qt,
                                         s_qh, b_qb, b_kb, b_Gb, bot, b_Aqb, b_Akb, K)
    else:
        for jj in range(8, 16):
            b_Aqb, b_Akb = _lower_column(k, Gs_c, rn, t0, eos, row0, i * 16 + jj, jj, i_h, s_qt,
                                         s_qh, b_qb, b_kb, b_Gb, bot, b_Aqb, b_Akb, K)
    b_Ga = tl.load(Gs_c + (i * 16 + 8) * K + tl.arange(0, K))[None, :]
    b_ea = tl.exp2(b_Gb - b_Ga)                        # 2^(G_t - G_a) <= 1, t >= a
    b_qa, b_ka = b_qb * b_ea, b_kb * b_ea
    if UNROLL:
        for jj in tl.static_range(8):
            b_Aqt, b_Akt, b_Aqb, b_Akb = _upper_column(
                k, Gs_c, rn, t0, eos, row0, i * 16 + jj, jj, i_h, s_qt, s_qh, b_qt, b_kt, b_Gt,
                top, b_qa, b_ka, b_Ga, b_Aqt, b_Akt, b_Aqb, b_Akb, K)
    else:
        for jj in range(8):
            b_Aqt, b_Akt, b_Aqb, b_Akb = _upper_column(
                k, Gs_c, rn, t0, eos, row0, i * 16 + jj, jj, i_h, s_qt, s_qh, b_qt, b_kt, b_Gt,
                top, b_qa, b_ka, b_Ga, b_Aqt, b_Akt, b_Aqb, b_Akb, K)
    # Aqk's block (zeros above the diagonal come out of the masked exponents and the zero
    # initialised upper-right quarter); Akk strictly lower to Ms
    c16 = i * 16 + tl.arange(0, 16)
    dt = Aqk.dtype.element_ty
    tl.store(Aqk + (row0 + top)[:, None] * BT + c16[None, :], b_Aqt.to(dt))
    tl.store(Aqk + (row0 + bot)[:, None] * BT + c16[None, :], b_Aqb.to(dt))
    tl.store(Ms_c + top[:, None] * BT + c16[None, :],
             tl.where(top[:, None] > c16[None, :], b_Akt, 0.0))
    tl.store(Ms_c + bot[:, None] * BT + c16[None, :],
             tl.where(bot[:, None] > c16[None, :], b_Akb, 0.0))
    tl.debug_barrier()  # the block's Akk columns, stored by all threads, before reading it back
    r16 = tl.arange(0, 16)
    p_L = tl.make_block_ptr(Ms_c, (BT, BT), (BT, 1), (i * 16, i * 16), (16, 16), (1, 0))
    b_L = tl.where(r16[:, None] > r16[None, :], tl.load(p_L), 0.0)
    tl.debug_barrier()  # read by every thread before X overwrites it
    tl.store(p_L, inverse16(b_L))
