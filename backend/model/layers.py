"""Small building blocks shared by the layers: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from volundr import ops
from volundr.model.parallel import TP, ColumnParallelLinear, RowParallelLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, returns (norm(x + residual), x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class MLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)); with tensor parallelism each rank holds intermediate / tp."""

    def __init__(self, hidden: int, intermediate: int, tp: TP = TP()):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, tp)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp)  # all-reduces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))
