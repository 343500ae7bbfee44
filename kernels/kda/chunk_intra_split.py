"""KDA prefill, stage 1, with the A matrices in one program per 16-row block-row
(VOLUNDR_KDA_INTRA=split).

Same outputs as `_chunk_kda_intra_kernel` (chunk_intra.py; w, u, qg, kg, Aqk in head-major
chunk slots, gl = 2^G_last), same math. The "sub" kernel does everything for one (chunk, head)
in one long program: ~150 dependent small steps at 2 CTAs per SM, latency-bound (H200, T = 32K,
H = 40: ~93 us per program, 7.2 ms). Here three launches:

1. the sub kernel's phase 0 (PHASES=1): G = in-chunk cumsum of the log2 decay and the row norms
   of q and k to scratch;
2. `_kda_intra_a_kernel` below, grid (chunks x BT / 16, H): block-row i of a chunk per program
   (the sub kernel's phase-1 step, `_block_row`), four times the programs, each a short chain,
   and one warp each (no CTA barriers in the layout changes of the small dots; H200 runs
   34-35: fewest warps fastest, whole prefill at T = 32K 6.9 ms at 1 warp, 8.4 at 4), then X_i =
   (I + L_ii)^-1 of its diagonal Akk block; L is strictly lower 16 x 16, so L^16 = 0 and
   X_i = (I - L)(I + L^2)(I + L^4)(I + L^8): six dependent fp32 dots.
   Writes Aqk's block-row and, to scratch Ms, X_i on the diagonal block and Akk left of it;
3. M = (I + Akk)^-1 from Ms in four [BT, BT] dots (`block_inverse`; the sub kernel with
   PHASES=8, written back to Ms), then the sub kernel's phase 3 (PHASES=4): w = M (beta k 2^G),
   u = M (beta v), qg, kg, gl. (split_inv_apart=False: the inverse inside phase 3, BLOCK_INV;
   222 registers instead of 128 there, 4% slower at T = 128K.)

As everywhere in stage 1, G is non-increasing (log decays <= 0): no exponent formed is positive.
"""

from __future__ import annotations

import triton
import triton.language as tl

from volundr.kernels.kda.chunk_intra_sub import _block_row, inverse16


@triton.jit(do_not_specialize=["T", "NC"])
def _kda_intra_a_kernel(
    q, k, beta, Aqk, Gs, Ms, rn, cu_seqlens, chunk_idx, scale, T, NC, s_qt, s_qh,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
):
    NS: tl.constexpr = BT // 16
    i_ci, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i = i_ci // NS, i_ci % NS
    i_n = tl.load(chunk_idx + 2 * i_c)
    i_t = tl.load(chunk_idx + 2 * i_c + 1)
    t0 = tl.load(cu_seqlens + i_n).to(tl.int64) + i_t * BT
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    row0 = (i_h * NC + i_c).to(tl.int64) * BT
    Ms_c = Ms + row0 * BT
    b_L = _block_row(q, k, beta, Aqk, Ms_c, Gs + row0 * K, rn, t0, eos, row0, i, i_h, scale, T,
                     s_qt, s_qh, H, K, BT, BK, BETA_SIGMOID)
    # X = (I + L)^-1, L = the beta-scaled strictly lower Akk block
    p_X = tl.make_block_ptr(Ms_c, (BT, BT), (BT, 1), (i * 16, i * 16), (16, 16), (1, 0))
    tl.store(p_X, inverse16(b_L))
