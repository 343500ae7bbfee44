"""A speculative step's small device work in Triton: one launch each for naive.py's
accept_rows, chain_rows and next_rows (same signatures, same results), one program a sequence.

Why: in PyTorch the work between a step's graph replays is ~100-130 tiny kernels (argmax rows,
acceptance, counting, the MTP block's inputs, the chain's rows, the next check's rows), each a
few microseconds of GPU time whoever launches it: ~0.5 ms of a ~10 ms step on the H100
(perf/RESULTS.md, session 35). Here it is 2 + (k - 1) launches a step, and a step at k = 3
runs within ~0.2 ms of its graphs (400 vs 386 tok/s with the PyTorch ops, a perfect head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# NOSPEC: no runtime argument is specialized (value 1, multiples of 16, pointer alignment), so
# one compile serves every batch, stop list and buffer offset: CheckGraphs.warm_spec_ops
# compiles them when the graphs are captured, not in a request's first step.


@triton.jit(do_not_specialize=list(range(18)))  # (NOSPEC)
def _accept_kernel(a_ptr, toks_ptr, toks_stride, cu_ptr, cap_ptr, stop_ptr, S, slot_ptr,
                   ctx_ptr, lens_ptr, cuc_ptr, mcu_ptr, mslot_ptr, mctx_ptr, mids_ptr,
                   mlast_ptr, pos_ptr, L,
                   ACCEPT_ALL: tl.constexpr, BL: tl.constexpr, BS: tl.constexpr):
    i = tl.program_id(0)
    base = i * L
    j = tl.arange(0, BL)
    jm = j < L
    q = tl.load(cu_ptr + 2 * i + 1) - tl.load(cu_ptr + 2 * i)
    a = tl.load(a_ptr + base + j, mask=jm, other=0)
    if ACCEPT_ALL:
        kept = q
    else:  # 1 + the leading guesses d_j == a_{j-1} (j < q): the first row that misses
        tok = tl.load(toks_ptr + (base + j) * toks_stride, mask=jm, other=0)
        prev = tl.load(a_ptr + base + j - 1, mask=jm & (j >= 1), other=0)
        miss = (j >= 1) & jm & ((tok != prev) | (j >= q))
        kept = tl.min(tl.where(miss, j, L), axis=0)
    kept = tl.where(q > 0, kept, 0)
    s = tl.arange(0, BS)
    stops = tl.load(stop_ptr + i * S + s, mask=s < S, other=-1)  # (-1: no token)
    hit = (tl.sum((a[:, None] == stops[None, :]).to(tl.int32), axis=1) > 0) & jm
    first = tl.min(tl.where(hit, j + 1, L), axis=0)
    m = tl.minimum(tl.minimum(kept.to(tl.int64), first.to(tl.int64)), tl.load(cap_ptr + i))
    tl.store(lens_ptr + i, m)
    end = (base + m).to(tl.int32)
    tl.store(cuc_ptr + 2 * i + 1, end)
    tl.store(cuc_ptr + 2 * i + 2, (base + L).to(tl.int32))
    tl.store(mcu_ptr + 2 * i + 1, end)
    tl.store(mcu_ptr + 2 * i + 2, (base + L).to(tl.int32))
    if i == 0:
        tl.store(cuc_ptr, 0)
        tl.store(mcu_ptr, 0)
    live = j < m
    slot = tl.load(slot_ptr + base + j, mask=jm, other=-1)
    tl.store(mslot_ptr + base + j, tl.where(live, slot, -1), mask=jm)
    ctx = tl.load(ctx_ptr + base + j, mask=jm, other=1)
    tl.store(mctx_ptr + base + j, tl.where(live, ctx, 1), mask=jm)
    tl.store(mids_ptr + base + j, a, mask=jm)
    tl.store(mlast_ptr + i, tl.maximum(base + m - 1, 0))
    ctx0 = tl.load(ctx_ptr + base).to(tl.int64)
    tl.store(pos_ptr + i, tl.where(m > 0, ctx0 - 1 + m, 0))


@triton.jit(do_not_specialize=list(range(19)))  # (NOSPEC)
def _chain_kernel(lens_ptr, pos_ptr, tab_ptr, tab_stride, block_size, h_ptr, h_stride,
                  guess_ptr, mcu_ptr, mslot_ptr, mctx_ptr, mh_ptr, mh_stride, mids_ptr,
                  mlast_ptr, out_ptr, out_stride, L, D, BL: tl.constexpr, BD: tl.constexpr):
    i = tl.program_id(0)
    first = i * L
    m = tl.load(lens_ptr + i)
    p = tl.load(pos_ptr + i)
    g = tl.load(guess_ptr + i)
    last = tl.load(mlast_ptr + i)
    tl.store(out_ptr + i * out_stride, g)
    live = m > 0
    pp = tl.where(live, p, 0)
    blk = tl.load(tab_ptr + i * tab_stride + pp // block_size).to(tl.int64)
    slot = blk * block_size + pp % block_size
    tl.store(mcu_ptr + 2 * i + 1, (first + tl.where(live, 1, 0)).to(tl.int32))
    tl.store(mcu_ptr + 2 * i + 2, (first + L).to(tl.int32))
    if i == 0:
        tl.store(mcu_ptr, 0)
    j = tl.arange(0, BL)
    jm = j < L
    row0 = (j == 0) & live
    tl.store(mslot_ptr + first + j, tl.where(row0, slot, -1), mask=jm)
    tl.store(mctx_ptr + first + j, tl.where(row0, p + 1, 1).to(tl.int32), mask=jm)
    for d0 in range(0, D, BD):  # the block's output at the last row -> its next row's input
        dd = d0 + tl.arange(0, BD)
        x = tl.load(h_ptr + last * h_stride + dd, mask=dd < D)
        tl.store(mh_ptr + first * mh_stride + dd, x, mask=dd < D)
    tl.store(mids_ptr + first, g)
    tl.store(mlast_ptr + i, first.to(tl.int64))
    tl.store(pos_ptr + i, p + 1)


@triton.jit(do_not_specialize=list(range(19)))  # (NOSPEC)
def _next_kernel(a_ptr, lens_ptr, g_ptr, g_stride, cap_ptr, stop_ptr, S, ng_ptr, M, ctx_ptr,
                 tab_ptr, tab_stride, block_size, pad_id, slots0_ptr, cu_ptr, slots_ptr,
                 sm_ptr, L, BL: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr):
    i = tl.program_id(0)
    base = i * L
    m = tl.load(lens_ptr + i)
    last = tl.maximum(m - 1, 0)
    tok = tl.load(a_ptr + base + last)
    s = tl.arange(0, BS)
    stops = tl.load(stop_ptr + i * S + s, mask=s < S, other=-1)
    stopped = (m > 0) & (tl.sum((stops == tok).to(tl.int32), axis=0) > 0)
    cap = tl.load(cap_ptr + i)
    cap = tl.where(stopped, 0, cap - m)
    live = (m > 0) & (cap > 0)
    ctx0 = tl.load(ctx_ptr + base).to(tl.int64)
    # row j's window: element c is token x = j + c of [the M - 1 tokens before a[last] (its
    # row's window but the first), a[last], the guesses]
    jj = tl.arange(0, BL)[:, None]
    cc = tl.arange(0, BM)[None, :]
    x = jj + cc
    wm = (jj < L) & (cc < M)
    hist = tl.load(ng_ptr + (base + last) * M + 1 + x, mask=wm & (x < M - 1), other=0)
    gv = tl.load(g_ptr + i * g_stride + (x - M), mask=wm & (x >= M), other=0)
    win = tl.where(x < M - 1, hist, tl.where(x == M - 1, tok, gv))
    win = tl.where(live, win, pad_id)
    tl.debug_barrier()  # (this sequence's rows were read above; now they are rewritten)
    tl.store(cap_ptr + i, cap)
    tl.store(ng_ptr + (base + jj) * M + cc, win, mask=wm)
    j = tl.arange(0, BL)
    jm = j < L
    pos = tl.where(live, ctx0 - 1 + m + j, 0)
    blk = tl.load(tab_ptr + i * tab_stride + pos // block_size, mask=jm, other=0).to(tl.int64)
    tl.store(sm_ptr + base + j, tl.where(live, blk * block_size + pos % block_size, -1),
             mask=jm)
    tl.store(ctx_ptr + base + j, tl.where(live, pos + 1, 1).to(tl.int32), mask=jm)
    tl.store(cu_ptr + 2 * i + 1, (base + tl.where(live, L, 0)).to(tl.int32))
    tl.store(cu_ptr + 2 * i + 2, (base + L).to(tl.int32))
    if i == 0:
        tl.store(cu_ptr, 0)
    tl.store(slots_ptr + 2 * i, tl.where(live, tl.load(slots0_ptr + i), -1))


def _p2(x: int) -> int:
    return max(2, triton.next_power_of_2(x))


def _stops(S: int) -> int:  # (one compile for up to 8 stop ids a sequence)
    return max(8, _p2(S))


def accept_rows(a: torch.Tensor, toks: torch.Tensor, cu: torch.Tensor, cap: torch.Tensor,
                stop: torch.Tensor, slot_mapping: torch.Tensor, ctx: torch.Tensor,
                lens: torch.Tensor, cu_commit: torch.Tensor, m_cu: torch.Tensor,
                m_slot: torch.Tensor, m_ctx: torch.Tensor, m_ids: torch.Tensor,
                m_last: torch.Tensor, pos: torch.Tensor, accept_all: bool = False) -> None:
    """naive.accept_rows (a [n, L] contiguous; toks [n, L] any row stride, e.g. the n-gram
    windows' last column)."""
    n, L = a.shape
    S = stop.shape[1]
    _accept_kernel[(n,)](a, toks, toks.stride(1), cu, cap, stop, S, slot_mapping, ctx, lens,
                         cu_commit, m_cu, m_slot, m_ctx, m_ids, m_last, pos, L,
                         ACCEPT_ALL=accept_all, BL=_p2(L), BS=_stops(S))


def chain_rows(lens: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor, block_size: int,
               h: torch.Tensor, guess: torch.Tensor, m_cu: torch.Tensor, m_slot: torch.Tensor,
               m_ctx: torch.Tensor, m_hidden: torch.Tensor, m_ids: torch.Tensor,
               m_last: torch.Tensor, out: torch.Tensor) -> None:
    """naive.chain_rows (out [n] any stride: a column of the step's results)."""
    n = lens.shape[0]
    L, D = m_slot.shape[0] // n, h.shape[1]
    _chain_kernel[(n,)](lens, pos, tables, tables.stride(0), block_size, h, h.stride(0), guess,
                        m_cu, m_slot, m_ctx, m_hidden, m_hidden.stride(0), m_ids, m_last, out,
                        out.stride(0), L, D, BL=_p2(L), BD=min(1024, _p2(D)))


def next_rows(a: torch.Tensor, lens: torch.Tensor, guesses: torch.Tensor, cap: torch.Tensor,
              stop: torch.Tensor, ngram_ids: torch.Tensor, ctx: torch.Tensor,
              tables: torch.Tensor, block_size: int, pad_id: int, slots0: torch.Tensor,
              cu: torch.Tensor, slots: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """naive.next_rows (guesses [n, k] with unit column stride)."""
    n, L = a.shape
    S, M = stop.shape[1], ngram_ids.shape[1]
    _next_kernel[(n,)](a, lens, guesses, guesses.stride(0), cap, stop, S, ngram_ids, M, ctx,
                       tables, tables.stride(0), block_size, pad_id, slots0, cu, slots,
                       slot_mapping, L, BL=_p2(L), BS=_stops(S), BM=_p2(M))
