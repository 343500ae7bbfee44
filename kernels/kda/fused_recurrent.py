"""Token-by-token KDA in one Triton kernel: the decode and speculative-verify path.

One program owns a [K, BV] slice of one head's state of one sequence and walks that sequence's
tokens (1..k at decode), so the state is read once and written once per step. With a single
token, 40 heads and BV = 16 that is 320 programs that read the 2.5 MiB of state in parallel.
The L2 norm of q and k, the gate activation, the decay, the delta update and the output are all
fused into that one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.kda.utils import kda_gate_act, token_strides


@triton.jit
def kda_update(b_h, b_q, b_k, b_v, b_g, b_b, A_log, dt_bias, i_h, o_k, m_k, scale,
               K: tl.constexpr, L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
               HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """One token on a [BK, BV] state tile, inputs in fp32: q, k [BK], v [BV], g [BK] (log decay,
    or raw logits with USE_GATE), beta scalar (a logit with BETA_SIGMOID).
    S = diag(exp(g)) S;  u = beta (v - S^T k);  S += k u^T;  o = S^T (scale q).
    Returns (S, o [BV] in fp32)."""
    if L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    if USE_GATE:
        b_g = kda_gate_act(b_g, A_log, dt_bias, i_h, o_k, m_k, K, HAS_DT_BIAS)
    if BETA_SIGMOID:
        b_b = tl.sigmoid(b_b)
    b_h = b_h * tl.exp(b_g)[:, None]
    b_u = b_b * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
    b_h += b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
    return b_h, b_o


@triton.jit
def _step(b_h, q, k, v, g, beta, o, hs, A_log, dt_bias, t, i_h, o_k, o_v, m_k, m_v, m_h, off_h,
          scale, s_qt, s_qh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, H: tl.constexpr,
          K: tl.constexpr, V: tl.constexpr, STORE_HS: tl.constexpr, L2NORM: tl.constexpr,
          USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """Token t: load its inputs, `kda_update`, store o (and the state after it with STORE_HS)."""
    b_q = tl.load(q + t * s_qt + i_h * s_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + t * s_qt + i_h * s_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + t * s_vt + i_h * s_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_g = tl.load(g + t * s_gt + i_h * s_gh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_b = tl.load(beta + t * s_bt + i_h * s_bh).to(tl.float32)
    b_h, b_o = kda_update(b_h, b_q, b_k, b_v, b_g, b_b, A_log, dt_bias, i_h, o_k, m_k, scale, K,
                          L2NORM, USE_GATE, HAS_DT_BIAS, BETA_SIGMOID)
    tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HS:
        tl.store(hs + (t * H + i_h) * K * V + off_h, b_h.to(hs.dtype.element_ty), mask=m_h)
    return b_h


@triton.jit(do_not_specialize=["T"])
def _fused_recurrent_kda_kernel(
    q, k, v, g, beta, o, h0, ht, hs, cu_seqlens, state_idx, A_log, dt_bias,
    scale, T, s_qt, s_qh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_HS: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_IDX: tl.constexpr, INPLACE: tl.constexpr,
    L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, ONE_TOKEN: tl.constexpr,
):
    pdl.trigger()  # a PDL-launched successor may start
    pdl.wait()  # PDL: inputs come from the kernel before
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if USE_IDX:
        slot = tl.load(state_idx + i_n).to(tl.int64)
    else:
        slot = i_n.to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    off_h = o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        # a negative slot is a padding entry (e.g. a CUDA-graph batch larger than the live one)
        m_s = m_h & (slot >= 0)
        b_h += tl.load(h0 + (slot * H + i_h) * K * V + off_h, mask=m_s, other=0.0).to(tl.float32)
    if ONE_TOKEN:
        # decode: token n of sequence n; straight-line code, so that every load is in flight at
        # once (no dependency on cu_seqlens)
        b_h = _step(b_h, q, k, v, g, beta, o, hs, A_log, dt_bias, i_n.to(tl.int64), i_h, o_k, o_v,
                    m_k, m_v, m_h, off_h, scale, s_qt, s_qh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh,
                    H, K, V, STORE_HS, L2NORM, USE_GATE, HAS_DT_BIAS, BETA_SIGMOID)
    else:
        if IS_VARLEN:
            bos = tl.load(cu_seqlens + i_n).to(tl.int64)
            eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        else:
            bos = i_n.to(tl.int64) * T
            eos = bos + T
        for t in range(bos, eos):
            b_h = _step(b_h, q, k, v, g, beta, o, hs, A_log, dt_bias, t, i_h, o_k, o_v, m_k, m_v,
                        m_h, off_h, scale, s_qt, s_qh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, H, K,
                        V, STORE_HS, L2NORM, USE_GATE, HAS_DT_BIAS, BETA_SIGMOID)

    if STORE_HT:
        if INPLACE:
            p_ht = ht + (slot * H + i_h) * K * V + off_h
            tl.store(p_ht, b_h.to(ht.dtype.element_ty), mask=m_h & (slot >= 0))
        else:
            p_ht = ht + (i_n.to(tl.int64) * H + i_h) * K * V + off_h
            tl.store(p_ht, b_h.to(ht.dtype.element_ty), mask=m_h)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    inplace_final_state: bool | None = None,
    return_intermediate_states: bool = False,
    one_token_per_seq: bool = False,
    out: torch.Tensor | None = None,
    BV: int | None = None,
    num_warps: int | None = None,
    **kwargs,
):
    """KDA token by token (fla's `fused_recurrent_kda` for the subset Volundr needs).

    q, k: [B, T, H, K] (any token/head strides, last dim contiguous); v: [B, T, H, V];
    g: [B, T, H, K] log decay, or the raw gate logits with `use_gate_in_kernel` (then
    g = -exp(A_log[h]) * softplus(g + dt_bias[h * K + k]), A_log [H], dt_bias [H * K]);
    beta: [B, T, H] (logits with `use_beta_sigmoid_in_kernel`); g and beta with any token and head
    strides (g's last dim contiguous; with B > 1, batches T tokens apart); cu_seqlens [N + 1]
    with B == 1.
    initial_state: [N, H, K, V], or with `ssm_state_indices` [N] a pool [slots, H, K, V] whose
    row ssm_state_indices[n] is sequence n's state (negative index: skip that sequence).
    With indices the final state is written back into the pool in place (inplace_final_state
    defaults to True then); otherwise `output_final_state` returns a new [N, H, K, V] fp32.
    `return_intermediate_states`: also the state after every token, [B * T, H, K, V] fp32
    (speculative verification keeps the state of the last accepted token).
    `one_token_per_seq`: the caller knows every sequence has exactly one token (decode): the
    kernel skips cu_seqlens (faster). Only valid when T == N tokens in total.
    Returns (o [B, T, H, V] in v.dtype, final state or None[, intermediate states]).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if inplace_final_state is None:
        inplace_final_state = ssm_state_indices is not None
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state needs initial_state")
    if initial_state is not None and ssm_state_indices is None and initial_state.shape[0] != N:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states for {N} sequences")
    q, s_qt, s_qh = token_strides(q)
    k, s_kt, s_kh = token_strides(k)
    if (s_kt, s_kh) != (s_qt, s_qh):
        q, k = q.contiguous(), k.contiguous()
        s_qt, s_qh = H * K, K
    v, s_vt, s_vh = token_strides(v)
    # any token stride: beta is a column slice of a wider projection output in the engine
    g, s_gt, s_gh = token_strides(g)
    beta, s_bt, s_bh = token_strides(beta)
    o = out if out is not None else v.new_empty(B, T, H, V)
    if inplace_final_state:
        ht = initial_state
    elif output_final_state:
        ht = q.new_empty(N, H, K, V, dtype=torch.float32)
    else:
        ht = None
    hs = q.new_empty(B * T, H, K, V, dtype=torch.float32) if return_intermediate_states else None
    BK = triton.next_power_of_2(K)
    if BV is None:
        # enough programs to read the state with many SMs at small batch, fewer at large batch
        BV = 16 if N * H < 512 else 32
    BV = min(BV, triton.next_power_of_2(V))
    grid = (triton.cdiv(V, BV), N * H)
    _fused_recurrent_kda_kernel[grid](
        q, k, v, g, beta, o, initial_state, ht, hs, cu_seqlens, ssm_state_indices, A_log, dt_bias,
        scale, T, s_qt, s_qh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh,
        H=H, K=K, V=V, BK=BK, BV=BV,
        USE_H0=initial_state is not None, STORE_HT=ht is not None, STORE_HS=hs is not None,
        IS_VARLEN=cu_seqlens is not None, USE_IDX=ssm_state_indices is not None,
        INPLACE=inplace_final_state, L2NORM=use_qk_l2norm_in_kernel, USE_GATE=use_gate_in_kernel,
        HAS_DT_BIAS=dt_bias is not None, BETA_SIGMOID=use_beta_sigmoid_in_kernel,
        ONE_TOKEN=one_token_per_seq or (T == 1 and cu_seqlens is None),
        num_warps=num_warps or (2 if BV <= 16 else 4),
        launch_pdl=pdl.ON.value,
    )
    final = ht if (output_final_state or inplace_final_state) else None
    if return_intermediate_states:
        return o, final, hs
    return o, final
