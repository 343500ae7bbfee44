"""Chunked KDA prefill: `chunk_kda` (fla's signature for the subset Volundr needs).

Two stages (plus a tiny host-built chunk map for varlen batches):
1. stage 1 (below: three implementations), all chunk-local work, fully parallel: w, u, qg, kg,
   Aqk and the chunk decay.
2. `_chunk_kda_fwd_kernel` below, grid (V / BV, N * H): walks the chunks of one sequence in order,
   carrying a [K, BV] slice of the state in registers; per chunk
       U = u - w S,   o = qg S + Aqk U,   S = diag(2^G_last) S + kg^T U.
   The output is formed here, so the per-chunk states never go to memory unless asked for
   (`return_chunk_states`, for prefix caching).
Stage 1 has three implementations with the same outputs: "split" (chunk_intra_split.py: the
sub kernel's phase 0, the diagonal 16 x 16 blocks element-wise, one one-warp program per 16-row
block-row for the rest, the sub kernel's phase 3 with a block inverse; the default since H200
run 37 of 2026-12-04; run 58: prefill at T = 32K 5.03 ms vs 8.10 for "sub", fla 5.18), "sub"
(`_chunk_kda_intra_sub_kernel`, chunk_intra_sub.py: one program per chunk, 16-row sub-chunk
tiles and fp32 scratch; 8.66 vs 11.21 ms for "fused" in run 6) and "fused"
(`_chunk_kda_intra_kernel`, full 64 x 64 tiles). VOLUNDR_KDA_INTRA picks one at import;
CONFIG["intra"] can be changed at run time (tests, benchmarks).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from volundr.kernels.kda.chunk_intra import _chunk_kda_intra_kernel
from volundr.kernels.kda.chunk_intra_split import _kda_intra_a_kernel, _kda_intra_diag_kernel
from volundr.kernels.kda.chunk_intra_sub import _chunk_kda_intra_sub_kernel
from volundr.kernels.kda.utils import chunk_maps, seq_bounds, token_strides

# Launch settings, from perf/kernels/bench_kda.py --sweep on the H200 (T = 32K, H = 40).
# fwd_BV None: 64, or 32 / 16 when that leaves too few programs. (fwd_stages=1 faulted there;
# 3 instead of 2: the recurrence at T = 32K 1.15 -> 0.79 ms, H200 run 57.)
CONFIG = {"intra_BK": 32, "intra_warps": 4, "fwd_BV": None, "fwd_warps": 4, "fwd_stages": 3,
          "intra": os.environ.get("VOLUNDR_KDA_INTRA", "split"),
          # sub path: channel blocks of the A phase / of the w, qg, kg phase, value block of u,
          # warps (the sm_90 compile's register-spill-free choice; unmeasured)
          # maxnreg: None lets ptxas take 226 registers (no spills; 2 CTAs/SM); 168 gives 3 CTAs/SM
          # with ~200 B of spills. Which is faster is for the GPU to say (bench_kda --intra-compare)
          "sub_BK1": 32, "sub_BK": 16, "sub_BV": 32, "sub_warps": 4, "sub_maxnreg": None,
          # sub_split: phases 0-2 and phase 3 (w, u, qg, kg) as two launches; phase 3 alone fits
          # 128 registers without spills (sub_maxnreg_wu), phases 0-2 168 with ~44 B of spills
          "sub_split": False, "sub_maxnreg_wu": None,
          # split path (chunk_intra_split.py): channel block and warps of the block-row kernel;
          # channel / value blocks, warps and register cap of phase 0 and phase 3 (w, u)
          "split_BK_a": 32, "split_warps_a": 1, "split_BK": 32, "split_BV": 32,
          "split_warps": 4, "split_maxnreg": None,
          # split_inv_apart: M = (I + Akk)^-1 in a launch of its own before phase 3 (which then
          # fits 128 registers: run 36, T = 128K: 25.7 vs 26.9 ms); warps of phase 0 / of it
          "split_inv_apart": True, "split_warps_0": 4, "split_warps_inv": 2,
          # the inverse's dots: "tf32x3" (fp32 accuracy) or "tf32" (that of the w / u dots; run
          # 41, T = 128K: 24.1 ms with 2 warps vs 25.8 for tf32x3 with 4; output vs the fused
          # stage 1 3.2e-4 instead of 1.9e-4 relative, fla's 4.9e-3)
          "split_inv_prec": "tf32",
          # split_diag: the diagonal 16 x 16 blocks of Aqk / Akk element-wise in a kernel of
          # their own ("elem": `_kda_intra_diag_kernel`, split_warps_d warps, its column loop
          # unrolled with split_unroll_d), the block-row kernel doing the rest; or "levels" of
          # small dots inside the block-row kernel (session 13, T = 32K: diagonal kernel 1.46 ms
          # + block-row 0.91 against 2.54 for the block-row kernel with levels)
          "split_diag": "elem", "split_warps_d": 4, "split_unroll_d": True,
          # split_M16: for 16-bit inputs the block inverse (split_inv_apart only) writes M in
          # that dtype and phase 3's w / u dots run in it (fla's precision there); split_stages:
          # phase 3's num_stages (run 54, T = 32K: phase 3 1.08 ms -> 0.96 with both; either
          # alone is slower: 1.13 / 1.15)
          "split_M16": True, "split_stages": 3}
INTRA_MODES = ("fused", "sub", "split")


@triton.jit(do_not_specialize=["NC"])
def _chunk_kda_fwd_kernel(
    w, u, qg, kg, Aqk, gl, o, h0, ht, hc, cu_seqlens, chunk_offsets, state_idx, NC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_HC: tl.constexpr,
    USE_IDX: tl.constexpr, INPLACE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    if USE_IDX:
        slot = tl.load(state_idx + i_n).to(tl.int64)
        if slot < 0:
            return
    else:
        slot = i_n.to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_h = (o_k < K)[:, None] & (o_v < V)[None, :]
    off_h = o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + (slot * H + i_h) * K * V + off_h, mask=m_h, other=0.0).to(tl.float32)

    NT = tl.cdiv(eos - bos, BT)
    for i_t in tl.range(0, NT, num_stages=NUM_STAGES):
        i_c = c0 + i_t                      # global chunk index: its slot in the stage-1 outputs
        if STORE_HC:
            tl.store(hc + (i_c * H + i_h) * K * V + off_h, b_h, mask=m_h)
        row0 = (i_h * NC + i_c) * BT
        p_w = tl.make_block_ptr(w + row0 * K, (BT, K), (K, 1), (0, 0), (BT, BK), (1, 0))
        p_qg = tl.make_block_ptr(qg + row0 * K, (BT, K), (K, 1), (0, 0), (BT, BK), (1, 0))
        p_kg = tl.make_block_ptr(kg + row0 * K, (K, BT), (1, K), (0, 0), (BK, BT), (0, 1))
        p_u = tl.make_block_ptr(u + row0 * V, (BT, V), (V, 1), (0, i_v * BV), (BT, BV), (1, 0))
        p_A = tl.make_block_ptr(Aqk + row0 * BT, (BT, BT), (BT, 1), (0, 0), (BT, BT), (1, 0))
        b_w = tl.load(p_w)
        b_u = tl.load(p_u)
        b_qg = tl.load(p_qg)
        b_kgT = tl.load(p_kg)
        b_A = tl.load(p_A)
        b_gl = tl.load(gl + (i_c * H + i_h) * K + o_k)

        b_hb = b_h.to(b_w.dtype)
        b_vn = (b_u.to(tl.float32) - tl.dot(b_w, b_hb)).to(b_w.dtype)     # U = u - w S
        b_o = tl.dot(b_qg, b_hb) + tl.dot(b_A, b_vn)
        tok = bos + i_t * BT + o_t
        p_o = o + (tok * H + i_h)[:, None] * V + o_v[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=(tok < eos)[:, None])
        b_h = b_h * b_gl[:, None] + tl.dot(b_kgT, b_vn)

    if STORE_HT:
        if INPLACE:
            p_ht = ht + (slot * H + i_h) * K * V + off_h
        else:
            p_ht = ht + (i_n.to(tl.int64) * H + i_h) * K * V + off_h
        tl.store(p_ht, b_h.to(ht.dtype.element_ty), mask=m_h)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    inplace_final_state: bool | None = None,
    return_chunk_states: bool = False,
    chunk_size: int = 64,
    **kwargs,
):
    """Chunked KDA (fla's `chunk_kda`, forward only).

    q, k: [B, T, H, K] (any token/head strides, last dim contiguous); v: [B, T, H, V];
    g: [B, T, H, K] log decay, or raw gate logits with `use_gate_in_kernel` (A_log [H],
    dt_bias [H * K]); beta: [B, T, H] (logits with `use_beta_sigmoid_in_kernel`);
    cu_seqlens: [N + 1] int with B == 1 (`cu_seqlens_cpu`, the same on the host, saves a sync).
    initial_state: [N, H, K, V]; or with `ssm_state_indices` [N] a pool [slots, H, K, V] read at
    those rows and (inplace_final_state, the default then) written back in place.
    `return_chunk_states`: also the state before every chunk of `chunk_size` tokens of every
    sequence, [total chunks, H, K, V] fp32, sequence after sequence (for prefix caching).
    Returns (o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None[, chunk states]).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT = chunk_size
    if BT not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {BT}")
    if K & (K - 1) or V & (V - 1) or min(K, V) < 16:
        raise ValueError(f"head dims must be powers of two >= 16, got K={K}, V={V}")
    scale = K ** -0.5 if scale is None else scale
    cu = seq_bounds(cu_seqlens, cu_seqlens_cpu, B, T)
    N = len(cu) - 1
    if inplace_final_state is None:
        inplace_final_state = ssm_state_indices is not None
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state needs initial_state")
    if initial_state is not None and ssm_state_indices is None and initial_state.shape[0] != N:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states for {N} sequences")
    chunk_idx, chunk_offsets, NT, cu_t = chunk_maps(cu, BT, q.device, cu_seqlens is None)
    cu_seqlens = cu_t if cu_seqlens is None else cu_seqlens
    TT = B * T
    q, s_qt, s_qh = token_strides(q)
    k, s_kt, s_kh = token_strides(k)
    if (s_kt, s_kh) != (s_qt, s_qh):
        q, k = q.contiguous(), k.contiguous()
        s_qt, s_qh = H * K, K
    v, s_vt, s_vh = token_strides(v)
    g, beta = g.contiguous(), beta.contiguous()
    dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32

    # stage 1: chunk-local terms, head-major so each chunk's tiles are contiguous
    w = torch.empty(H, NT * BT, K, dtype=dt, device=q.device)
    qg, kg = torch.empty_like(w), torch.empty_like(w)
    u = torch.empty(H, NT * BT, V, dtype=dt, device=q.device)
    Aqk = torch.empty(H, NT * BT, BT, dtype=dt, device=q.device)
    gl = torch.empty(max(NT, 1), H, K, dtype=torch.float32, device=q.device)
    mode = CONFIG["intra"]
    if mode not in INTRA_MODES:
        raise ValueError(f"VOLUNDR_KDA_INTRA / CONFIG['intra'] must be one of {INTRA_MODES}, "
                         f"got {mode!r}")
    if NT > 0 and mode in ("sub", "split"):
        # fp32 scratch, one chunk's worth per program: G, M = (I + Akk)^-1 (split: first the
        # X_i = (I + L_ii)^-1 on the diagonal blocks and Akk left of them), row norms of q, k
        Gs = torch.empty(H, NT * BT, K, dtype=torch.float32, device=q.device)
        Ms = torch.empty(H, NT * BT, BT, dtype=torch.float32, device=q.device)
        rn = torch.empty(H, NT * BT, 2, dtype=torch.float32, device=q.device)
        # the same memory as Ms, 16-bit: M for phase 3's 16-bit dots (split_M16)
        m16 = (mode == "split" and CONFIG["split_M16"] and CONFIG["split_inv_apart"]
               and dt != torch.float32)
        Mh = Ms.view(dt) if m16 else Ms
    if NT > 0 and mode == "sub":
        # sub_split: phases 0-2 and phase 3 as two launches (each its own register budget)
        for phases in ((3, 4) if CONFIG["sub_split"] else (7,)):
            _chunk_kda_intra_sub_kernel[(NT, H)](
                q, k, v, g, beta, A_log, dt_bias, w, u, qg, kg, Aqk, gl, Gs, Ms, Mh, rn,
                cu_seqlens, chunk_idx, scale, TT, NT, s_qt, s_qh, s_vt, s_vh,
                H=H, K=K, V=V, BT=BT, BK=min(CONFIG["sub_BK"], K),
                BK1=min(CONFIG["sub_BK1"], K), BV=min(CONFIG["sub_BV"], V),
                L2NORM=use_qk_l2norm_in_kernel, USE_GATE=use_gate_in_kernel,
                HAS_DT_BIAS=dt_bias is not None, BETA_SIGMOID=use_beta_sigmoid_in_kernel,
                PHASES=phases, num_warps=CONFIG["sub_warps"], num_stages=1,
                **({"maxnreg": nreg} if (nreg := CONFIG["sub_maxnreg_wu" if phases == 4 else
                                                        "sub_maxnreg"]) else {}))
    elif NT > 0 and mode == "split":
        # phase 0 of the sub kernel (G, norms), the block-row kernel, the block inverse (M into
        # Ms; or inside phase 3), the sub kernel's phase 3
        flags = dict(USE_GATE=use_gate_in_kernel, HAS_DT_BIAS=dt_bias is not None,
                     BETA_SIGMOID=use_beta_sigmoid_in_kernel)
        sub = dict(H=H, K=K, V=V, BT=BT, BK=min(CONFIG["split_BK"], K),
                   BK1=min(CONFIG["sub_BK1"], K), BV=min(CONFIG["split_BV"], V),
                   L2NORM=use_qk_l2norm_in_kernel, INV_PREC=CONFIG["split_inv_prec"], M16=m16,
                   **flags)
        args = (q, k, v, g, beta, A_log, dt_bias, w, u, qg, kg, Aqk, gl, Gs, Ms, Mh, rn,
                cu_seqlens, chunk_idx, scale, TT, NT, s_qt, s_qh, s_vt, s_vh)
        _chunk_kda_intra_sub_kernel[(NT, H)](*args, PHASES=1, num_warps=CONFIG["split_warps_0"],
                                             num_stages=1, **sub)
        a_args = (q, k, beta, Aqk, Gs, Ms, rn, cu_seqlens, chunk_idx, scale, TT, NT, s_qt, s_qh)
        elem = CONFIG["split_diag"] == "elem"
        if CONFIG["split_diag"] not in ("levels", "elem"):
            raise ValueError(f"CONFIG['split_diag'] must be 'levels' or 'elem', "
                             f"got {CONFIG['split_diag']!r}")
        if elem:
            _kda_intra_diag_kernel[(NT * (BT // 16), H)](
                *a_args, H=H, K=K, BT=BT, BETA_SIGMOID=use_beta_sigmoid_in_kernel,
                UNROLL=CONFIG["split_unroll_d"], num_warps=CONFIG["split_warps_d"],
                num_stages=1)
        _kda_intra_a_kernel[(NT * (BT // 16), H)](
            *a_args, H=H, K=K, BT=BT, BK=min(CONFIG["split_BK_a"], K),
            BETA_SIGMOID=use_beta_sigmoid_in_kernel, DIAG=not elem,
            num_warps=CONFIG["split_warps_a"], num_stages=1)
        nreg = CONFIG["split_maxnreg"]
        if CONFIG["split_inv_apart"]:
            _chunk_kda_intra_sub_kernel[(NT, H)](*args, PHASES=8,
                                                 num_warps=CONFIG["split_warps_inv"],
                                                 num_stages=1, **sub)
        _chunk_kda_intra_sub_kernel[(NT, H)](*args, PHASES=4,
                                             BLOCK_INV=not CONFIG["split_inv_apart"],
                                             num_warps=CONFIG["split_warps"],
                                             num_stages=CONFIG["split_stages"],
                                             **sub,
                                             **({"maxnreg": nreg} if nreg else {}))
    elif NT > 0:
        _chunk_kda_intra_kernel[(NT, H)](
            q, k, v, g, beta, A_log, dt_bias, w, u, qg, kg, Aqk, gl, cu_seqlens, chunk_idx,
            scale, TT, NT, s_qt, s_qh, s_vt, s_vh,
            H=H, K=K, V=V, BT=BT, BK=min(CONFIG["intra_BK"], K), BV=min(64, V),
            LOG_BT=BT.bit_length() - 1, L2NORM=use_qk_l2norm_in_kernel,
            USE_GATE=use_gate_in_kernel, HAS_DT_BIAS=dt_bias is not None,
            BETA_SIGMOID=use_beta_sigmoid_in_kernel,
            num_warps=4 if BT <= 32 else CONFIG["intra_warps"], num_stages=1)

    # stage 2: the recurrence over chunks, with the output
    o = v.new_empty(B, T, H, V)
    if inplace_final_state:
        ht = initial_state
    elif output_final_state:
        ht = q.new_empty(N, H, K, V, dtype=torch.float32)
    else:
        ht = None
    hc = q.new_empty(NT, H, K, V, dtype=torch.float32) if return_chunk_states else None
    BV = CONFIG["fwd_BV"] or next((bv for bv in (64, 32) if N * H * triton.cdiv(V, bv) >= 64), 16)
    BV = min(BV, V)
    _chunk_kda_fwd_kernel[(triton.cdiv(V, BV), N * H)](
        w, u, qg, kg, Aqk, gl, o, initial_state, ht, hc, cu_seqlens, chunk_offsets,
        ssm_state_indices, NT,
        H=H, K=K, V=V, BT=BT, BK=K, BV=BV,
        USE_H0=initial_state is not None, STORE_HT=ht is not None, STORE_HC=hc is not None,
        USE_IDX=ssm_state_indices is not None, INPLACE=inplace_final_state,
        NUM_STAGES=CONFIG["fwd_stages"], num_warps=CONFIG["fwd_warps"])
    final = ht if (output_final_state or inplace_final_state) else None
    if return_chunk_states:
        return o, final, hc
    return o, final
