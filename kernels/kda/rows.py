"""A speculative check's KDA layer in one launch, and its commit in one more: kernels/kda/decode.py
for the few rows a sequence that a check holds (backend/check_layout.py).

A check runs up to L tokens of each of n sequences with the recurrent states read, not written;
the commit then advances the states over the tokens each sequence keeps. Unfused, a check's KDA
layer takes three launches after f_b / g_b's GEMV (the conv, the recurrence, the gated output
norm) and its commit two (conv, recurrence): 54 layers x 5 launches a Volundr-32B step, each
a few microseconds of a graph that is mostly launch-bound at these sizes.

Here one program per (sequence, head) owns the head's whole [K, V] state and all 2K + V conv
channels of the head, and walks the sequence's rows (at most L): conv + SiLU from the carried
tail (the window slides in registers), the KDA step, and
* check (update False): the gated output norm, o = RMSNorm_V(o') nw sigmoid(z) (o' the step's
  output rounded to o's dtype, the normed value rounded again before the gate: the unfused
  kernels' roundings), complete, because the program holds all V channels of the head; the
  state and the tail stay as they were;
* commit (update True): the final state and the new tail written back (one writer per channel:
  no arrival counters, unlike decode.py); no output.
The price is n H programs (40 at batch 1) instead of the recurrent kernel's n H V / BV, each
reading its 64 KiB of state once; the rows' arithmetic is small next to that.

The layout is check_layout's: cu [2n + 1] (sequence i's rows cu[2i]:cu[2i + 1], then its gap up
to cu[2i + 2]), slot_ids [2n] = (slot, -1) per sequence; a negative slot is a padding sequence.
A check writes zeros to its gap rows and to a padding sequence's rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.kda.decode import _load_tail
from volundr.kernels.kda.fused_recurrent import kda_update
from volundr.kernels.kda.utils import softplus


@triton.jit
def _load_w(cw, ch, m, W: tl.constexpr):
    """Conv taps of channels ch [B]: cw[ch, j] for j = 0, 1, 2 (0 where j >= W - 1) and the
    newest tap cw[ch, W - 1], fp32 (decode.py's `_load_new` without the input)."""
    w0 = tl.load(cw + ch * W, mask=m & (W > 1), other=0.0).to(tl.float32)
    w1 = tl.load(cw + ch * W + 1, mask=m & (W > 2), other=0.0).to(tl.float32)
    w2 = tl.load(cw + ch * W + 2, mask=m & (W > 3), other=0.0).to(tl.float32)
    wn = tl.load(cw + ch * W + (W - 1), mask=m, other=0.0).to(tl.float32)
    return w0, w1, w2, wn


@triton.jit
def _conv_row(xt, ch, m, w0, w1, w2, wn, t0, t1, t2, W: tl.constexpr, dtype: tl.constexpr):
    """One row's conv + SiLU at channels ch (rounded to `dtype` as the unfused conv hands it
    over) and the window slid by one: returns (y, t0, t1, t2)."""
    b_x = tl.load(xt + ch, mask=m, other=0.0).to(tl.float32)
    acc = t0 * w0 + t1 * w1 + t2 * w2 + b_x * wn
    y = (acc * tl.sigmoid(acc)).to(dtype).to(tl.float32)
    if W == 4:
        t0, t1, t2 = t1, t2, b_x
    elif W == 3:
        t0, t1 = t1, b_x
    else:
        t0 = b_x
    return y, t0, t1, t2


@triton.jit
def _store_window(st, ch, m, t0, t1, t2, W: tl.constexpr):
    """The carried tail st[ch, :W - 1] <- the window (oldest first)."""
    p = st + ch * (W - 1)
    ty = st.dtype.element_ty
    tl.store(p, t0.to(ty), mask=m)
    if W > 2:
        tl.store(p + 1, t1.to(ty), mask=m)
    if W > 3:
        tl.store(p + 2, t2.to(ty), mask=m)


@triton.jit(do_not_specialize=["eps"])
def _kda_rows_kernel(
    x, cw, cs, g, beta, o, h, cu, slot_ids, A_log, dt_bias, nw, z, scale, eps,
    s_xt, s_gt, s_gh, s_bt, s_bh, s_zt,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, HAS_DT_BIAS: tl.constexpr, UPDATE: tl.constexpr,
):
    """x [T, C] raw q|k|v (row stride s_xt), C = 2HK + HV; cw [C, W]; cs [slots, C, W - 1];
    g [T, H, K] gate logits, beta [T, H] logits (strides s_g*, s_b*); h [slots, H, K, V] fp32;
    cu [2n + 1] int32, slot_ids [2n]; check: nw [V] the output norm's weight, z [T, H, V] the
    output gate logits (token stride s_zt, heads V apart), o [T, H, V]. Grid (n H,)."""
    pdl.trigger()  # a PDL-launched successor may start
    C: tl.constexpr = 2 * H * K + H * V
    i_n, i_h = tl.program_id(0) // H, tl.program_id(0) % H
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    c_q = i_h * K + o_k
    c_k = H * K + c_q
    c_v = 2 * H * K + i_h * V + o_v
    # weights (never written by a kernel) before the PDL wait
    w0_q, w1_q, w2_q, wn_q = _load_w(cw, c_q, m_k, W)
    w0_k, w1_k, w2_k, wn_k = _load_w(cw, c_k, m_k, W)
    w0_v, w1_v, w2_v, wn_v = _load_w(cw, c_v, m_v, W)
    b_a = tl.load(A_log + i_h).to(tl.float32)
    b_dt = tl.zeros([BK], dtype=tl.float32)
    if HAS_DT_BIAS:
        b_dt = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    if not UPDATE:
        b_nw = tl.load(nw + o_v, mask=m_v, other=0.0).to(tl.float32)
    pdl.wait()  # PDL: inputs come from the kernel before
    bos = tl.load(cu + 2 * i_n).to(tl.int64)
    eos = tl.load(cu + 2 * i_n + 1).to(tl.int64)
    slot = tl.load(slot_ids + 2 * i_n).to(tl.int64)
    eos = tl.where(slot < 0, bos, eos)  # a padding sequence: no rows
    slot = tl.maximum(slot, 0)
    dt: tl.constexpr = x.dtype.element_ty
    if not UPDATE:  # zeros in the rows no state reaches: the gap (and a padding sequence)
        end = tl.load(cu + 2 * i_n + 2).to(tl.int64)
        for t in range(eos, end):
            tl.store(o + (t * H + i_h) * V + o_v, tl.zeros([BV], dtype=o.dtype.element_ty),
                     mask=m_v)
    if eos > bos:
        p_h = h + (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(p_h, mask=m_h, other=0.0).to(tl.float32)
        st = cs + slot * C * (W - 1)
        t0_q, t1_q, t2_q = _load_tail(st, c_q, m_k, W)
        t0_k, t1_k, t2_k = _load_tail(st, c_k, m_k, W)
        t0_v, t1_v, t2_v = _load_tail(st, c_v, m_v, W)
        for t in range(bos, eos):
            xt = x + t * s_xt
            b_q, t0_q, t1_q, t2_q = _conv_row(xt, c_q, m_k, w0_q, w1_q, w2_q, wn_q,
                                              t0_q, t1_q, t2_q, W, dt)
            b_k, t0_k, t1_k, t2_k = _conv_row(xt, c_k, m_k, w0_k, w1_k, w2_k, wn_k,
                                              t0_k, t1_k, t2_k, W, dt)
            b_v, t0_v, t1_v, t2_v = _conv_row(xt, c_v, m_v, w0_v, w1_v, w2_v, wn_v,
                                              t0_v, t1_v, t2_v, W, dt)
            b_g = tl.load(g + t * s_gt + i_h * s_gh + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_g = -tl.exp(b_a) * softplus(b_g + b_dt)  # the gate (kda_gate_act)
            b_b = tl.load(beta + t * s_bt + i_h * s_bh).to(tl.float32)
            b_h, b_o = kda_update(b_h, b_q, b_k, b_v, b_g, b_b, A_log, dt_bias, i_h, o_k, m_k,
                                  scale, K, True, False, False, True)
            if not UPDATE:
                b_o = tl.where(m_v, b_o.to(o.dtype.element_ty).to(tl.float32), 0.0)
                rstd = tl.rsqrt(tl.sum(b_o * b_o, axis=0) / V + eps)
                y = (b_o * rstd * b_nw).to(o.dtype.element_ty).to(tl.float32)
                b_z = tl.load(z + t * s_zt + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
                tl.store(o + (t * H + i_h) * V + o_v, (y * tl.sigmoid(b_z)).to(o.dtype.element_ty),
                         mask=m_v)
        if UPDATE:
            tl.store(p_h, b_h.to(h.dtype.element_ty), mask=m_h)
            _store_window(st, c_q, m_k, t0_q, t1_q, t2_q, W)
            _store_window(st, c_k, m_k, t0_k, t1_k, t2_k, W)
            _store_window(st, c_v, m_v, t0_v, t1_v, t2_v, W)


# num_warps: the program's [K, V] fp32 state is 64 KiB at K = V = 128, 64 registers a thread
# at 8 warps. Not yet timed on a GPU.
CONFIG = {"num_warps": 8}


def kda_rows(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
             cu_seqlens: torch.Tensor, scale: float, A_log: torch.Tensor,
             dt_bias: torch.Tensor | None = None, gated: tuple | None = None, eps: float = 1e-6,
             num_warps: int | None = None) -> torch.Tensor | None:
    """A check's KDA layer (gated given: states read only) or its commit (gated None: states
    advanced over each sequence's rows, nothing returned), in one launch (module doc).

    qkv [T, 3HK] raw q|k|v projections (unit column stride, any row stride), channels as in
    decode.py's `kda_decode`; conv_weight [C, W] (2 <= W <= 4); conv_state [slots, C, W - 1];
    g [T, H, K] gate logits (g = -exp(A_log[h]) softplus(g + dt_bias)), beta [T, H] logits, any
    token / head strides; state [slots, H, K, V] fp32 contiguous; cu_seqlens [2n + 1] int32 and
    slot_ids [2n], check_layout's (each sequence followed by its gap; slot -1 in the gap, or
    for a padding sequence). gated = (z [T, H, V] output gate logits, heads V apart and unit
    channel stride, norm weight [V]): returns o [T, H, V] in qkv.dtype,
    RMSNorm_V(KDA(conv(qkv))) w sigmoid(z) per head (ops.rms_norm_gated of the unfused path);
    rows of gaps and padding sequences are zeros."""
    T, C = qkv.shape
    _, H, K, V = state.shape
    W = conv_weight.shape[-1]
    if C != 2 * H * K + H * V or conv_weight.shape[0] != C or conv_state.shape[1:] != (C, W - 1):
        raise ValueError(f"qkv {tuple(qkv.shape)}, conv weight {tuple(conv_weight.shape)} and "
                         f"state {tuple(conv_state.shape)} do not fit H={H}, K={K}, V={V}")
    if not 2 <= W <= 4:
        raise ValueError(f"kda_rows takes convs of width 2 to 4, not {W}")
    if state.dtype != torch.float32 or not state.is_contiguous() or not conv_state.is_contiguous():
        raise ValueError("state must be a contiguous fp32 pool, conv_state contiguous")
    n2 = slot_ids.shape[0]
    if n2 % 2 or cu_seqlens.shape[0] != n2 + 1:
        raise ValueError("cu_seqlens [2n + 1] and slot_ids [2n]: each sequence, then its gap")
    if g.shape != (T, H, K) or beta.shape != (T, H):
        raise ValueError(f"g [T, H, K] and beta [T, H] for T = {T}, H = {H}, K = {K}")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if g.stride(-1) != 1:
        g = g.contiguous()
    o, z, nw, s_zt = None, None, None, 0
    if gated is not None:
        z, nw = gated
        if z.shape != (T, H, V) or z.stride(2) != 1 or z.stride(1) != V or nw.numel() != V:
            raise ValueError("gated: z [T, H, V] with heads V apart, unit channel stride; "
                             "norm weight [V]")
        o, s_zt, nw = qkv.new_empty(T, H, V), z.stride(0), nw.contiguous()
    if n2 == 0:
        return o
    _kda_rows_kernel[(n2 // 2 * H,)](
        qkv, conv_weight.contiguous(), conv_state, g, beta, o, state, cu_seqlens, slot_ids,
        A_log, dt_bias, nw, z, scale, eps,
        qkv.stride(0), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), s_zt,
        H=H, K=K, V=V, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V), W=W,
        HAS_DT_BIAS=dt_bias is not None, UPDATE=gated is None,
        num_warps=num_warps or CONFIG["num_warps"], launch_pdl=pdl.ON.value)
    return o
