"""Naive references for mixed-bit linears: dequantize, then an ordinary matmul.

Formats are defined in `pack.py`: W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G].
"""

from __future__ import annotations

import torch

from volundr.kernels.quant.pack import from_kernel_layout, unpack_bitstream, unpack_scale_zero


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] ints, scales/zeros [N, K/G] -> W [N, K] in `dtype` (math in fp32)."""
    n, k = q.shape
    g = k // scales.shape[1]
    qf = q.to(torch.float32).view(n, k // g, g)
    w = (qf - zeros.to(torch.float32).unsqueeze(-1)) * scales.to(torch.float32).unsqueeze(-1)
    return w.view(n, k).to(dtype)


def dequantize_checkpoint(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Checkpoint tensors (uint8 bit stream [N, K*b/8], bf16 [N, K/G] x2) -> W [N, K]."""
    return dequantize(unpack_bitstream(qweight, bits), scales, zeros, dtype)


def dequantize_kernel_layout(qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor, bits: int,
                             group_size: int, in_features: int,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Kernel-layout buffers of a QuantLinear -> W [N, K]."""
    q = from_kernel_layout(qa, qb, bits, group_size, in_features)
    s, z = unpack_scale_zero(sz)
    return dequantize(q, s, z, dtype)


def naive_quant_matmul(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor,
                       bits: int, group_size: int, in_features: int) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype (fp32 math)."""
    w = dequantize_kernel_layout(qa, qb, sz, bits, group_size, in_features, torch.float32)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)
