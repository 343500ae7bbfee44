"""Reference RMSNorm (with optional fused residual add, or a sigmoid output gate) and SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    """y = x / rms(x) * weight over the last dim, math in fp32.

    With `residual`, first x = x + residual and returns (y, x): the pre-norm sum is the next
    residual stream. Without, returns y.
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return (y, x) if residual is not None else y


def naive_rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """KDA's output norm: RMSNorm(x) (rounded to x.dtype) * sigmoid(gate), math in fp32, out in
    x.dtype. x, gate [..., C]; weight [C]."""
    y = naive_rms_norm(x, weight, eps)
    return (y.float() * torch.sigmoid(gate.float())).to(x.dtype)


def naive_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, elementwise."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
