"""A speculative check's conv + KDA in one launch, and its commit in one more: kernels/kda/decode.py
for the few rows a sequence that a check holds (backend/check_layout.py).

A check runs up to L tokens of each of n sequences with the recurrent states read, not written;
the commit then advances the states over the tokens each sequence keeps. Unfused, each takes two
launches a KDA layer (the conv, then the recurrence reading its output back): 54 x 2 launches of
a Volundr-32B speculative step that these two kernels' 54 x 1 replace.

Grid (NV = V / BV, n H), as decode.py: program (i_v, n, h) owns the [K, BV] slice of the head's
state and walks the sequence's rows (at most L), computing each row's conv + SiLU of all K q and
k channels of the head (their L2 norms and dot products run over K; NV programs recompute them)
and of its BV v channels from the carried tail, the window sliding in registers.
* check (update False): o [T, H, V] as the recurrence returns it; state and tails stay as they
  were, so no program writes anything another reads. Zeros in the gap rows and in a padding
  sequence's rows.
* commit (update True): the final state slice, the v tail by its only reader, and the q/k tail
  by the last of the head's NV programs to finish reading it (decode.py's arrival counters,
  keyed by (sequence, head), left at zero for the next launch); no output.
H100 (run 136, one layer graph-replayed, against the conv + recurrent kernels): 1 sequence x 3
rows, check 17.7 -> 11.0 us and commit 16.9 -> 10.7 us; 16 x 3, 74.8 -> 44.2 and 80.5 -> 46.2 us.
A first form, one program per (sequence, head) holding the whole [K, V] state (so that the
gated output norm over V could be done in it), made the check graph 7.76 -> 9.21 ms a step at
Volundr-32B (H100, k = 2): 40 programs read the state too slowly; the split over V is kept.

The layout is check_layout's: cu [2n + 1] (sequence i's rows cu[2i]:cu[2i + 1], then its gap up
to cu[2i + 2]), slot_ids [2n] = (slot, -1) per sequence; a negative slot is a padding sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.kda.decode import _counters, _load_tail, _load_w, gated_kwargs
from volundr.kernels.kda.fused_recurrent import kda_update
from volundr.kernels.kda.utils import softplus


@triton.jit
def _row_inputs(x, g, beta, t, live, c_q, c_k, c_v, m_k, m_v, i_h, o_k, s_xt, s_gt, s_gh, s_bt,
                s_bh):
    """Row t's raw q, k, v inputs, gate logits and beta logit, fp32 (zeros where not live)."""
    xt = x + t * s_xt
    b_q = tl.load(xt + c_q, mask=m_k & live, other=0.0).to(tl.float32)
    b_k = tl.load(xt + c_k, mask=m_k & live, other=0.0).to(tl.float32)
    b_v = tl.load(xt + c_v, mask=m_v & live, other=0.0).to(tl.float32)
    b_g = tl.load(g + t * s_gt + i_h * s_gh + o_k, mask=m_k & live, other=0.0).to(tl.float32)
    b_b = tl.load(beta + t * s_bt + i_h * s_bh, mask=live, other=0.0).to(tl.float32)
    return b_q, b_k, b_v, b_g, b_b


@triton.jit
def _conv_row(b_x, w0, w1, w2, wn, t0, t1, t2, W: tl.constexpr, dtype: tl.constexpr):
    """One row's conv + SiLU of inputs b_x (rounded to `dtype` as the unfused conv hands it
    over) and the window slid by one: returns (y, t0, t1, t2)."""
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


@triton.jit
def _kda_rows_kernel(
    x, cw, cs, g, beta, o, h, cu, slot_ids, cnt, A_log, dt_bias, scale,
    s_xt, s_gt, s_gh, s_bt, s_bh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, HAS_DT_BIAS: tl.constexpr, UPDATE: tl.constexpr,
    z=None, nw=None, ss=None, s_zt=0, GATED: tl.constexpr = False,
):
    """x [T, C] raw q|k|v (row stride s_xt), C = 2HK + HV; cw [C, W]; cs [slots, C, W - 1];
    g [T, H, K] gate logits, beta [T, H] logits (strides s_g*, s_b*); h [slots, H, K, V] fp32;
    cu [2n + 1] int32, slot_ids [2n]; o [T, H, V] (check); cnt [>= n H] int32 zeros (commit).
    Grid (cdiv(V, BV), n H). GATED (check): as kda_decode's, o = o' nw sigmoid(z) and
    ss [T, H, NV] each program's sum of o'^2 (o' = o rounded; zeros in gap rows)."""
    pdl.trigger()  # a PDL-launched successor may start
    NV: tl.constexpr = (V + BV - 1) // BV
    C: tl.constexpr = 2 * H * K + H * V
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
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
    b_nw = tl.zeros([BV], dtype=tl.float32)
    if GATED:
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
            if GATED:
                tl.store(ss + (t * H + i_h) * NV + i_v, 0.0)
    if eos > bos:
        p_h = h + (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(p_h, mask=m_h, other=0.0).to(tl.float32)
        st = cs + slot * C * (W - 1)
        t0_q, t1_q, t2_q = _load_tail(st, c_q, m_k, W)
        t0_k, t1_k, t2_k = _load_tail(st, c_k, m_k, W)
        t0_v, t1_v, t2_v = _load_tail(st, c_v, m_v, W)
        # each row's inputs are loaded while the row before is computed (they do not depend
        # on the state): one load latency a launch instead of one a row
        n_q, n_k, n_v, n_g, n_b = _row_inputs(x, g, beta, bos, bos < eos, c_q, c_k, c_v, m_k,
                                              m_v, i_h, o_k, s_xt, s_gt, s_gh, s_bt, s_bh)
        for t in range(bos, eos):
            x_q, x_k, x_v, b_g, b_b = n_q, n_k, n_v, n_g, n_b
            if GATED and not UPDATE:  # this row's output gate, on its way during the row
                b_z = tl.load(z + t * s_zt + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            n_q, n_k, n_v, n_g, n_b = _row_inputs(x, g, beta, t + 1, t + 1 < eos, c_q, c_k, c_v,
                                                  m_k, m_v, i_h, o_k, s_xt, s_gt, s_gh, s_bt,
                                                  s_bh)
            b_q, t0_q, t1_q, t2_q = _conv_row(x_q, w0_q, w1_q, w2_q, wn_q, t0_q, t1_q, t2_q, W,
                                              dt)
            b_k, t0_k, t1_k, t2_k = _conv_row(x_k, w0_k, w1_k, w2_k, wn_k, t0_k, t1_k, t2_k, W,
                                              dt)
            b_v, t0_v, t1_v, t2_v = _conv_row(x_v, w0_v, w1_v, w2_v, wn_v, t0_v, t1_v, t2_v, W,
                                              dt)
            b_g = -tl.exp(b_a) * softplus(b_g + b_dt)  # the gate (kda_gate_act)
            b_h, b_o = kda_update(b_h, b_q, b_k, b_v, b_g, b_b, A_log, dt_bias, i_h, o_k, m_k,
                                  scale, K, True, False, False, True)
            if not UPDATE:
                if GATED:  # the norm reads the rounded o (kda_decode's GATED)
                    b_o = b_o.to(o.dtype.element_ty).to(tl.float32)
                    tl.store(ss + (t * H + i_h) * NV + i_v,
                             tl.sum(tl.where(m_v, b_o * b_o, 0.0), axis=0))
                    b_o = b_o * b_nw * tl.sigmoid(b_z)
                tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if UPDATE:
            # every thread of this program has read the old tails before any is overwritten;
            # then the q/k reads of this program counted (release; decode.py's protocol)
            tl.debug_barrier()
            done = tl.atomic_add(cnt + i_nh, 1, sem="acq_rel")
            _store_window(st, c_v, m_v, t0_v, t1_v, t2_v, W)  # this program's own channels
            tl.store(p_h, b_h.to(h.dtype.element_ty), mask=m_h)
            if done == NV - 1:
                _store_window(st, c_q, m_k, t0_q, t1_q, t2_q, W)
                _store_window(st, c_k, m_k, t0_k, t1_k, t2_k, W)
                tl.atomic_xchg(cnt + i_nh, 0, sem="relaxed")  # ready for the next launch


# Launch settings (perf/kernels/bench_kda.py --rows): BV 32 with 2 warps the best or within 2%
# of it at 1 x 2-4 and 4 / 16 x 3 rows (H100 run 136; BV 16 / 64, 1 / 4 warps timed).
CONFIG = {"BV": 32, "num_warps": 2}


def kda_rows(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
             cu_seqlens: torch.Tensor, scale: float, A_log: torch.Tensor,
             dt_bias: torch.Tensor | None = None, update: bool = False, BV: int | None = None,
             num_warps: int | None = None, gated: tuple | None = None):
    """A check's conv + KDA (update False: states read only; returns o) or its commit (update
    True: the states advanced over each sequence's rows; returns None), in one launch (module
    doc): what `conv.causal_conv1d` (+ SiLU) then `fused_recurrent_kda` compute there.

    qkv [T, 3HK] raw q|k|v projections (unit column stride, any row stride), channels as in
    decode.py's `kda_decode`; conv_weight [C, W] (2 <= W <= 4); conv_state [slots, C, W - 1];
    g [T, H, K] gate logits (g = -exp(A_log[h]) softplus(g + dt_bias)), beta [T, H] logits, any
    token / head strides (last dims contiguous); state [slots, H, K, V] fp32 contiguous;
    cu_seqlens [2n + 1] int32 and slot_ids [2n], check_layout's (each sequence followed by its
    gap; slot -1 in the gap, or for a padding sequence). Returns o [T, H, V] in qkv.dtype
    (zeros in gap and padding rows). Commits that may overlap must run on one stream.
    gated = (z [T, H, V] output gate logits (heads V apart, unit channel stride), norm weight
    [V]), check only: returns (o w sigmoid(z), ss [T, H, cdiv(V, BV)] fp32 partial sums of o^2),
    as kda_decode's `gated`: KDA's gated output norm with its per-head scale left to o_proj."""
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
    o = None if update else qkv.new_empty(T, H, V)
    BV = min(BV or CONFIG["BV"], triton.next_power_of_2(V))
    gkw, ss = {}, None
    if gated is not None:
        if update:
            raise ValueError("gated: a check's output norm (a commit has no output)")
        gkw, ss = gated_kwargs(gated, T, H, V, triton.cdiv(V, BV), qkv.device)
    if n2 == 0:
        return o if ss is None else (o, ss)
    cnt = _counters(qkv.device, n2 // 2 * H)
    _kda_rows_kernel[(triton.cdiv(V, BV), n2 // 2 * H)](
        qkv, conv_weight.contiguous(), conv_state, g, beta, o, state, cu_seqlens, slot_ids, cnt,
        A_log, dt_bias, scale,
        qkv.stride(0), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        H=H, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, W=W,
        HAS_DT_BIAS=dt_bias is not None, UPDATE=update,
        num_warps=num_warps or CONFIG["num_warps"], launch_pdl=pdl.ON.value, **gkw)
    return o if ss is None else (o, ss)
