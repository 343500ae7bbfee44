"""KDA decode in one launch: the short causal conv (+ SiLU, with its carried tail) fused into the
token-by-token KDA step, one token per sequence.

Unfused, a KDA layer's decode step runs `conv.causal_conv1d` over q|k|v (writes y [T, C], updates
conv_state) and then `fused_recurrent_kda` (reads y back). Here the recurrent kernel's programs
read the raw projections and compute the conv outputs they need themselves. Grid
(NV = V / BV, N * H), as the decode path of fused_recurrent.py: program (i_v, n, h) needs all K q
and k channels of head h (the L2 norms and the dot products with the state run over K) but only
its own BV v channels. The q/k conv of a head is therefore computed NV times, W multiply-adds per
channel: nothing next to the [K, BV] fp32 state tile each program streams in and out.

Tail update (conv_state[slot] <- the last W - 1 inputs), race-free:
* v channels: program (i_v, n, h) is their only reader and writer. It writes the new tail after
  a CTA barrier, because its threads write positions that other threads of it read.
* q/k channels of head h: read by all NV programs of (n, h), so none may be overwritten while
  another program may still read it. Each program, once its reads are done (CTA barrier), adds 1
  to counter[n * H + h] with an acq_rel atomic; the one that gets NV - 1 back is the last. Every
  other program's reads come before its release, which the last one's acquire synchronises with,
  so the last program alone writes the new q/k tail (from the window it holds in registers: the
  old tail and the new input) and resets the counter to 0. Which program is last varies from run
  to run; what it writes does not (all NV read the same window), so the result is deterministic.
The counters (one int32 per (row, head); keyed by the batch row, not the slot, because CUDA-graph
padding rows may share a scratch slot) are allocated once per device and reused; every launch
leaves them at zero, so the kernel can be captured in a CUDA graph. Launches that use them must
not overlap, i.e. run on one stream (as the engine does).

Tried on the H200 without a gain beyond noise (batch 1, graph-replayed, ~0.1-0.3 us): CTA
barriers between the load groups (ptxas issues some tail loads only after math that waits for
the first ones; the barriers keep every load ahead of the math, but cost as much at batch >= 4)
and the arrival count done by one thread in inline PTX with its result broadcast after the KDA
step (Triton's scalar atomic makes every thread wait for the round trip at once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.kda.fused_recurrent import kda_update
from volundr.kernels.kda.utils import softplus


@triton.jit
def _load_w(cw, ch, m, W: tl.constexpr):
    """Conv taps of channels ch [B] (mask m): cw[ch, j] for j = 0, 1, 2 (0 where j >= W - 1;
    W <= 4) and the newest tap cw[ch, W - 1], fp32. cw [C, W]."""
    w0 = tl.load(cw + ch * W, mask=m & (W > 1), other=0.0).to(tl.float32)
    w1 = tl.load(cw + ch * W + 1, mask=m & (W > 2), other=0.0).to(tl.float32)
    w2 = tl.load(cw + ch * W + 2, mask=m & (W > 3), other=0.0).to(tl.float32)
    wn = tl.load(cw + ch * W + (W - 1), mask=m, other=0.0).to(tl.float32)
    return w0, w1, w2, wn


@triton.jit
def _load_new(x, cw, ch, m, W: tl.constexpr):
    """For one token's conv at channels ch [B] (mask m): the new inputs x[ch] (fp32) and
    `_load_w`'s taps. x: the token's row of inputs; cw [C, W]."""
    b_x = tl.load(x + ch, mask=m, other=0.0).to(tl.float32)
    w0, w1, w2, wn = _load_w(cw, ch, m, W)
    return b_x, w0, w1, w2, wn


@triton.jit
def _load_tail(st, ch, m, W: tl.constexpr):
    """The carried inputs st[ch, j], j = 0, 1, 2 (oldest first; 0 for j >= W - 1), fp32.
    st: the sequence's tail rows [C, W - 1]."""
    p = st + ch * (W - 1)
    t0 = tl.load(p, mask=m & (W > 1), other=0.0).to(tl.float32)
    t1 = tl.load(p + 1, mask=m & (W > 2), other=0.0).to(tl.float32)
    t2 = tl.load(p + 2, mask=m & (W > 3), other=0.0).to(tl.float32)
    return t0, t1, t2


@triton.jit
def _conv_silu(b_x, w0, w1, w2, wn, t0, t1, t2, dtype: tl.constexpr):
    """SiLU of the conv, rounded to `dtype` as the unfused path hands it over, back in fp32."""
    acc = t0 * w0 + t1 * w1 + t2 * w2 + b_x * wn
    return (acc * tl.sigmoid(acc)).to(dtype).to(tl.float32)


@triton.jit
def _store_tail(st, ch, m, b_x, t1, t2, W: tl.constexpr):
    """The new tail: the window without its oldest input (t1, t2 shift down, x is the newest)."""
    p = st + ch * (W - 1)
    ty = st.dtype.element_ty
    if W > 2:
        tl.store(p, t1.to(ty), mask=m)
    if W > 3:
        tl.store(p + 1, t2.to(ty), mask=m)
    tl.store(p + (W - 2), b_x.to(ty), mask=m)


@triton.jit
def _lr_load(q, sz, n, m, NQ: tl.constexpr, WA: tl.constexpr):
    """Output rows n (mask m) of a 4-bit linear with one quant group per row, in pack.py's
    kernel layout (q [WA, NQ] int32: word row r, nibble i holds the code of input i WA + r;
    sz [1, NQ] int32 = bf16 scale | bf16 zero << 16): words [WA, BN] and packed scales [BN].
    Weights: never written by a kernel, so loadable before the PDL wait."""
    r = tl.arange(0, WA)
    w = tl.load(q + r[:, None] * NQ + n[None, :], mask=m[None, :], other=0)
    return w, tl.load(sz + n, mask=m, other=0)


@triton.jit
def _lr_dot(w, s, x, WA: tl.constexpr, BN: tl.constexpr, dtype: tl.constexpr):
    """y [BN] = W x for `_lr_load`'s words w and scales s and x at pointer x (8 WA inputs):
    W = (q - zero) scale, so y = scale (sum q x - zero sum x); rounded to dtype (what the
    mixed-bit GEMV returns) and back to fp32."""
    r = tl.arange(0, WA)
    acc = tl.zeros([WA, BN], dtype=tl.float32)  # reduced once at the end, not per nibble
    xsum = tl.zeros([WA], dtype=tl.float32)
    for i in tl.static_range(8):
        xi = tl.load(x + i * WA + r).to(tl.float32)
        acc += ((w >> (4 * i)) & 15).to(tl.float32) * xi[:, None]
        xsum += xi
    sc = (s << 16).to(tl.float32, bitcast=True)
    zr = (s & -65536).to(tl.float32, bitcast=True)
    y = sc * (tl.sum(acc, axis=0) - zr * tl.sum(xsum, axis=0))
    return y.to(dtype).to(tl.float32)


@triton.jit
def _kda_decode_kernel(
    x, cw, cs, g, beta, o, h, slot_ids, cnt, A_log, dt_bias, scale,
    s_xt, s_gt, s_gh, s_bt, s_bh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    z=None, nw=None, ss=None, s_zt=0, GATED: tl.constexpr = False,
    lr_x=None, lr_q=None, lr_sz=None, s_lrt=0, LOW_RANK: tl.constexpr = False,
    WA_LR: tl.constexpr = 16,
):
    """x [T, C] raw q|k|v (row stride s_xt), C = 2HK + HV; cw [C, W]; cs [slots, C, W - 1];
    g [T, H, K] and beta [T, H] logits (strides s_g*, s_b*); o [T, H, V]; h [slots, H, K, V] fp32;
    slot_ids [T]; cnt [>= T * H] int32 zeros. Grid (cdiv(V, BV), T * H).
    GATED: o = o' nw sigmoid(z) (o' the output rounded to o's dtype; z [T, H, V] the output
    gate logits, token stride s_zt; nw [V] the output norm's weight) and ss [T, H, NV] fp32 =
    each program's sum of o'^2: the head's RMSNorm is then one scale per head, which o_proj's
    GEMV applies to the head's sums (gemv_tc `gscale`) instead of a norm kernel.
    LOW_RANK (with GATED): g and z not read but computed here, g = f_b(lr_x[:, :R]) and
    z = g_b(lr_x[:, R:2R]) (R = 8 WA_LR; lr_x token stride s_lrt), f_b / g_b one 4-bit linear
    [HK + HV, R] of one quant group per row (lr_q [WA_LR, HK + HV] int32, lr_sz [1, HK + HV],
    f rows first): KDA's low-rank gate projections without their own launch."""
    pdl.trigger()  # a PDL-launched successor may start
    NV: tl.constexpr = (V + BV - 1) // BV
    C: tl.constexpr = 2 * H * K + H * V
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_t = i_n.to(tl.int64)  # token i_n is sequence i_n's only token
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    if LOW_RANK:  # this head's f_b rows and this program's g_b rows, before the wait
        lw_f, ls_f = _lr_load(lr_q, lr_sz, i_h * K + o_k, m_k, H * K + H * V, WA_LR)
        lw_z, ls_z = _lr_load(lr_q, lr_sz, H * K + i_h * V + o_v, m_v, H * K + H * V, WA_LR)
    pdl.wait()  # PDL: inputs come from the kernel before
    m_h = m_k[:, None] & m_v[None, :]
    c_q = i_h * K + o_k
    c_k = H * K + c_q
    c_v = 2 * H * K + i_h * V + o_v
    # What does not depend on the slot id first, so that its loads overlap the slot id's.
    slot = tl.load(slot_ids + i_n).to(tl.int64)
    xt = x + i_t * s_xt
    x_q, w0_q, w1_q, w2_q, wn_q = _load_new(xt, cw, c_q, m_k, W)
    x_k, w0_k, w1_k, w2_k, wn_k = _load_new(xt, cw, c_k, m_k, W)
    x_v, w0_v, w1_v, w2_v, wn_v = _load_new(xt, cw, c_v, m_v, W)
    if LOW_RANK:  # f_b's output is added after the state's loads are issued (below)
        b_g = tl.zeros([BK], dtype=tl.float32)
    else:
        b_g = tl.load(g + i_t * s_gt + i_h * s_gh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_b = tl.load(beta + i_t * s_bt + i_h * s_bh).to(tl.float32)
    b_a = tl.load(A_log + i_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_g += tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    if GATED:  # the output gate and norm weight of this program's v channels
        if not LOW_RANK:
            b_z = tl.load(z + i_t * s_zt + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_nw = tl.load(nw + o_v, mask=m_v, other=0.0).to(tl.float32)
    p_o = o + (i_t * H + i_h) * V + o_v
    if slot < 0:  # padding row (a CUDA-graph batch larger than the live one): no state, o = 0
        tl.store(p_o, tl.zeros([BV], dtype=o.dtype.element_ty), mask=m_v)
        if GATED:
            tl.store(ss + i_nh * NV + i_v, 0.0)
        return
    p_h = h + (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(p_h, mask=m_h, other=0.0).to(tl.float32)
    st = cs + slot * C * (W - 1)
    t0_v, t1_v, t2_v = _load_tail(st, c_v, m_v, W)
    t0_q, t1_q, t2_q = _load_tail(st, c_q, m_k, W)
    t0_k, t1_k, t2_k = _load_tail(st, c_k, m_k, W)
    if LOW_RANK:  # the gate logits while the state and tails are on their way
        xl = lr_x + i_t * s_lrt
        b_g += _lr_dot(lw_f, ls_f, xl, WA_LR, BK, lr_x.dtype.element_ty)
        if GATED:
            b_z = _lr_dot(lw_z, ls_z, xl + 8 * WA_LR, WA_LR, BV, lr_x.dtype.element_ty)

    dt = x.dtype.element_ty
    b_q = _conv_silu(x_q, w0_q, w1_q, w2_q, wn_q, t0_q, t1_q, t2_q, dt)
    b_k = _conv_silu(x_k, w0_k, w1_k, w2_k, wn_k, t0_k, t1_k, t2_k, dt)
    b_v = _conv_silu(x_v, w0_v, w1_v, w2_v, wn_v, t0_v, t1_v, t2_v, dt)
    b_g = -tl.exp(b_a) * softplus(b_g)  # the gate (kda_gate_act), on the preloaded operands

    # every thread of this program has read the old tails before any of them is overwritten
    tl.debug_barrier()
    # q/k: count this program's reads done (release); the last of the head's NV programs sees
    # every other one's reads done (acquire). Before the v-tail store, which the release fence
    # would otherwise wait for.
    done = tl.atomic_add(cnt + i_nh, 1, sem="acq_rel")
    _store_tail(st, c_v, m_v, x_v, t1_v, t2_v, W)  # this program's own channels

    b_h, b_o = kda_update(b_h, b_q, b_k, b_v, b_g, b_b, A_log, dt_bias, i_h, o_k, m_k, scale, K,
                          True, False, False, True)
    if GATED:
        b_o = b_o.to(o.dtype.element_ty).to(tl.float32)  # the norm reads the rounded o
        tl.store(ss + i_nh * NV + i_v, tl.sum(tl.where(m_v, b_o * b_o, 0.0), axis=0))
        b_o = b_o * b_nw * tl.sigmoid(b_z)
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_h, b_h.to(h.dtype.element_ty), mask=m_h)
    if done == NV - 1:
        _store_tail(st, c_q, m_k, x_q, t1_q, t2_q, W)
        _store_tail(st, c_k, m_k, x_k, t1_k, t2_k, W)
        tl.atomic_xchg(cnt + i_nh, 0, sem="relaxed")  # ready for the next launch


# Launch settings (perf/kernels/bench_kda.py --decode-only --fused-variants times them). H200,
# graph-replayed, us per layer (two kernels -> this one): batch 1 10.9 -> 9.6, 4 15.2 -> 13.7,
# 8 22.9 -> 21.9, 16 34.1 -> 34.2, 64 106.5 -> 110.9 with BV 32 and 2 warps, the best setting at
# every batch there (BV 16: batch 4 16.8, 64 116; 4 warps: 64 116).
CONFIG = {"BV": 32, "num_warps": 2}

_COUNTERS: dict = {}
_RETIRED: list = []  # outgrown counters: CUDA graphs captured earlier still point into them


def gated_kwargs(gated: tuple, T: int, H: int, V: int, NV: int, device: torch.device,
                 check: bool = True) -> tuple[dict, torch.Tensor]:
    """The GATED launch arguments of gated = (z, norm weight) and the sums of squares they
    fill, ss [T, H, NV] fp32 (kda_decode's and kda_rows' gated output norm); check: z must be
    [T, H, V] with heads V apart and a unit channel stride, the weight [V]."""
    z, nw = gated
    if check and (z.shape != (T, H, V) or z.stride(2) != 1 or z.stride(1) != V
                  or nw.numel() != V):
        raise ValueError("gated: z [T, H, V] with heads V apart, unit channel stride; "
                         "norm weight [V]")
    ss = torch.empty(T, H, NV, dtype=torch.float32, device=device)
    return dict(z=z, nw=nw.contiguous(), ss=ss, s_zt=z.stride(0), GATED=True), ss


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, kept per device and grown on demand (each launch leaves them 0)."""
    key = (device.type, device.index)
    cnt = _COUNTERS.get(key)
    if cnt is None or cnt.numel() < n:
        _RETIRED.append(cnt)
        cnt = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = cnt
    return cnt


def kda_decode(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
               g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
               scale: float, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, BV: int | None = None,
               num_warps: int | None = None, gated: tuple | None = None,
               low_rank: tuple | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One decode step of a KDA layer (one token per sequence): conv + SiLU over the raw q|k|v
    projections with each sequence's carried tail, then the KDA step, in one launch.

    qkv: [T, C], C = 2 * H * K + H * V, channels q | k | v, head h's q channels h*K .. h*K+K-1
    (unit column stride, any row stride); conv_weight [C, W] (the last tap multiplies the newest
    input); conv_state [slots, C, W - 1] (oldest first), row slot_ids[n] updated in place to the
    last W - 1 inputs; g [T, H, K] raw gate logits (g = -exp(A_log[h]) * softplus(g + dt_bias));
    beta [T, H] logits (sigmoid in the kernel); g and beta with any token/head strides (g's last
    dim contiguous); state [slots, H, K, V] fp32, row slot_ids[n] updated in place; slot_ids [T]
    (negative: a padding row, left alone, o = 0). q and k are L2-normed in the kernel.
    Returns o [T, H, V] in qkv.dtype (the math of `conv.causal_conv1d` + `fused_recurrent_kda`).
    gated = (z [T, H, V] output gate logits (last dim contiguous, heads V apart), norm weight
    [V]): returns (o' nw sigmoid(z), ss [T, H, NV] fp32), ss = sums of o'^2 over the NV blocks
    of V of each head: RMSNorm(o') nw sigmoid(z) = that times rsqrt(sum(ss) / V + eps) per
    head (KDA's gated output norm, its per-head scale left to o_proj's GEMV).
    low_rank = (xs [T, 2R] (unit column stride), qa [R / 8, H K + H V] int32, sz [1, H K + H V]
    int32), with gated = (None, norm weight) and g None: g = f_b(xs[:, :R]) and z = g_b(xs[:,
    R:]) computed in the kernel from the 4-bit kernel layout of f_b and g_b stacked (rows of
    f_b first; one quant group of R per row; R / 8 a power of two), rounded to xs's dtype as
    the mixed-bit GEMV returns them: KDA's low-rank gate projections without their launch.
    """
    T, C = qkv.shape
    _, H, K, V = state.shape
    W = conv_weight.shape[-1]
    if C != 2 * H * K + H * V or conv_weight.shape[0] != C or conv_state.shape[1:] != (C, W - 1):
        raise ValueError(f"qkv {tuple(qkv.shape)}, conv weight {tuple(conv_weight.shape)} and "
                         f"state {tuple(conv_state.shape)} do not fit H={H}, K={K}, V={V}")
    if not 2 <= W <= 4:  # the kernel holds the taps in named registers
        raise ValueError(f"kda_decode takes convs of width 2 to 4, not {W}")
    if state.shape[1:3] != (H, K) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous fp32 [slots, {H}, {K}, V] pool")
    if not conv_state.is_contiguous():
        raise ValueError("conv_state must be contiguous")
    if slot_ids.shape[0] != T or beta.shape != (T, H):
        raise ValueError("one slot id and one beta row per token")
    lkw = {}
    if low_rank is not None:
        xs, lq, lsz = low_rank
        R, n_lr = xs.shape[1] // 2, H * K + H * V
        wa = R // 8
        if (gated is None or g is not None or xs.shape[0] != T or xs.stride(1) != 1
                or R % 8 or wa & (wa - 1) or lq.dtype != torch.int32 or lsz.dtype != torch.int32
                or lq.shape != (wa, n_lr) or lsz.shape != (1, n_lr)):
            raise ValueError("low_rank: xs [T, 2R], qa [R / 8, HK + HV], sz [1, HK + HV] int32 "
                             "(R / 8 a power of two), with gated = (None, w) and g None")
        lkw = dict(lr_x=xs, lr_q=lq.contiguous(), lr_sz=lsz.contiguous(), s_lrt=xs.stride(0),
                   LOW_RANK=True, WA_LR=wa)
        g = xs  # (not read)
    elif g.shape != (T, H, K):
        raise ValueError(f"g must be [T, H, K] = [{T}, {H}, {K}]")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if g.stride(-1) != 1:
        g = g.contiguous()
    conv_weight = conv_weight.contiguous()  # a no-op for the engine's (built once, contiguous)
    o = out if out is not None else qkv.new_empty(T, H, V)
    BK = triton.next_power_of_2(K)
    BV = min(BV or CONFIG["BV"], triton.next_power_of_2(V))
    NV = triton.cdiv(V, BV)
    num_warps = num_warps or CONFIG["num_warps"]
    gkw, ss = {}, None
    if gated is not None:
        # (with low_rank, z is computed in the kernel: xs stands in, never read)
        gkw, ss = gated_kwargs(gated if low_rank is None else (xs, gated[1]), T, H, V, NV,
                               qkv.device, check=low_rank is None)
    if T == 0:
        return o if ss is None else (o, ss)
    cnt = _counters(qkv.device, T * H)
    _kda_decode_kernel[(NV, T * H)](
        qkv, conv_weight, conv_state, g, beta, o, state, slot_ids, cnt, A_log, dt_bias, scale,
        qkv.stride(0), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        H=H, K=K, V=V, BK=BK, BV=BV, W=W,
        HAS_DT_BIAS=dt_bias is not None, num_warps=num_warps, launch_pdl=pdl.ON.value, **gkw,
        **lkw)
    return o if ss is None else (o, ss)
