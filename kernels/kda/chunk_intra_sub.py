"""KDA prefill, stage 1, sub-chunk variant (VOLUNDR_KDA_INTRA=sub; its phases and helpers also
serve the default "split" path, chunk_intra_split.py).

Produces what `_chunk_kda_intra_kernel` (chunk_intra.py) produces for the recurrence kernel (w, u,
qg, kg, Aqk in the same head-major slots, gl = 2^G_last; equal up to fp32 / tf32 rounding, tests
check it) with the same math, but works on 16-row sub-chunks instead of full BT x BT tiles.
One program per (chunk, head), four phases separated by CTA barriers; fp32 scratch in global
memory (L1/L2-resident: one chunk's worth per program) carries data between phases instead of
registers:

0. G (in-chunk cumsum of the log2 decay, gate activation fused) -> scratch `Gs` [H, NT * BT, K];
   row norms of q and k -> scratch `rn` [H, NT * BT, 2]. (Scratch is allocated by chunk.py.)
1. Per row sub-chunk i (rows 16i .. 16i + 15) the [16, BT] block-row of Aqk and Akk:
   - diagonal block: the split-level trick of chunk_intra.py restricted to 16 x 16 tiles (levels
     b = 8, 4, 2, 1; a pair (t, j) is split at the highest bit where t and j differ and both
     factors 2^(G_t - G_a), 2^(G_a - G_j) around the anchor row a are <= 1). Anchor rows are read
     back from `Gs` (an L1 hit) instead of being gathered through shared memory.
   - off-diagonal blocks (i, jj < i): anchor = first row n of sub-chunk i (fla's choice):
     (q_i 2^(G_i - G_n)) (k_jj 2^(G_n - G_jj))^T, both factors <= 1.
   Aqk goes straight to its output; Akk (beta and norms applied, strictly lower) to scratch `Ms`.
2. M = (I + Akk)^-1 by block forward substitution, one block-row at a time, in place in `Ms`:
   X_i = (I + L_ii)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8), M_i = X_i (E_i - L_i,<i M_<i).
3. w = M (beta k 2^G), u = M (beta v), qg, kg, gl: as pass 2 of chunk_intra.py.

No exponent is ever positive (decay-stable for any decay size), no register tile is larger than
[BT, BK] / [16, BK1], and products the causal mask throws away are formed only inside 16 x 16
tiles. Every loop over channels / levels is dynamic: unrolled, the compiler hoisted all
iterations' loads and ran out of registers.

Work per chunk of one head (BT = 64, K = V = 128), against chunk_intra.py: tensor-core FLOPs
~2.9 M for Aqk / Akk (12.6 M), ~1.1 M for the inverse (6.3 M, tf32x3 merges), 2.1 M for w / u
(same); exp2 ~73 K (~65 K); fp32 scratch traffic per chunk 32 KB G + 16 KB M written once, read
back from L1 / L2. sm_90 compile (ptxas -v, BK1 32, BK 16, BV 32, 4 warps): 226 registers, no
spills, 24 KB shared (chunk_intra.py: 255 registers, 2.7 KB spill stores / 4.5 KB spill loads,
96 KB shared); with maxnreg 168: ~180 B of spills, 3 CTAs / SM. Not yet timed on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from volundr.kernels.kda.chunk_intra import _chunk_bounds, _load_qkg


@triton.jit
def inverse16(b_L):
    """(I + L)^-1 for a strictly lower 16 x 16 L: (I - L)(I + L^2)(I + L^4)(I + L^8), exact
    since L^16 = 0; six dependent fp32 FMA dots ("ieee")."""
    r16 = tl.arange(0, 16)
    b_X = (r16[:, None] == r16[None, :]).to(tl.float32) - b_L
    b_P = tl.dot(b_L, b_L, input_precision="ieee")
    for s in tl.static_range(3):
        b_X += tl.dot(b_X, b_P, input_precision="ieee")
        if s < 2:
            b_P = tl.dot(b_P, b_P, input_precision="ieee")
    return b_X


@triton.jit
def block_inverse(b_S, BT: tl.constexpr, PREC: tl.constexpr):
    """M = (I + A)^-1 for a strictly lower [BT, BT] A (BT <= 64) given as S: the inverses X_i of
    the 16 x 16 diagonal blocks of I + A on the diagonal, A itself left of them. With D =
    blockdiag(X_i) and N the strictly block-lower part of A, I + A = (I + A_d)(I + D N) and
    P = D N has P^(BT / 16) = 0, so M = (I + P)^-1 D = (I - P)(I + P^2) D: four [BT, BT] dots
    instead of a block-by-block substitution (PREC: fp32 accuracy on the tensor cores, tf32x3,
    or one tf32 pass, the precision of the w / u dots that use M)."""
    o_t = tl.arange(0, BT)
    blk_r, blk_c = (o_t // 16)[:, None], (o_t // 16)[None, :]
    b_D = tl.where(blk_r == blk_c, b_S, 0.0)
    b_P = tl.dot(b_D, tl.where(blk_r > blk_c, b_S, 0.0), input_precision=PREC)
    b_Q = tl.dot(b_P, b_P, input_precision=PREC)
    b_Q += (o_t[:, None] == o_t[None, :]).to(tl.float32)
    b_R = b_Q - tl.dot(b_P, b_Q, input_precision=PREC)
    return tl.dot(b_R, b_D, input_precision=PREC)


@triton.jit
def _sub_tiles(q, k, Gs_c, t0, r0, m_r, i_h, i_k, T, s_qt, s_qh, K: tl.constexpr,
               BK: tl.constexpr, LOAD_Q: tl.constexpr = True):
    """q, k (fp32, rows past the sequence end zeroed) and G (scratch) for chunk rows r0 .. r0 + 15
    and the BK channels of block i_k. Block pointers: 32-bit offsets, no per-element pointers."""
    off = ((t0 + r0).to(tl.int32), i_k * BK)
    p_k = tl.make_block_ptr(k + i_h * s_qh, (T, K), (s_qt, 1), off, (16, BK), (1, 0))
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    b_k = tl.where(m_r[:, None], b_k, 0.0)
    if LOAD_Q:
        p_q = tl.make_block_ptr(q + i_h * s_qh, (T, K), (s_qt, 1), off, (16, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_q = tl.where(m_r[:, None], b_q, 0.0)
    else:
        b_q = b_k
    p_G = tl.make_block_ptr(Gs_c, (r0 + 16, K), (K, 1), (r0, i_k * BK), (16, BK), (1, 0))
    b_G = tl.load(p_G, boundary_check=(1,), padding_option="zero")
    return b_q, b_k, b_G


@triton.jit
def _diag_levels(b_qi, b_ki, b_Gi, Gs_c, r0, o_k1, K: tl.constexpr):
    """The 16 x 16 diagonal block of rows r0 .. r0 + 15 (Aqk with t >= j, Akk unmasked) for the
    channels o_k1: the t == j terms plus levels b = 8, 4, 2, 1, where a pair (t, j) is split at the
    highest bit in which t and j differ and both factors 2^(G_t - G_a), 2^(G_a - G_j) around the
    anchor row a are <= 1. Anchor rows are read back from the G scratch (an L1 hit)."""
    r16 = tl.arange(0, 16)
    b_dg = tl.sum(b_qi * b_ki, axis=1)
    b_Aq = tl.where(r16[:, None] == r16[None, :], b_dg[:, None], 0.0)
    b_Ak = tl.zeros([16, 16], dtype=tl.float32)
    # dynamic: unrolled, the one-program kernel hoisted every level's loads (no registers left);
    # in the block-row kernel unrolled was slower too (H200 runs 34-35)
    for lvl in range(4):
        b = 8 >> lvl
        anchor = r0 + (r16 // (2 * b)) * (2 * b) + b
        b_Ga = tl.load(Gs_c + anchor[:, None] * K + o_k1[None, :], mask=(o_k1 < K)[None, :],
                       other=0.0)
        odd = ((r16 // b) % 2) == 1
        # one exp per element: odd-half rows 2^(G - Ga), even-half rows 2^(Ga - G)
        b_ex = tl.exp2(tl.where(odd[:, None], b_Gi - b_Ga, b_Ga - b_Gi))
        b_kj = tl.trans(tl.where(odd[:, None], 0.0, b_ex * b_ki))
        b_et = tl.where(odd[:, None], b_ex, 0.0)
        same = (r16[:, None] // (2 * b)) == (r16[None, :] // (2 * b))
        b_Aq += tl.where(same, tl.dot(b_qi * b_et, b_kj), 0.0)
        b_Ak += tl.where(same, tl.dot(b_ki * b_et, b_kj), 0.0)
    return b_Aq, b_Ak


@triton.jit
def _block_row(q, k, beta, Aqk, Ms_c, Gs_c, rn, t0, eos, row0, i, i_h, scale, T, s_qt, s_qh,
               H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK1: tl.constexpr,
               BETA_SIGMOID: tl.constexpr, DIAG: tl.constexpr = True):
    """Block-row i (chunk rows 16 i .. 16 i + 15) of Aqk and Akk: stores Aqk's blocks (zeros
    right of the diagonal) and Akk's blocks left of the diagonal to Ms; returns Akk's diagonal
    block (strictly lower, beta and norms applied). DIAG=False: the diagonal block is left to
    `_kda_intra_diag_kernel` (chunk_intra_split.py), nothing is computed for it here and the
    returned block is zeros."""
    r16 = tl.arange(0, 16)
    r_i = i * 16 + r16                                   # chunk rows of sub-chunk i
    m_i = (t0 + r_i) < eos
    b_rqi = tl.load(rn + (row0 + r_i) * 2)
    b_rki = tl.load(rn + (row0 + r_i) * 2 + 1)
    b_bi = tl.load(beta + (t0 + r_i) * H + i_h, mask=m_i, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b_bi = tl.where(m_i, tl.sigmoid(b_bi), 0.0)
    b_Ak = tl.zeros([16, 16], dtype=tl.float32)
    if DIAG:
        b_Aq = tl.zeros([16, 16], dtype=tl.float32)
        for i_k1 in range((K + BK1 - 1) // BK1):
            b_qi, b_ki, b_Gi = _sub_tiles(q, k, Gs_c, t0, i * 16, m_i, i_h, i_k1, T, s_qt, s_qh,
                                          K, BK1)
            o_k1 = i_k1 * BK1 + tl.arange(0, BK1)
            b_dq, b_dk = _diag_levels(b_qi, b_ki, b_Gi, Gs_c, i * 16, o_k1, K)
            b_Aq += b_dq
            b_Ak += b_dk
        b_Aq = tl.where(r16[:, None] >= r16[None, :], b_Aq, 0.0)
        b_Aq = b_Aq * (b_rqi * scale)[:, None] * b_rki[None, :]
        b_Ak = tl.where(r16[:, None] > r16[None, :], b_Ak, 0.0)
        b_Ak = b_Ak * (b_bi * b_rki)[:, None] * b_rki[None, :]
        p_A = tl.make_block_ptr(Aqk + row0 * BT, (BT, BT), (BT, 1), (i * 16, i * 16), (16, 16),
                                (1, 0))
        tl.store(p_A, b_Aq.to(Aqk.dtype.element_ty))
    # blocks right of the diagonal: Aqk must hold zeros there (Ms is masked on read)
    for jj in range(i + 1, BT // 16):
        p_A = tl.make_block_ptr(Aqk + row0 * BT, (BT, BT), (BT, 1), (i * 16, jj * 16),
                                (16, 16), (1, 0))
        tl.store(p_A, tl.zeros([16, 16], dtype=Aqk.dtype.element_ty))
    # blocks left of the diagonal, anchored at the first row n of sub-chunk i
    for jj in range(i):
        m_j = (t0 + jj * 16 + r16) < eos
        b_rkj = tl.load(rn + (row0 + jj * 16 + r16) * 2 + 1)
        b_Lq = tl.zeros([16, 16], dtype=tl.float32)
        b_Lk = tl.zeros([16, 16], dtype=tl.float32)
        for i_k1 in range((K + BK1 - 1) // BK1):
            b_qi, b_ki, b_Gi = _sub_tiles(q, k, Gs_c, t0, i * 16, m_i, i_h, i_k1, T, s_qt,
                                          s_qh, K, BK1)
            o_k1 = i_k1 * BK1 + tl.arange(0, BK1)
            b_Gn = tl.load(Gs_c + (i * 16) * K + o_k1, mask=o_k1 < K, other=0.0)
            b_en = tl.exp2(b_Gi - b_Gn[None, :])
            _, b_kx, b_Gj = _sub_tiles(q, k, Gs_c, t0, jj * 16, m_j, i_h, i_k1, T, s_qt,
                                       s_qh, K, BK1, LOAD_Q=False)
            b_kjt = tl.trans(b_kx * tl.exp2(b_Gn[None, :] - b_Gj))
            b_Lq += tl.dot(b_qi * b_en, b_kjt)
            b_Lk += tl.dot(b_ki * b_en, b_kjt)
        b_Lq = b_Lq * (b_rqi * scale)[:, None] * b_rkj[None, :]
        b_Lk = b_Lk * (b_bi * b_rki)[:, None] * b_rkj[None, :]
        p_A = tl.make_block_ptr(Aqk + row0 * BT, (BT, BT), (BT, 1), (i * 16, jj * 16),
                                (16, 16), (1, 0))
        tl.store(p_A, b_Lq.to(Aqk.dtype.element_ty))
        p_L = tl.make_block_ptr(Ms_c, (BT, BT), (BT, 1), (i * 16, jj * 16), (16, 16), (1, 0))
        tl.store(p_L, b_Lk)
    return b_Ak


@triton.jit(do_not_specialize=["T", "NC"])
def _chunk_kda_intra_sub_kernel(
    q, k, v, g, beta, A_log, dt_bias, w, u, qg, kg, Aqk, gl, Gs, Ms, Mh, rn, cu_seqlens,
    chunk_idx, scale, T, NC, s_qt, s_qh, s_vt, s_vh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BK1: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr, PHASES: tl.constexpr = 7,
    BLOCK_INV: tl.constexpr = False, INV_PREC: tl.constexpr = "tf32x3",
    M16: tl.constexpr = False,
):
    """PHASES, bits: 1 = phase 0, 2 = phases 1-2, 4 = phase 3, 8 = M = `block_inverse` of Ms in
    place (7: all in one launch; 3 then 4: two launches, each with its own register budget; the
    scratch carries everything between them; 1, chunk_intra_split.py's kernel, then 4 with
    BLOCK_INV or 8 then 4: the split path).
    BLOCK_INV: phase 3 finds M from Ms holding X_i = (I + L_ii)^-1 on the diagonal blocks and
    Akk left of them (see chunk_intra_split.py) instead of reading M. INV_PREC: the precision of
    the block inverse's dots. M16: M in Mh's 16-bit dtype (phase 8 writes it there, Mh being Ms's
    memory seen as 16-bit, rows 2 BT apart) and the w / u dots in 16 bit, as fla's
    `recompute_w_u` does with its bf16 A (half the M traffic, full-rate tensor cores)."""
    NS: tl.constexpr = BT // 16
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    o_t = tl.arange(0, BT)
    m_t = (t0 + o_t) < eos
    r16 = tl.arange(0, 16)
    # head-major slot of this chunk in the outputs and in the scratch buffers
    row0 = (i_h * NC + i_c).to(tl.int64) * BT
    Gs_c = Gs + row0 * K
    Ms_c = Ms + row0 * BT

    if PHASES & 1:
        # ---- phase 0: G -> scratch, row norms
        b_sq = tl.zeros([BT], dtype=tl.float32)
        b_sk = tl.zeros([BT], dtype=tl.float32)
        # (dynamic loops over channel blocks here and in phase 3: unrolled, the compiler hoists
        # every block's loads and runs out of registers)
        for i_k in range((K + BK - 1) // BK):
            b_q, b_k, b_G, o_k, m_k = _load_qkg(q, k, g, A_log, dt_bias, t0, m_t, i_h, i_k, T,
                                                s_qt, s_qh, H, K, BT, BK, USE_GATE, HAS_DT_BIAS)
            b_sq += tl.sum(b_q * b_q, axis=1)
            b_sk += tl.sum(b_k * b_k, axis=1)
            p_G = tl.make_block_ptr(Gs_c, (BT, K), (K, 1), (0, i_k * BK), (BT, BK), (1, 0))
            tl.store(p_G, b_G, boundary_check=(1,))
        if L2NORM:
            b_rq = tl.rsqrt(b_sq + 1e-6)
            b_rk = tl.rsqrt(b_sk + 1e-6)
        else:
            b_rq = tl.full([BT], 1.0, dtype=tl.float32)
            b_rk = tl.full([BT], 1.0, dtype=tl.float32)
        tl.store(rn + (row0 + o_t) * 2, b_rq)
        tl.store(rn + (row0 + o_t) * 2 + 1, b_rk)
        tl.debug_barrier()  # Gs / rn written by all threads before anyone reads them back

    if PHASES & 2:
        # ---- phase 1: block-rows of Aqk and Akk (Akk's diagonal blocks to Ms as they are)
        for i in range(NS):
            b_L = _block_row(q, k, beta, Aqk, Ms_c, Gs_c, rn, t0, eos, row0, i, i_h, scale, T,
                             s_qt, s_qh, H, K, BT, BK1, BETA_SIGMOID)
            p_L = tl.make_block_ptr(Ms_c, (BT, BT), (BT, 1), (i * 16, i * 16), (16, 16), (1, 0))
            tl.store(p_L, b_L)
        tl.debug_barrier()  # Akk complete in Ms

        # ---- phase 2: M = (I + Akk)^-1, block-row by block-row, in place
        for i in range(NS):
            r_i = i * 16 + r16
            # X = (I + L_ii)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8), exact since L^16 = 0 for a
            # strictly lower 16 x 16 L: six dependent 16 x 16 dots instead of 16 substitution steps
            # (each a cross-warp reduction). fp32 FMA dots ("ieee"); entries of L^8 stay <= C(15, 7)
            # for |L| <= 1, so nothing overflows.
            p_Ld = tl.make_block_ptr(Ms_c, (BT, BT), (BT, 1), (i * 16, i * 16), (16, 16), (1, 0))
            b_X = inverse16(tl.where(r16[:, None] > r16[None, :], tl.load(p_Ld), 0.0))
            # M_i = X (E_i - sum_{m < i} L_im M_m): block-rows m < i of Ms already hold M
            b_R = (o_t[None, :] == (i * 16 + r16)[:, None]).to(tl.float32)
            for m in range(i):
                b_L = tl.load(Ms_c + r_i[:, None] * BT + (m * 16 + r16)[None, :])
                b_Mm = tl.load(Ms_c + (m * 16 + r16)[:, None] * BT + o_t[None, :])
                b_R -= tl.dot(b_L, b_Mm, input_precision="tf32x3")
            b_Mi = tl.dot(b_X, b_R, input_precision="tf32x3")
            tl.debug_barrier()  # every thread has read L_i before it is overwritten
            tl.store(Ms_c + r_i[:, None] * BT + o_t[None, :], b_Mi)
            tl.debug_barrier()  # M_i visible to the next block-rows and to phase 3

    # M as 16-bit: Ms's rows seen as 2 BT 16-bit values, M in the first BT of them
    p_Mh = tl.make_block_ptr(Mh + row0 * 2 * BT, (BT, BT), (2 * BT, 1), (0, 0), (BT, BT), (1, 0))
    if PHASES & 8:
        p_S = tl.make_block_ptr(Ms_c, (BT, BT), (BT, 1), (0, 0), (BT, BT), (1, 0))
        b_M = block_inverse(tl.load(p_S), BT, INV_PREC)
        if M16:
            # (the dots inside block_inverse exchange through shared memory with barriers, so
            # every thread has read Ms before any thread overwrites it)
            tl.store(p_Mh, b_M.to(Mh.dtype.element_ty))
        else:
            tl.store(p_S, b_M)

    if PHASES & 4:
        # ---- phase 3: w, qg, kg, the chunk decay 2^G_last, u
        # (block pointers: per-element 64-bit pointer tensors cost two registers an element)
        # per-row vectors are re-read here rather than kept live through phases 1-2 (in the [BT, BK]
        # layouts a [BT] vector takes BT / 8 registers a thread)
        b_rq = tl.load(rn + (row0 + o_t) * 2)
        b_rk = tl.load(rn + (row0 + o_t) * 2 + 1)
        b_b = tl.load(beta + (t0 + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        if BETA_SIGMOID:
            b_b = tl.where(m_t, tl.sigmoid(b_b), 0.0)
        if M16:  # (not with BLOCK_INV: the H200 gave garbage for that pair, run 54)
            b_M = tl.load(p_Mh)
        else:
            p_M = tl.make_block_ptr(Ms_c, (BT, BT), (BT, 1), (0, 0), (BT, BT), (1, 0))
            b_M = tl.load(p_M)
            if BLOCK_INV:
                b_M = block_inverse(b_M, BT, INV_PREC)
        for i_k in range((K + BK - 1) // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            off = (t0.to(tl.int32), i_k * BK)
            p_q = tl.make_block_ptr(q + i_h * s_qh, (T, K), (s_qt, 1), off, (BT, BK), (1, 0))
            p_k = tl.make_block_ptr(k + i_h * s_qh, (T, K), (s_qt, 1), off, (BT, BK), (1, 0))
            b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
            b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
            b_k = tl.where(m_t[:, None], b_k, 0.0)
            p_G = tl.make_block_ptr(Gs_c, (BT, K), (K, 1), (0, i_k * BK), (BT, BK), (1, 0))
            b_G = tl.load(p_G, boundary_check=(1,), padding_option="zero")
            b_Gl = tl.load(Gs_c + (BT - 1) * K + o_k, mask=m_k, other=0.0)  # padded rows add 0
            b_kn = b_k * b_rk[:, None]
            b_eG = tl.exp2(b_G)
            b_w = tl.dot(b_M, (b_kn * b_eG * b_b[:, None]).to(b_M.dtype))
            o_c = (0, i_k * BK)
            p_w = tl.make_block_ptr(w + row0 * K, (BT, K), (K, 1), o_c, (BT, BK), (1, 0))
            p_qg = tl.make_block_ptr(qg + row0 * K, (BT, K), (K, 1), o_c, (BT, BK), (1, 0))
            p_kg = tl.make_block_ptr(kg + row0 * K, (BT, K), (K, 1), o_c, (BT, BK), (1, 0))
            tl.store(p_w, b_w.to(w.dtype.element_ty), boundary_check=(1,))
            b_qg = tl.where(m_t[:, None], b_q * (b_rq * scale)[:, None] * b_eG, 0.0)
            tl.store(p_qg, b_qg.to(qg.dtype.element_ty), boundary_check=(1,))
            b_kg = b_kn * tl.exp2(b_Gl[None, :] - b_G)
            tl.store(p_kg, b_kg.to(kg.dtype.element_ty), boundary_check=(1,))
            tl.store(gl + (i_c * H + i_h) * K + o_k, tl.exp2(b_Gl), mask=m_k)
        for i_v in range((V + BV - 1) // BV):
            off = (t0.to(tl.int32), i_v * BV)
            p_v = tl.make_block_ptr(v + i_h * s_vh, (T, V), (s_vt, 1), off, (BT, BV), (1, 0))
            b_v = tl.load(p_v, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
            b_u = tl.dot(b_M, tl.where(m_t[:, None], b_v * b_b[:, None], 0.0).to(b_M.dtype))
            p_u = tl.make_block_ptr(u + row0 * V, (BT, V), (V, 1), (0, i_v * BV), (BT, BV), (1, 0))
            tl.store(p_u, b_u.to(u.dtype.element_ty), boundary_check=(1,))
