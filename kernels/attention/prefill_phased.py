"""Paged prefill attention in two phases: the cached prefix, then the new tokens' own keys.

Program (head, m-block, n), as in prefill.py, runs a flash-attention forward for BLOCK_M new
tokens of sequence n (prefix = ctx - q_len cached tokens before them):
  1. keys 0..prefix-1, visible to every new token: gathered row by row through the block table
     (full tiles unmasked, one masked tail tile);
  2. the new tokens' keys j = 0..q_len-1 (position prefix + j), which new token i sees if j <= i:
     the standard causal layout, tiles aligned to the new tokens (mask on the diagonal only).
With DESC, phase 2 reads K/V from the contiguous k_new / v_new [T, KVH, D] (row cu[n] + j, the
same values store_kv wrote to the cache) through TMA tensor descriptors, which on sm_90 load a
whole tile in one instruction, free the warps of address math and pipeline without cp.async;
without DESC it gathers them from the cache like phase 1 (the inner-loop changes alone).

Inner loop: the softmax scale is folded into the running max and one FMA per score
(qk * scale - m) instead of scaling the scores first; P @ V accumulates in place (tl.dot's acc).
WS: tl.range's warp_specialize on phase 2's unmasked loop, the bulk of the work at long prompts;
Triton 3.6 compiles it for sm_90 but leaves this kernel unspecialised (no ttg.warp_specialize in
the TTGIR, the same code as without), so it is off; kept for a Triton that does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from volundr.kernels.attention.cache import FP8, fp8_round

LOG2E = 1.4426950408889634


@triton.jit
def _softmax_step(acc, l_i, m_i, qk, v, keep, scale_log2, MASKED: tl.constexpr):
    """Online-softmax update with raw scores qk [BLOCK_M, BLOCK_N]; keep: visible keys."""
    if MASKED:
        qk = tl.where(keep, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        p = tl.exp2(qk * scale_log2 - m_new[:, None])  # one FMA per score
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _gather(ptr, bt_row, kvh, pos, valid, offs_d, stride_b, stride_s, stride_h,
            BS: tl.constexpr, MASKED: tl.constexpr, DT: tl.constexpr):
    """Rows at positions pos [BLOCK_N] of one KV head from the paged cache, in dtype DT (q's:
    an fp8 cache's values are exact in it); invalid rows 0 (their block-table entries may be
    -1, so they are never dereferenced)."""
    if MASKED:
        page = tl.load(bt_row + pos // BS, mask=valid, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + pos // BS).to(tl.int64)
    ptrs = ptr + page[:, None] * stride_b + (pos % BS)[:, None] * stride_s + kvh * stride_h
    if MASKED:
        x = tl.load(ptrs + offs_d[None, :], mask=valid[:, None], other=0.0)
    else:
        x = tl.load(ptrs + offs_d[None, :])
    return x.to(DT)


@triton.jit
def _prefill_phased_kernel(
    q_ptr, k_ptr, v_ptr, kn_desc, vn_desc, o_ptr, bt_ptr, cu_ptr, ctx_ptr, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DESC: tl.constexpr, WS: tl.constexpr,
    FP8: tl.constexpr = False,
):
    """FP8: the cache is fp8, so the new tokens' K/V read through the descriptors (q's dtype)
    are rounded as store_kv rounded them into the cache."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # the diagonal starts on a tile boundary
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)  # longest programs first
    n = tl.program_id(2)
    q_start = tl.load(cu_ptr + n)
    q_len = tl.load(cu_ptr + n + 1) - q_start
    # No early return for m-blocks past the sequence: their loops are empty and their store
    # masked. With the return (loops under a branch) the kernel took 255 registers and spilled
    # at 128 x 128 / 8 warps on sm_90, without it 232 and no spills (ptxas -v).
    live = mb * BLOCK_M < q_len
    prefix = tl.where(live, tl.load(ctx_ptr + n) - q_len, 0)
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index i
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    mmask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mmask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + n.to(tl.int64) * stride_bt

    # phase 1: the cached prefix, which every row sees whole
    full = prefix // BLOCK_N * BLOCK_N
    for s in range(0, full, BLOCK_N):
        pos = s + offs_n
        k = _gather(k_ptr, bt_row, kvh, pos, None, offs_d, stride_kb, stride_ks, stride_kh,
                    BS, False, q.dtype)
        v = _gather(v_ptr, bt_row, kvh, pos, None, offs_d, stride_vb, stride_vs, stride_vh,
                    BS, False, q.dtype)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, tl.dot(q, tl.trans(k)), v, None,
                                      scale_log2, False)
    if full < prefix:
        pos = full + offs_n
        valid = pos < prefix
        k = _gather(k_ptr, bt_row, kvh, pos, valid, offs_d, stride_kb, stride_ks, stride_kh,
                    BS, True, q.dtype)
        v = _gather(v_ptr, bt_row, kvh, pos, valid, offs_d, stride_vb, stride_vs, stride_vh,
                    BS, True, q.dtype)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, tl.dot(q, tl.trans(k)), v,
                                      valid[None, :], scale_log2, True)

    # phase 2: the new tokens, keys [0, lo) below the diagonal, then the diagonal tiles
    lo = tl.where(live, mb * BLOCK_M, 0)
    hi = tl.where(live, tl.minimum(lo + BLOCK_M, q_len), 0)
    for s in tl.range(0, lo, BLOCK_N, warp_specialize=WS):
        if DESC:
            # rows past the sequence belong to the next one (or are zero past T): only
            # diagonal tiles reach them, where they are masked
            k = kn_desc.load([q_start + s, kvh * D])
            v = vn_desc.load([q_start + s, kvh * D])
            if FP8:
                k, v = fp8_round(k), fp8_round(v)
        else:
            pos = prefix + s + offs_n
            k = _gather(k_ptr, bt_row, kvh, pos, None, offs_d, stride_kb, stride_ks,
                        stride_kh, BS, False, q.dtype)
            v = _gather(v_ptr, bt_row, kvh, pos, None, offs_d, stride_vb, stride_vs,
                        stride_vh, BS, False, q.dtype)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, tl.dot(q, tl.trans(k)), v, None,
                                      scale_log2, False)
    for s in range(lo, hi, BLOCK_N):
        offs_j = s + offs_n
        valid = offs_j < q_len
        if DESC:
            k = kn_desc.load([q_start + s, kvh * D])
            v = vn_desc.load([q_start + s, kvh * D])
            if FP8:
                k, v = fp8_round(k), fp8_round(v)
        else:
            k = _gather(k_ptr, bt_row, kvh, prefix + offs_j, valid, offs_d, stride_kb,
                        stride_ks, stride_kh, BS, True, q.dtype)
            v = _gather(v_ptr, bt_row, kvh, prefix + offs_j, valid, offs_d, stride_vb,
                        stride_vs, stride_vh, BS, True, q.dtype)
        keep = (offs_j[None, :] <= offs_m[:, None]) & valid[None, :]
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, tl.dot(q, tl.trans(k)), v, keep,
                                      scale_log2, True)

    out = acc / l_i[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mmask[:, None])


def _rows_desc(x: torch.Tensor, block_n: int) -> TensorDescriptor:
    """x [T, KVH, D] (rows may be strided, e.g. a column slice of the fused QKV projection) as
    a 2-D [T, KVH * D] descriptor; tile [block_n, D] at (row, kvh * D)."""
    T, KVH, D = x.shape
    if x.stride(2) != 1 or x.stride(1) != D or x.data_ptr() % 16 or (x.stride(0) * x.itemsize) % 16:
        x = x.contiguous()
    return TensorDescriptor(x, [T, KVH * D], [x.stride(0), 1], [block_n, D])


def launch_geometry(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                    max_q_len: int, block_m: int):
    """Shared by both prefill launchers: o (empty, like q), the grid (heads, m-blocks,
    sequences; None when there is nothing to compute), the cache's block size and the GQA
    group."""
    T, H, _ = q.shape
    o = torch.empty_like(q)
    grid = (None if T == 0 or max_q_len == 0
            else (H, triton.cdiv(max_q_len, block_m), block_tables.shape[0]))
    return o, grid, k_cache.shape[1], H // k_cache.shape[2]


def phased_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             context_lens: torch.Tensor, scale: float, max_q_len: int,
                             k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                             block_m: int = 128, block_n: int = 128, num_warps: int = 8,
                             num_stages: int = 3, warp_specialize: bool = False) -> torch.Tensor:
    """paged_prefill_attention's contract; with k_new / v_new [T, KVH, D] (the new tokens' K/V,
    packed like q, as stored in the cache; in q's dtype, rounded here to fp8 where the cache
    is fp8) phase 2 reads them through TMA descriptors."""
    o, grid, BS, group = launch_geometry(q, k_cache, block_tables, max_q_len, block_m)
    if grid is None:
        return o
    desc = k_new is not None and v_new is not None
    kn = _rows_desc(k_new, block_n) if desc else None
    vn = _rows_desc(v_new, block_n) if desc else None
    _prefill_phased_kernel[grid](
        q, k_cache, v_cache, kn, vn, o, block_tables, cu_seqlens_q, context_lens,
        scale * LOG2E, q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, D=q.shape[2], BS=BS, BLOCK_M=block_m, BLOCK_N=block_n, DESC=desc,
        WS=warp_specialize, FP8=desc and k_cache.dtype == FP8, num_warps=num_warps,
        num_stages=num_stages)
    return o
