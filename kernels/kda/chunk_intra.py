"""KDA prefill, stage 1: everything that is local to one chunk of BT tokens of one head.

Per chunk (G = in-chunk cumsum of the log2 decay, rows t, columns j):
  Aqk[t, j] = scale * sum_c q_t k_j 2^(G_t - G_j)              j <= t
  Akk[t, j] = beta_t * sum_c k_t k_j 2^(G_t - G_j)              j < t
  M = (I + Akk)^-1,  w = M (beta k 2^G),  u = M (beta v),  qg = scale q 2^G,  kg = k 2^(G_last - G)
so that the chunk's pseudo-values are U = u - w S0 (S0: state at the chunk start).

2^(G_t - G_j) overflows fp32 if formed as 2^G_t * 2^-G_j, so the pairs are split by the highest
bit in which t and j differ (levels b = BT/2 .. 1): at level b the pair has t in the odd half of
a block of 2b rows and j in the even half, and both factors 2^(G_t - G_a), 2^(G_a - G_j) around the
anchor row a (the first row of the odd half) are <= 1. Each level is two [BT, BK] x [BK, BT] dots.
M is found by forward substitution inside the 16-row diagonal blocks and two block merges,
X <- X - X N X, with N the off-diagonal part of the next coarser level.
q and k are L2-normalised in-kernel by scaling rows of the results (the norms are summed in the
same pass), and the gate activation and beta's sigmoid can be fused here too.

Performance (H200, T = 32K, H = 40): about 10.3 ms, 3x fla's intra stages (l2norm + cumsum +
token-parallel + inter/solve + w/u: about 3.6 ms). Most of the products of the full-size level dots
are masked away. This kernel is the prefill bottleneck; see perf/RESULTS.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from volundr.kernels.kda.utils import RCP_LN2, kda_gate_act


@triton.jit
def _chunk_bounds(chunk_idx, cu_seqlens, i_c, BT: tl.constexpr):
    """Chunk i_c of the packed batch (chunk_idx: its sequence and index in it): its first token
    t0 and the end of its sequence eos, int64."""
    i_n = tl.load(chunk_idx + 2 * i_c)
    i_t = tl.load(chunk_idx + 2 * i_c + 1)
    t0 = tl.load(cu_seqlens + i_n).to(tl.int64) + i_t * BT
    return t0, tl.load(cu_seqlens + i_n + 1).to(tl.int64)


@triton.jit
def _load_qkg(q, k, g, A_log, dt_bias, t0, m_t, i_h, i_k, TT, s_qt, s_qh,
              H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """q, k, G (in-chunk cumsum of the log2 decay) for the BK channels of block i_k; rows past
    the sequence end are zero."""
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    off = (t0.to(tl.int32), i_k * BK)
    p_q = tl.make_block_ptr(q + i_h * s_qh, (TT, K), (s_qt, 1), off, (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + i_h * s_qh, (TT, K), (s_qt, 1), off, (BT, BK), (1, 0))
    p_g = tl.make_block_ptr(g + i_h * K, (TT, K), (H * K, 1), off, (BT, BK), (1, 0))
    m = m_t[:, None] & m_k[None, :]
    b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    b_g = tl.load(p_g, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    b_q = tl.where(m, b_q, 0.0)
    b_k = tl.where(m, b_k, 0.0)
    if USE_GATE:
        b_g = kda_gate_act(b_g, A_log, dt_bias, i_h, o_k, m_k, K, HAS_DT_BIAS)
    b_g = tl.where(m, b_g, 0.0)
    return b_q, b_k, tl.cumsum(b_g * RCP_LN2, axis=0), o_k, m_k


@triton.jit(do_not_specialize=["T", "NC"])
def _chunk_kda_intra_kernel(
    q, k, v, g, beta, A_log, dt_bias, w, u, qg, kg, Aqk, gl, cu_seqlens, chunk_idx,
    scale, T, NC, s_qt, s_qh, s_vt, s_vh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, LOG_BT: tl.constexpr, L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    o_t = tl.arange(0, BT)
    tok = t0 + o_t
    m_t = tok < eos

    b_b = tl.load(beta + tok * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b_b = tl.where(m_t, tl.sigmoid(b_b), 0.0)

    # ---- pass 1: Aqk, Akk (before normalisation), row norms of q and k
    b_Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_Akk = tl.zeros([BT, BT], dtype=tl.float32)
    b_sq = tl.zeros([BT], dtype=tl.float32)
    b_sk = tl.zeros([BT], dtype=tl.float32)
    b_qk = tl.zeros([BT], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        b_q, b_k, b_G, o_k, m_k = _load_qkg(q, k, g, A_log, dt_bias, t0, m_t, i_h, i_k, T,
                                            s_qt, s_qh, H, K, BT, BK, USE_GATE, HAS_DT_BIAS)
        b_sq += tl.sum(b_q * b_q, axis=1)
        b_sk += tl.sum(b_k * b_k, axis=1)
        b_qk += tl.sum(b_q * b_k, axis=1)
        for lvl in range(LOG_BT):
            b = BT >> (lvl + 1)
            anchor = (o_t // (2 * b)) * (2 * b) + b
            b_Ga = tl.gather(b_G, tl.broadcast_to(anchor[:, None], (BT, BK)), axis=0)
            odd = ((o_t // b) % 2) == 1
            # one exp per element: rows of the odd half take 2^(G - Ga), the even half 2^(Ga - G)
            b_e = tl.exp2(tl.where(odd[:, None], b_G - b_Ga, b_Ga - b_G))
            b_kj = tl.trans(tl.where(odd[:, None], 0.0, b_e) * b_k)
            b_et = tl.where(odd[:, None], b_e, 0.0)
            same = (o_t[:, None] // (2 * b)) == (o_t[None, :] // (2 * b))
            b_Aqk += tl.where(same, tl.dot(b_q * b_et, b_kj), 0.0)
            b_Akk += tl.where(same, tl.dot(b_k * b_et, b_kj), 0.0)

    if L2NORM:
        b_rq = tl.rsqrt(b_sq + 1e-6)
        b_rk = tl.rsqrt(b_sk + 1e-6)
    else:
        b_rq = tl.full([BT], 1.0, dtype=tl.float32)
        b_rk = tl.full([BT], 1.0, dtype=tl.float32)
    diag = o_t[:, None] == o_t[None, :]
    b_Aqk = b_Aqk + tl.where(diag, b_qk[:, None], 0.0)
    b_Aqk = tl.where(o_t[:, None] >= o_t[None, :], b_Aqk, 0.0)
    b_Aqk = b_Aqk * (b_rq * scale)[:, None] * b_rk[None, :]
    b_Akk = tl.where(o_t[:, None] > o_t[None, :], b_Akk, 0.0)
    b_Akk = b_Akk * (b_b * b_rk)[:, None] * b_rk[None, :]
    # outputs: head-major, one slot of BT rows per chunk (rows past the sequence end are 0)
    row0 = (i_h * NC + i_c).to(tl.int64) * BT
    p_A = tl.make_block_ptr(Aqk + row0 * BT, (BT, BT), (BT, 1), (0, 0), (BT, BT), (1, 0))
    tl.store(p_A, b_Aqk.to(Aqk.dtype.element_ty))

    # ---- (I + Akk)^-1: forward substitution in the 16 x 16 diagonal blocks, all blocks at once
    # (moving blocks between [BT, BT] and [BT / 16, 16, 16] with exact 0/1 matmuls keeps Triton
    # from building 4-d layouts that spill)
    NB: tl.constexpr = BT // 16
    r16 = tl.arange(0, 16)
    blk16 = (o_t[:, None] // 16) == (o_t[None, :] // 16)
    b_sel = ((o_t[:, None] % 16) == r16[None, :]).to(tl.float32)             # [BT, 16]
    # D[r, j] = Akk[r, 16 * (r // 16) + j]
    b_D = tl.dot(tl.where(blk16, b_Akk, 0.0), b_sel, input_precision="ieee")
    b_D = tl.reshape(b_D, (NB, 16, 16))
    b_X = tl.zeros([NB, 16, 16], dtype=tl.float32)
    for i in range(16):
        row = r16[None, :, None] == i
        b_d = tl.sum(tl.where(row, b_D, 0.0), axis=1)                       # [NB, 16] = D[:, i, :]
        b_x = (r16 == i).to(tl.float32)[None, :] - tl.sum(b_d[:, :, None] * b_X, axis=1)
        b_X = tl.where(row, b_x[:, None, :], b_X)
    b_M = tl.dot(tl.reshape(b_X, (BT, 16)), tl.trans(b_sel), input_precision="ieee")
    b_M = tl.where(blk16, b_M, 0.0)
    for s in tl.static_range(LOG_BT - 4):
        blk = 16 << s
        near = (o_t[:, None] // (2 * blk)) == (o_t[None, :] // (2 * blk))
        apart = (o_t[:, None] // blk) != (o_t[None, :] // blk)
        b_N = tl.where(near & apart, b_Akk, 0.0)
        b_M = b_M - tl.dot(tl.dot(b_M, b_N, input_precision="tf32x3"), b_M,
                           input_precision="tf32x3")

    # ---- pass 2: w, qg, kg and the chunk decay 2^G_last
    for i_k in tl.static_range((K + BK - 1) // BK):
        b_q, b_k, b_G, o_k, m_k = _load_qkg(q, k, g, A_log, dt_bias, t0, m_t, i_h, i_k, T,
                                            s_qt, s_qh, H, K, BT, BK, USE_GATE, HAS_DT_BIAS)
        b_Gl = tl.sum(tl.where(o_t[:, None] == BT - 1, b_G, 0.0), axis=0)   # padded rows add 0
        b_kn = b_k * b_rk[:, None]
        b_eG = tl.exp2(b_G)
        b_w = tl.dot(b_M, b_kn * b_eG * b_b[:, None])
        p_w = tl.make_block_ptr(w + row0 * K, (BT, K), (K, 1), (0, i_k * BK), (BT, BK), (1, 0))
        p_qg = tl.make_block_ptr(qg + row0 * K, (BT, K), (K, 1), (0, i_k * BK), (BT, BK), (1, 0))
        p_kg = tl.make_block_ptr(kg + row0 * K, (BT, K), (K, 1), (0, i_k * BK), (BT, BK), (1, 0))
        tl.store(p_w, b_w.to(w.dtype.element_ty), boundary_check=(1,))
        b_qg = b_q * (b_rq * scale)[:, None] * b_eG
        tl.store(p_qg, b_qg.to(qg.dtype.element_ty), boundary_check=(1,))
        b_kg = b_kn * tl.exp2(b_Gl[None, :] - b_G)
        tl.store(p_kg, b_kg.to(kg.dtype.element_ty), boundary_check=(1,))
        tl.store(gl + (i_c * H + i_h) * K + o_k, tl.exp2(b_Gl), mask=m_k)
    for i_v in tl.static_range((V + BV - 1) // BV):
        off = (t0.to(tl.int32), i_v * BV)
        p_v = tl.make_block_ptr(v + i_h * s_vh, (T, V), (s_vt, 1), off, (BT, BV), (1, 0))
        b_v = tl.load(p_v, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_u = tl.dot(b_M, tl.where(m_t[:, None], b_v * b_b[:, None], 0.0))
        p_u = tl.make_block_ptr(u + row0 * V, (BT, V), (V, 1), (0, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_u, b_u.to(u.dtype.element_ty), boundary_check=(1,))
