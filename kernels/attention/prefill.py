"""Paged prefill attention (varlen, causal, GQA, NoPE) with a cached prefix.

Sequence n has q_len = cu[n + 1] - cu[n] new tokens, already stored in the cache, and
ctx = context_lens[n] cached tokens in all, so new token j sits at position ctx - q_len + j and
sees keys 0..that position. Program (head, m-block, n) runs a flash-attention forward over the
keys, gathered row by row from the pages of its block table: first the keys every row of the
m-block sees (no mask), then the diagonal blocks (causal mask). Online softmax in fp32, exp2
with the scale folded in.

Launch order: heads vary fastest, so the GROUP heads sharing one KV head run side by side and
read the same K/V tiles through L2; m-blocks go last-first, the longest programs start first.

paged_prefill_attention also runs the two-phase kernel of prefill_phased.py ("phased", and
"desc": the new tokens' K/V from the contiguous k_new / v_new through TMA); IMPL picks the default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from volundr.kernels.attention.cache import FP8
from volundr.kernels.attention.prefill_phased import launch_geometry, phased_prefill_attention

LOG2E = 1.4426950408889634

# The engine's default kernel: "paged" this file's kernel; "phased" prefill_phased.py's,
# gathering every key from the cache; "desc" the same reading the new tokens' K/V from k_new /
# v_new through TMA ("paged" where they are not given). H200 run 55 (bench_attention.py
# --prefill-only --sweep, one sequence, TFLOP/s at T = 4K / 16K / 32K): desc 492 / 553 / 548,
# 0.94 / 0.96 / 0.92x cuDNN SDPA; paged 328 / 385 / 373, phased 319 / 377 / 363.
# CONFIGS: each one's launch config.
IMPL = "desc"
CONFIGS: dict[str, dict] = {
    "paged": dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
    "phased": dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
    "desc": dict(block_m=128, block_n=128, num_warps=8, num_stages=3, warp_specialize=False),
}


@triton.jit
def _attn_tile(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kvh, offs_d, pos_m, ctx, s,
               scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    offs_n = s + tl.arange(0, BLOCK_N)
    if MASKED:
        nmask = offs_n < ctx
        page = tl.load(bt_row + offs_n // BS, mask=nmask, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs_n // BS).to(tl.int64)
    row = offs_n % BS
    k_ptrs = k_ptr + page[:, None] * stride_kb + row[:, None] * stride_ks + kvh * stride_kh
    v_ptrs = v_ptr + page[:, None] * stride_vb + row[:, None] * stride_vs + kvh * stride_vh
    if MASKED:
        k = tl.load(k_ptrs + offs_d[None, :], mask=nmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs + offs_d[None, :])
    qk = tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2           # [BLOCK_M, BLOCK_N]
    if MASKED:
        keep = (offs_n[None, :] <= pos_m[:, None]) & nmask[None, :]
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs + offs_d[None, :], mask=nmask[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs + offs_d[None, :])
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, cu_ptr, ctx_ptr, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    n = tl.program_id(2)
    q_start = tl.load(cu_ptr + n)
    q_len = tl.load(cu_ptr + n + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + n)
    prefix = ctx - q_len
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mmask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mmask[:, None], other=0.0)
    pos_m = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + n.to(tl.int64) * stride_bt
    # keys [0, lo) are visible to every row of this m-block (lo <= first row's position)
    lo = (prefix + mb * BLOCK_M) // BLOCK_N * BLOCK_N
    hi = tl.minimum(prefix + (mb + 1) * BLOCK_M, ctx)
    for s in range(0, lo, BLOCK_N):
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kvh, offs_d, pos_m,
                                   ctx, s, scale_log2, stride_kb, stride_ks, stride_kh,
                                   stride_vb, stride_vs, stride_vh, BS, BLOCK_N, False)
    for s in range(lo, hi, BLOCK_N):
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kvh, offs_d, pos_m,
                                   ctx, s, scale_log2, stride_kb, stride_ks, stride_kh,
                                   stride_vb, stride_vs, stride_vh, BS, BLOCK_N, True)
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mmask[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, max_q_len: int,
                            k_new: torch.Tensor | None = None,
                            v_new: torch.Tensor | None = None, impl: str | None = None,
                            **cfg) -> torch.Tensor:
    """Causal attention of packed new tokens over cache + themselves: o [T, H, D] in q.dtype.

    q [T, H, D] (N sequences split by cu_seqlens_q [N + 1]); k_cache/v_cache
    [num_blocks, block_size, KVH, D] in q's dtype or fp8 e4m3 (cache.FP8); block_tables
    [N, max_blocks]; context_lens [N], cached tokens per sequence including the new ones;
    max_q_len >= every sequence's q_len.
    k_new / v_new [T, KVH, D]: the new tokens' K/V as store_kv got them (optional; read by
    impl "desc", rounded to fp8 in the kernel where the cache is fp8, so every key is the
    cache's value). impl: "paged" / "phased" / "desc" (None: IMPL); cfg overrides
    CONFIGS[impl].
    """
    usable = (k_new is not None and v_new is not None
              and k_new.dtype == v_new.dtype == q.dtype
              and k_cache.dtype == v_cache.dtype in (q.dtype, FP8))
    if impl is None:
        impl = "paged" if IMPL == "desc" and not usable else IMPL
    elif impl == "desc" and not usable:
        raise ValueError("impl='desc' needs k_new / v_new of the cache's dtype")
    cfg = {**CONFIGS[impl], **cfg}
    if impl != "paged":
        kn, vn = (k_new, v_new) if impl == "desc" else (None, None)
        return phased_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                        context_lens, scale, max_q_len, kn, vn, **cfg)
    return _paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                          max_q_len, **cfg)


def _paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   context_lens: torch.Tensor, scale: float, max_q_len: int,
                   block_m: int = 128, block_n: int = 128, num_warps: int = 8,
                   num_stages: int = 2) -> torch.Tensor:
    o, grid, BS, group = launch_geometry(q, k_cache, block_tables, max_q_len, block_m)
    if grid is None:
        return o
    _prefill_kernel[grid](
        q, k_cache, v_cache, o, block_tables, cu_seqlens_q, context_lens, scale * LOG2E,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, D=q.shape[2], BS=BS, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages)
    return o
