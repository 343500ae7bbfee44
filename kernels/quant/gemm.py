"""Prefill alternative: dequantise the kernel layout to bf16 W^T in Triton, then cuBLAS.

For large M the matmul dominates and cuBLAS's bf16 GEMM is the fastest one there is; the cost
is writing and re-reading 2 bytes per weight (chunks of CHUNK_N output features at a time, so
the temporary stays small even for lm_head). `engine.py` picks between this and the fused
tensor-core path of `gemv.py` by M (see perf/RESULTS.md for the measured crossover).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_N = 8192


@triton.jit
def dequant_kernel(qa_ptr, qb_ptr, sz_ptr, w_ptr, N, n0, n1, stride_w,
                   BITS: tl.constexpr, PA: tl.constexpr, WA: tl.constexpr, G: tl.constexpr,
                   BN: tl.constexpr):
    """W^T[k, n - n0] = (q[n, k] - z) * s for group g = program_id(1), n0 <= n < n1."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    cn = pid_n * BN + tl.arange(0, BN)  # column within the chunk
    rn = n0 + cn
    nmask = rn < n1
    r = tl.arange(0, WA)
    a = tl.load(qa_ptr + (g * WA + r)[:, None] * N + rn[None, :], mask=nmask[None, :], other=0)
    if BITS == 3:
        H: tl.constexpr = WA // 2
        b = tl.load(qb_ptr + (g * H + r % H)[:, None] * N + rn[None, :], mask=nmask[None, :],
                    other=0)
        b = b << (r >= H).to(tl.int32)[:, None]  # hi bit of slot i at bit 2i + 1 in both halves
    szw = tl.load(sz_ptr + g * N + rn, mask=nmask, other=0)
    s = (szw << 16).to(tl.float32, bitcast=True)[None, :]
    z = (szw & -65536).to(tl.float32, bitcast=True)[None, :]
    for i in tl.static_range(32 // PA):
        q = (a >> (PA * i)) & ((1 << PA) - 1)
        if BITS == 3:
            q = q | (((b >> (2 * i + 1)) & 1) << 2)
        w = (q.to(tl.float32) - z) * s
        rows = g * G + i * WA + r
        tl.store(w_ptr + rows.to(tl.int64)[:, None] * stride_w + cn[None, :],
                 w.to(w_ptr.dtype.element_ty), mask=nmask[None, :])


def dequantize_t(qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor, bits: int,
                 group_size: int, in_features: int, n0: int = 0, n1: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
                 bn: int = 64) -> torch.Tensor:
    """W^T [K, n1 - n0] for output features n0 .. n1 (a column chunk), on the GPU."""
    n = qa.shape[1]
    n1 = n if n1 is None else n1
    pa = 4 if bits == 4 else 2
    if out is None:
        out = torch.empty(in_features, n1 - n0, dtype=dtype, device=qa.device)
    grid = (triton.cdiv(n1 - n0, bn), in_features // group_size)
    dequant_kernel[grid](qa, qb if qb.numel() else qa, sz, out, n, n0, n1, out.stride(0),
                         BITS=bits, PA=pa, WA=group_size * pa // 32, G=group_size, BN=bn,
                         num_warps=4)
    return out


def dequant_matmul(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor,
                   bits: int, group_size: int, out: torch.Tensor | None = None,
                   chunk_n: int = CHUNK_N) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T: dequantise CHUNK_N features at a time, matmul on cuBLAS."""
    m, k = x.shape
    n = qa.shape[1]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    buf = None
    for n0 in range(0, n, chunk_n):
        n1 = min(n, n0 + chunk_n)
        if buf is None or buf.shape[1] != n1 - n0:
            buf = torch.empty(k, n1 - n0, dtype=x.dtype, device=x.device)
        dequantize_t(qa, qb, sz, bits, group_size, k, n0, n1, x.dtype, buf)
        if n1 - n0 == n:
            torch.matmul(x, buf, out=out)
        else:
            out[:, n0:n1] = x @ buf
    return out
