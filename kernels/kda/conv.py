"""Depthwise causal conv (+ SiLU) over packed sequences with a carried tail, in Triton.

Two kernels:
- `_conv_seq_kernel`, grid (N, C / BC): one program per sequence and channel block. It can compute
  the outputs of its sequence (decode and speculative verify: few tokens per sequence, one launch)
  and then writes the new tail (the last W - 1 inputs) into `conv_state` in place. Only this
  program touches that tail, so reading the old tail and writing the new one cannot race.
- `_conv_tok_kernel`, grid (T / BT, C / BC): outputs of a block of tokens of any sequences (prefill:
  parallel over the whole packed batch); the tails are written afterwards by `_conv_seq_kernel`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl


@triton.jit
def _conv_taps(x, w, st, o_t, bos, eos, slot, o_c, m_c, s_xt, C,
               W: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr):
    """y [BT, BC] for tokens o_t [BT] whose sequences start at bos [BT] (or a scalar)."""
    m_t = o_t < eos
    acc = tl.zeros([o_t.shape[0], o_c.shape[0]], dtype=tl.float32)
    for j in tl.static_range(W):
        p = o_t - (W - 1) + j                        # input position of tap j (the last is newest)
        m_x = (m_t & (p >= bos))[:, None] & m_c[None, :]
        b_x = tl.load(x + p[:, None] * s_xt + o_c[None, :], mask=m_x, other=0.0).to(tl.float32)
        if HAS_STATE:
            # positions before the sequence start come from its tail (oldest first)
            m_s = (m_t & (p < bos))[:, None] & m_c[None, :]
            p_s = st + (slot[:, None] * C + o_c[None, :]) * (W - 1) + (W - 1 + p - bos)[:, None]
            b_x += tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
        b_w = tl.load(w + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
        acc += b_x * b_w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc


# T and N (tokens, sequences) unspecialised: one compile per BN whatever the step's counts
@triton.jit(do_not_specialize=["T", "N"])
def _conv_tok_kernel(x, w, st, y, cu_seqlens, slot_ids, T, s_xt, s_yt, C, N,
                     W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BN: tl.constexpr,
                     HAS_STATE: tl.constexpr, SILU: tl.constexpr):
    pdl.trigger()  # a PDL-launched successor may start
    pdl.wait()  # PDL: inputs come from the kernel before
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    # sequence of each token: the number of sequence ends at or before it
    o_n = tl.arange(0, BN)
    ends = tl.load(cu_seqlens + 1 + o_n, mask=o_n < N, other=2**31 - 1)
    i_n = tl.sum((ends[None, :] <= o_t[:, None]).to(tl.int32), axis=1)
    i_n = tl.minimum(i_n, N - 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    slot = tl.load(slot_ids + i_n).to(tl.int64) if HAS_STATE else i_n.to(tl.int64)
    acc = _conv_taps(x, w, st, o_t, bos, T, slot, o_c, m_c, s_xt, C, W, HAS_STATE, SILU)
    m = (o_t < T)[:, None] & m_c[None, :]
    tl.store(y + o_t[:, None] * s_yt + o_c[None, :], acc.to(y.dtype.element_ty), mask=m)


@triton.jit
def _conv_seq_kernel(x, w, st, y, cu_seqlens, slot_ids, s_xt, s_yt, C,
                     W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     COMPUTE_Y: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr,
                     ONE_TOKEN: tl.constexpr, STORE: tl.constexpr = True):
    pdl.trigger()  # a PDL-launched successor may start
    pdl.wait()  # PDL: inputs come from the kernel before
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    if ONE_TOKEN:  # decode: token n is sequence n's only token; no dependency on cu_seqlens
        bos = i_n.to(tl.int64)
        eos = bos + 1
    else:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    slot = tl.load(slot_ids + i_n).to(tl.int64) if HAS_STATE else i_n.to(tl.int64)
    if slot < 0:
        return
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    if COMPUTE_Y and ONE_TOKEN:
        o_t = bos + tl.arange(0, 1)
        slots = tl.zeros([1], dtype=tl.int64) + slot
        acc = _conv_taps(x, w, st, o_t, bos, eos, slots, o_c, m_c, s_xt, C, W, HAS_STATE, SILU)
        tl.store(y + o_t[:, None] * s_yt + o_c[None, :], acc.to(y.dtype.element_ty),
                 mask=m_c[None, :])
    elif COMPUTE_Y:
        for t0 in range(bos, eos, BT):
            o_t = t0 + tl.arange(0, BT)
            slots = tl.zeros([BT], dtype=tl.int64) + slot
            acc = _conv_taps(x, w, st, o_t, bos, eos, slots, o_c, m_c, s_xt, C, W, HAS_STATE, SILU)
            m = (o_t < eos)[:, None] & m_c[None, :]
            tl.store(y + o_t[:, None] * s_yt + o_c[None, :], acc.to(y.dtype.element_ty), mask=m)
    if HAS_STATE and STORE:
        # new tail = the last W - 1 inputs: from x, or from the old tail for short sequences
        o_i = tl.arange(0, WP)
        m_i = o_i < W - 1
        p = eos - (W - 1) + o_i
        m_x = (m_i & (p >= bos))[None, :] & m_c[:, None]
        m_s = (m_i & (p < bos))[None, :] & m_c[:, None]
        p_st = st + slot * C * (W - 1) + o_c[:, None] * (W - 1)
        b_t = tl.load(x + p[None, :] * s_xt + o_c[:, None], mask=m_x, other=0.0).to(tl.float32)
        b_t += tl.load(p_st + (W - 1 + p - bos)[None, :], mask=m_s, other=0.0).to(tl.float32)
        tl.debug_barrier()  # every read of the old tail (also by other warps) before the write
        tl.store(p_st + o_i[None, :], b_t.to(st.dtype.element_ty), mask=m_i[None, :] & m_c[:, None])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                  cu_seqlens: torch.Tensor, slot_ids: torch.Tensor | None = None,
                  activation: str | None = "silu", max_seqlen: int | None = None,
                  one_token_per_seq: bool = False, update_state: bool = True) -> torch.Tensor:
    """Depthwise causal conv over packed sequences (the math of `naive_causal_conv1d`).

    x: [T, C] (channels contiguous); weight: [C, W] (the last tap multiplies the newest input);
    cu_seqlens: [N + 1] int32 on x's device; conv_state: [slots, C, W - 1], the W - 1 inputs
    before each sequence (oldest first), row slot_ids[n] for sequence n (row n when slot_ids is
    None); updated in place to the last W - 1 inputs of each sequence. None: zeros, no update.
    max_seqlen: longest sequence if known (picks the one-launch path for short sequences).
    one_token_per_seq: every sequence has exactly one token (decode; needs T == N): skips
    cu_seqlens in the kernel.
    update_state False: the tails are read, not written (a speculative check).
    A negative slot id (with conv_state): that sequence is skipped, its rows of y not written.
    Returns y: [T, C] in x.dtype.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    T, C = x.shape
    W = weight.shape[-1]
    N = cu_seqlens.numel() - 1
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    if conv_state is not None:
        assert conv_state.is_contiguous() and conv_state.shape[1:] == (C, W - 1)
        if slot_ids is None:
            slot_ids = torch.arange(N, device=x.device)
    y = torch.empty_like(x)
    silu = activation is not None
    has_state = conv_state is not None
    BC = 128 if C >= 8192 else 64
    short = (max_seqlen if max_seqlen is not None else (1 if T <= N else T)) <= 16
    if short:
        # decode / verify: outputs and tails of each sequence in one launch
        BT = 1 if T <= N else 16
        _conv_seq_kernel[(N, triton.cdiv(C, BC))](
            x, weight, conv_state, y, cu_seqlens, slot_ids, x.stride(0), y.stride(0), C,
            W=W, WP=triton.next_power_of_2(max(W - 1, 1)), BT=BT, BC=BC,
            COMPUTE_Y=True, HAS_STATE=has_state, SILU=silu,
            ONE_TOKEN=one_token_per_seq and T == N, STORE=update_state, num_warps=4,
            launch_pdl=pdl.ON.value)
        return y
    if not update_state:
        raise ValueError("a read-only conv state takes at most 16 tokens a sequence")
    BT = 16
    _conv_tok_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](
        x, weight, conv_state, y, cu_seqlens, slot_ids, T, x.stride(0), y.stride(0), C, N,
        W=W, BT=BT, BC=BC, BN=triton.next_power_of_2(N), HAS_STATE=has_state, SILU=silu,
        num_warps=4, launch_pdl=pdl.ON.value)
    if has_state:
        _conv_seq_kernel[(N, triton.cdiv(C, BC))](
            x, weight, conv_state, y, cu_seqlens, slot_ids, x.stride(0), y.stride(0), C,
            W=W, WP=triton.next_power_of_2(max(W - 1, 1)), BT=1, BC=BC,
            COMPUTE_Y=False, HAS_STATE=True, SILU=silu, ONE_TOKEN=False, num_warps=4,
            launch_pdl=pdl.ON.value)
    return y
