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


XMAX = 127 * 128 + 63  # largest |xi| of gemv_i8's digits: d1 in [-127, 127], d0 in [-64, 63]


def naive_x_digits(x: torch.Tensor, bits: int, group_size: int = 128, swiglu: bool = False,
                   xmax: int = XMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, K] -> x's int8 digits for gemv_i8.py (its docstring has the math), in the order
    its PTX reads them: (xd int32 [2, K / G, WA, NB], xg fp32 [K / G, 2] = (sx, sx sum xi)).
    xd[d, grp] holds digit d (0: d1, 1: d0) of k = grp G + (NB b + e) WA + r (pack.py's
    slot-major layout; byte b of register (r, e)), then reordered: 4-bit (NB = 2) per pair of
    rows (2p, 2p + 1) as (2p, e 0), (2p + 1, e 0), (2p, e 1), (2p + 1, e 1); 2 and 3 bits
    (NB = 4, the 2-bit plane's order) e 0, 2, 1, 3. swiglu: x [1, 2K] = (gate, up) and the
    digits of SiLU(gate) * up rounded to x's dtype."""
    if swiglu:
        k = x.shape[-1] // 2
        gate, up = x[..., :k].float(), x[..., k:].float()
        x = (gate * torch.sigmoid(gate) * up).to(x.dtype)
    k, g = x.shape[-1], group_size
    wa, n_b = g * (4 if bits == 4 else 2) // 32, 2 if bits == 4 else 4
    xk = x.float().reshape(k // g, g)
    amax = xk.abs().amax(1, keepdim=True)
    sx = torch.where(amax > 0, amax / xmax, torch.ones_like(amax))
    inv = xmax / torch.where(amax > 0, amax, torch.ones_like(amax))
    xi = torch.floor(xk * inv + 0.5).clamp(-xmax, xmax).to(torch.int32)
    d1 = torch.div(xi + 64, 128, rounding_mode="floor")
    d0 = xi - 128 * d1
    r = torch.arange(wa).view(wa, 1, 1)
    e = torch.arange(n_b).view(1, n_b, 1)
    b = torch.arange(4).view(1, 1, 4)
    kl = ((n_b * b + e) * wa + r).reshape(-1).to(x.device)  # [WA * NB * 4]
    digs = torch.stack([d1, d0])[:, :, kl].reshape(2, k // g, wa, n_b, 4).to(torch.int8)
    xd = digs.contiguous().view(torch.int32).reshape(2, k // g, wa, n_b)
    if n_b == 2:
        xd = xd.reshape(2, k // g, wa // 2, 2, 2).transpose(3, 4).reshape(2, k // g, wa, 2)
    else:
        xd = xd[..., [0, 2, 1, 3]]
    xg = torch.cat([sx, sx * xi.sum(1, keepdim=True).float()], 1)
    return xd.contiguous(), xg.contiguous()
