"""Paged decode attention, flash-decoding style: one new token per sequence.

Kernel 1 splits every sequence's KV length into `num_splits` chunks; program (n, kvh, split)
reads each K/V row of its chunk once and uses it for all GROUP query heads of that KV head: the
group is the M dimension of the two tl.dot's (padded to G_PAD >= 16). It writes the chunk's
normalised partial output and its log-sum-exp. Kernel 2 merges the chunks per (n, head). With one
split, kernel 1 writes the final output directly and kernel 2 is skipped. Variants of kernel 1
(H200 runs 67-69): the block-table entries a tile ahead (early_idx, on by default; bt_ahead) and
every KV head in one program (all_heads, _decode_split_heads_kernel: slower, off).

The split count depends only on host ints (batch size, max_context_len, SM count), never on
device values, so the path does no host sync and is CUDA-graph capturable. Each sequence cuts
its own context into num_splits equal chunks on the device (at least min_split tokens each), so
a long sequence in a ragged batch, or a graph captured with max_context_len = max_model_len,
still spreads over all programs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.attention.prefill_phased import _softmax_step

LOG2E = 1.4426950408889634
MAX_SPLITS = 256  # the merge holds all of a head's splits in one [S_PAD, BLOCK_D] tile
MIN_SPLIT = 256  # tokens


@triton.jit
def _split_len(ctx, num_splits, gran, min_split):
    """Tokens per split of one sequence: ctx / num_splits rounded up to gran, >= min_split."""
    return tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), gran) * gran, min_split)


@triton.jit
def _split_range(cu_ptr, ctx_ptr, n, sp, num_splits, gran, min_split):
    """Sequence n's query row q_idx, q_len (0 or 1), context and split sp's tokens start ..
    end - 1 (empty where start >= ctx)."""
    q_idx = tl.load(cu_ptr + n)
    q_len = tl.load(cu_ptr + n + 1) - q_idx
    ctx = tl.load(ctx_ptr + n)
    split_len = _split_len(ctx, num_splits, gran, min_split)
    start = sp * split_len
    end = tl.minimum(start + split_len, ctx)
    return q_idx, q_len, ctx, start, end


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr, opart_ptr, lse_ptr, o_ptr,
    scale_log2, num_splits, min_split,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    H: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    BT_AHEAD: tl.constexpr = False, EARLY_IDX: tl.constexpr = False, F16: tl.constexpr = False,
):
    """F16 (an fp8 cache): q saturated to float16 and K/V widened to float16, whose conversion
    from e4m3 is one instruction per pair (to bfloat16 it is not). BT_AHEAD: each tile's
    block-table entries are loaded one iteration ahead (the K/V addresses then wait on no load
    of their own iteration). EARLY_IDX (implies BT_AHEAD): cu, ctx and the first tile's
    entries are loaded before the PDL wait: host copies write them, never a kernel of the
    chain (q and the new token's K/V are read after it)."""
    pdl.trigger()  # a PDL-launched successor may start
    if not EARLY_IDX:
        pdl.wait()  # PDL: inputs come from the kernel before
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    q_idx, q_len, ctx, start, end = _split_range(cu_ptr, ctx_ptr, n, sp, num_splits, BLOCK_N,
                                                 min_split)
    bt_row = bt_ptr + n.to(tl.int64) * stride_bt
    offs_b = tl.arange(0, BLOCK_N)
    page = tl.zeros([BLOCK_N], tl.int32)
    if BT_AHEAD | EARLY_IDX:  # the first tile's entries
        page = tl.load(bt_row + (start + offs_b) // BS, mask=start + offs_b < end, other=0)
    if EARLY_IDX:
        pdl.wait()
    if (q_len == 0) | (start >= ctx):  # nothing to do; the merge masks this split out
        return

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    heads = kvh * GROUP + offs_g
    gmask = offs_g < GROUP
    q = tl.load(q_ptr + q_idx.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=gmask[:, None], other=0.0)
    if F16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for s in range(start, end, BLOCK_N):
        offs_n = s + offs_b
        nmask = offs_n < end
        if BT_AHEAD | EARLY_IDX:  # this tile's entries came before; fetch the next tile's
            cur = page.to(tl.int64)
            nxt = offs_n + BLOCK_N
            page = tl.load(bt_row + nxt // BS, mask=nxt < end, other=0)
        else:
            cur = tl.load(bt_row + offs_n // BS, mask=nmask, other=0).to(tl.int64)
        row = offs_n % BS
        k = tl.load(k_ptr + cur[:, None] * stride_kb + row[:, None] * stride_ks
                    + kvh * stride_kh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(v_ptr + cur[:, None] * stride_vb + row[:, None] * stride_vs
                    + kvh * stride_vh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache: exact in bf16 and fp16
        qk = tl.dot(q, tl.trans(k)) * scale_log2                     # [G_PAD, BLOCK_N]
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / l_i[:, None]
    if DIRECT:  # a single split: this is the final output
        tl.store(o_ptr + q_idx.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        # partials: opart [N, H, num_splits, D] (partial_dtype), lse [N, H, num_splits]
        # (log2 units)
        row_nh = (n * H + heads).to(tl.int64)
        tl.store(opart_ptr + (row_nh[:, None] * num_splits + sp) * D + offs_d[None, :],
                 out.to(opart_ptr.dtype.element_ty), mask=gmask[:, None])
        tl.store(lse_ptr + row_nh * num_splits + sp, m_i + tl.log2(l_i), mask=gmask)


@triton.jit
def _decode_split_heads_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr, opart_ptr, lse_ptr, o_ptr,
    scale_log2, num_splits, min_split,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    H: tl.constexpr, KVH: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
):
    """_decode_split_kernel with every KV head in one program (grid (N, 1, num_splits)): each
    token's K and V rows are read whole ([BLOCK_N, KVH D] tiles), not half by one program and
    half by another. Rows r = (kv head h, query g of its group), columns c = (kv head h', dim
    d); q is block-diagonal (zero where h' != h), so one 2-D dot gives every head's scores
    ([KVH G_PAD, BLOCK_N]) and one more every head's P V, of which the diagonal blocks are
    kept: twice the tensor-core work of per-head dots, which decode has to spare."""
    pdl.trigger()  # a PDL-launched successor may start
    pdl.wait()  # PDL: inputs come from the kernel before
    n = tl.program_id(0)
    sp = tl.program_id(2)
    q_idx, q_len, ctx, start, end = _split_range(cu_ptr, ctx_ptr, n, sp, num_splits, BLOCK_N,
                                                 min_split)
    if (q_len == 0) | (start >= ctx):  # nothing to do; the merge masks this split out
        return
    offs_r = tl.arange(0, KVH * G_PAD)
    offs_c = tl.arange(0, KVH * D)
    h_c, d_c = offs_c // D, offs_c % D
    g_r = offs_r % G_PAD
    heads = (offs_r // G_PAD) * GROUP + g_r
    keep = (g_r < GROUP)[:, None] & ((offs_r // G_PAD)[:, None] == h_c[None, :])
    q = tl.load(q_ptr + q_idx.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + d_c[None, :], mask=keep, other=0.0)                    # [KVH G_PAD, KVH D]
    m_i = tl.full([KVH * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([KVH * G_PAD], tl.float32)
    acc = tl.zeros([KVH * G_PAD, KVH * D], tl.float32)
    bt_row = bt_ptr + n.to(tl.int64) * stride_bt
    for s in range(start, end, BLOCK_N):
        offs_n = s + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        page = tl.load(bt_row + offs_n // BS, mask=nmask, other=0).to(tl.int64)
        row = offs_n % BS
        k = tl.load(k_ptr + page[:, None] * stride_kb + row[:, None] * stride_ks
                    + h_c[None, :] * stride_kh + d_c[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(v_ptr + page[:, None] * stride_vb + row[:, None] * stride_vs
                    + h_c[None, :] * stride_vh + d_c[None, :], mask=nmask[:, None], other=0.0)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache: exact in bf16
        # scores [KVH G_PAD, BLOCK_N]; acc [KVH G_PAD, KVH D]
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, tl.dot(q, tl.trans(k)), v,
                                      nmask[None, :], scale_log2, True)

    out = acc / l_i[:, None]
    if DIRECT:  # a single split: this is the final output
        tl.store(o_ptr + q_idx.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + d_c[None, :], out.to(o_ptr.dtype.element_ty), mask=keep)
    else:  # partials: opart [N, H, num_splits, D] (partial_dtype), lse [N, H, num_splits]
        row_nh = (n * H + heads).to(tl.int64)
        tl.store(opart_ptr + (row_nh[:, None] * num_splits + sp) * D + d_c[None, :],
                 out.to(opart_ptr.dtype.element_ty),
                 mask=keep)
        tl.store(lse_ptr + row_nh * num_splits + sp, m_i + tl.log2(l_i), mask=g_r < GROUP)


@triton.jit
def _decode_merge_kernel(opart_ptr, lse_ptr, o_ptr, cu_ptr, ctx_ptr, num_splits, gran,
                         min_split, stride_ot, stride_oh,
                         H: tl.constexpr, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (n, h, d-chunk): o = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)."""
    pdl.trigger()  # a PDL-launched successor may start
    pdl.wait()  # PDL: inputs come from the kernel before
    n = tl.program_id(0)
    h = tl.program_id(1)
    q_idx = tl.load(cu_ptr + n)
    if tl.load(cu_ptr + n + 1) == q_idx:
        return
    D = tl.num_programs(2) * BLOCK_D
    ctx = tl.load(ctx_ptr + n)
    n_valid = tl.cdiv(ctx, _split_len(ctx, num_splits, gran, min_split))  # the rest: unwritten
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    smask = (offs_s < num_splits) & (offs_s < n_valid)
    base = (n * H + h).to(tl.int64) * num_splits
    lse = tl.load(lse_ptr + base + offs_s, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(opart_ptr + (base + offs_s[:, None]) * D + offs_d[None, :],
                   mask=smask[:, None], other=0.0).to(tl.float32)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + q_idx.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty))


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(batch: int, kvh: int, max_context_len: int, num_sms: int,
                  programs_per_sm: int = 2, min_split: int = MIN_SPLIT) -> int:
    """Splits per sequence: one wave of programs that fills the GPU.

    programs_per_sm is how many split programs fit on one SM at once (shared memory of the
    config). batch * kvh * num_splits <= num_sms * programs_per_sm: a second, mostly empty
    wave would cost as long as the first. No more splits than max_context_len / min_split:
    each split writes and re-reads H/kvh * D * 4 bytes of partials.
    """
    splits = max(1, (num_sms * programs_per_sm) // max(1, batch * kvh))
    return max(1, min(splits, MAX_SPLITS, triton.cdiv(max(1, max_context_len), min_split)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, max_context_len: int,
                           num_splits: int | None = None, block_n: int = 64,
                           num_warps: int = 4, num_stages: int = 3,
                           programs_per_sm: int = 2, min_split: int = MIN_SPLIT,
                           bt_ahead: bool = False, early_idx: bool = True,
                           all_heads: bool = False, f16: bool = False,
                           partial_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One new token per sequence (q_len 0 or 1): o [T, H, D] in q.dtype.

    q [T, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D] (q's dtype, or fp8 e4m3,
    widened to q's dtype after the load); block_tables [N, max_blocks]; cu_seqlens_q [N + 1];
    context_lens [N] (including the new token, already stored).
    The K/V address depends on a block-table load, so Triton's pipeliner spends stages on that
    indirection: without early_idx, num_stages=3 leaves one K/V buffer (no overlap) and 5 is
    best; early_idx (the split's cu, ctx and first table entries before the PDL wait, then each
    tile's entries one tile ahead) takes the table loads off the K/V loads' path, and then 3
    stages beat every other count (H200 runs 67-69, perf/RESULTS.md session 17: batch 1 0.47 /
    0.75 / 0.84 of copy at 32K / 128K / 256K against 0.45 / 0.72 / 0.82 for 5 stages without;
    5 stages with it 0.33 / 0.51 / 0.59). bt_ahead: only the entries ahead (same speed at 3
    stages). At batch 1 and 32K this kernel takes ~17 us where loading the same K/V on its
    grid through the table takes ~10.9 us (perf/kernels/diag_decode_floor.py, runs 63-64).
    all_heads (KVH a power of 2): one program per (sequence, split) for every KV head
    (_decode_split_heads_kernel), the splits counted as for one KV head. Its load floor was
    higher (0.76 of copy at 32K instead of 0.72, run 64), the kernel slower: 0.25-0.34 at 32K
    batch 1, 0.38-0.54 at batch 16 (run 67), so off.
    f16 (an fp8 cache and 16-bit q only): the two dots in float16 instead of q's dtype (q
    saturated to +-65504): e4m3 widens to float16 in one instruction per pair (H100 run 96;
    run 99: the dots transposed, K and V^T as first operands, were 2x slower with it).
    partial_dtype: the per-split outputs (normalised, so of v's magnitude) written for the
    merge; bfloat16 halves that traffic (N H num_splits D elements written and read back):
    within the run-to-run spread on an H100 (run 74, perf/RESULTS.md session 18), so fp32.
    """
    T, H, D = q.shape
    N = block_tables.shape[0]
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    group = H // KVH
    o = torch.empty_like(q)
    if T == 0:
        return o
    sms = _num_sms(q.device.index or 0) if q.is_cuda else 4
    all_heads = all_heads and KVH == triton.next_power_of_2(KVH)
    if num_splits is None:
        num_splits = choose_splits(N, 1 if all_heads else KVH, max_context_len, sms,
                                   programs_per_sm, min_split)
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    min_split = triton.cdiv(max(1, min_split), block_n) * block_n
    if num_splits > 1:
        opart = torch.empty((N, H, num_splits, D), dtype=partial_dtype, device=q.device)
        lse = torch.empty((N, H, num_splits), dtype=torch.float32, device=q.device)
    else:
        opart = lse = o  # unused
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, opart, lse, o,
            scale * LOG2E, num_splits, min_split,
            q.stride(0), q.stride(1), o.stride(0), o.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))
    consts = dict(H=H, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=D, BS=BS,
                  BLOCK_N=block_n, DIRECT=num_splits == 1, num_warps=num_warps,
                  num_stages=num_stages, launch_pdl=pdl.ON.value)
    if all_heads:
        _decode_split_heads_kernel[(N, 1, num_splits)](*args, KVH=KVH, **consts)
    else:
        _decode_split_kernel[(N, KVH, num_splits)](*args, BT_AHEAD=bt_ahead,
                                                   EARLY_IDX=early_idx,
                                                   F16=f16 and k_cache.element_size() == 1
                                                   and q.element_size() == 2,
                                                   **consts)
    if num_splits > 1:
        block_d = 32 if D % 32 == 0 else D
        _decode_merge_kernel[(N, H, D // block_d)](
            opart, lse, o, cu_seqlens_q, context_lens, num_splits, block_n, min_split,
            o.stride(0), o.stride(1), H=H, S_PAD=max(16, triton.next_power_of_2(num_splits)),
            BLOCK_D=block_d, num_warps=4, launch_pdl=pdl.ON.value)
    return o
