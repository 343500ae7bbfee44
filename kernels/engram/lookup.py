"""Host-table lookups done by the GPU: the kernel reads pinned host memory in place (unified
virtual addressing), so a decode step needs no host gather, no staging copy and no wait for the
sampled token on the host, and the lookups are captured in the step's CUDA graph.

Each program copies one BLOCK_D-wide piece of one row: rows of 512 B (Engram) to 10 KiB
(embedding) cross PCIe as many small reads in flight, which hides the link's latency.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from volundr.kernels.engram.naive import HASH_MASK, HASH_MULT

_MULT = tl.constexpr(HASH_MULT)  # jit code reads module globals only as constexpr
_MASK = tl.constexpr(HASH_MASK)


@triton.jit
def _lookup_kernel(ids_ptr, table_ptr, off_ptr, size_ptr, order_ptr, seed_ptr, out_ptr,
                   D, stride_ids, stride_tab, stride_out,
                   M: tl.constexpr, HASH: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    ids_row = ids_ptr + t.to(tl.int64) * stride_ids
    if HASH:
        n = tl.load(order_ptr + j)
        h = tl.load(seed_ptr + j)
        for c in tl.static_range(M):  # the last n of the M columns, oldest first
            idc = tl.load(ids_row + c)
            h = tl.where(c >= M - n, ((h ^ idc) * _MULT) & _MASK, h)
        row = tl.load(off_ptr + j) + h % tl.load(size_ptr + j)
    else:
        row = tl.load(ids_row + M - 1).to(tl.int64)
    mask = d < D
    x = tl.load(table_ptr + row * stride_tab + d, mask=mask)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + j * D + d,
             x.to(out_ptr.dtype.element_ty), mask=mask)


def _block(D: int) -> int:
    return min(1024, triton.next_power_of_2(D))


def embedding_lookup(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, D] = table[ids[:, -1]]. ids [T, m] long on the GPU (the last column is the
    token); table [V, D] pinned host memory (or on the GPU); out on the GPU, any float dtype."""
    T, m = ids.shape
    D = table.shape[1]
    if T:
        grid = (T, 1, triton.cdiv(D, _block(D)))
        _lookup_kernel[grid](ids, table, ids, ids, ids, ids, out, D, ids.stride(0),
                             table.stride(0), out.stride(0), M=m, HASH=False, BLOCK_D=_block(D))
    return out


def engram_lookup(ids: torch.Tensor, table: torch.Tensor, offsets: torch.Tensor,
                  sizes: torch.Tensor, orders: torch.Tensor, seeds: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """out [T, J * D]: Engram's hashed rows (naive.engram_rows) of J tables stored back to back
    in `table` [sum p_j, D] (pinned host memory or on the GPU); table j starts at offsets[j].
    ids [T, m] long on the GPU; offsets, sizes, seeds [J] int64 and orders [J] int32 on the GPU."""
    T, m = ids.shape
    J, D = offsets.shape[0], table.shape[1]
    if T:
        grid = (T, J, triton.cdiv(D, _block(D)))
        _lookup_kernel[grid](ids, table, offsets, sizes, orders, seeds, out, D, ids.stride(0),
                             table.stride(0), out.stride(0), M=m, HASH=True, BLOCK_D=_block(D))
    return out
