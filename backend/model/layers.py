"""Small building blocks shared by the layers: RMSNorm, fused projections and the SwiGLU MLP."""

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


class PreNorm:
    """RMSNorm(x + residual), not computed yet: the input of a layer's mixer or MLP. The linear
    that reads it may fold the residual add and the norm into its own matmul (the mixed-bit
    GEMV at M = 1, `QuantLinear.forward`), saving the norm's launch; anything else calls
    `value()`. Either way `residual_out` then holds x + residual, the next residual stream."""

    def __init__(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm):
        self.x, self.residual, self.norm = x, residual, norm
        self.residual_out: torch.Tensor | None = None
        self._value: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def value(self) -> torch.Tensor:
        """norm(x + residual) (once; later calls return the same tensor)."""
        if self._value is None:
            self._value, self.residual_out = self.norm(self.x, residual=self.residual)
        return self._value


class GroupScaled:
    """x [T, H * D] whose head h (D channels) is still to be multiplied by
    rsqrt(sum(ss[:, h]) / D + eps), ss [T, H, P] fp32 partial sums of squares: KDA's gated
    output norm with its per-head RMS scale left to o_proj, which folds it into its GEMV at
    M = 1 (`QuantLinear.forward`); anything else calls `value()`."""

    def __init__(self, x: torch.Tensor, ss: torch.Tensor, eps: float):
        self.x, self.ss, self.eps = x, ss, eps

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def row_ss(self) -> torch.Tensor:
        """ss as the GEMVs take it: [H, P] for one row, [T, H, P] for several."""
        return self.ss[0] if self.x.shape[0] == 1 else self.ss

    def value(self) -> torch.Tensor:
        t, hd = self.x.shape
        h = self.ss.shape[1]
        r = torch.rsqrt(self.ss.sum(-1) / (hd // h) + self.eps)  # [T, H]
        return (self.x.view(t, h, -1).float() * r[..., None]).to(self.x.dtype).view(t, hd)


class Normed:
    """RMSNorm(h) of a residual stream h = `residual_out` that a layer's output projection has
    made (h = y + residual, in its GEMV's epilogue), held as xw = h * weight [T, d] and fp32
    partial sums of squares ss [T, P], the scale rsqrt(sum(ss) / d + eps) left to the next
    input projection, which folds it into its GEMV at M = 1 (`QuantLinear.forward`); anything
    else calls `value()`. digits: xw's int8 digits where the epilogue wrote them (for a next
    GEMV on gemv_i8, kernels/quant/digits.py), else None."""

    def __init__(self, xw: torch.Tensor, ss: torch.Tensor, eps: float,
                 residual_out: torch.Tensor, digits: torch.Tensor | None = None):
        self.xw, self.ss, self.eps, self.residual_out = xw, ss, eps, residual_out
        self.digits = digits
        self._value: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.xw.shape

    def value(self) -> torch.Tensor:
        if self._value is None:
            r = torch.rsqrt(self.ss.sum(-1, keepdim=True) / self.xw.shape[-1] + self.eps)
            self._value = (self.xw.float() * r).to(self.xw.dtype)
        return self._value


class NextNorm:
    """What a layer's output projection may fold into its epilogue: the residual add and the
    next RMSNorm `norm`. The residual stream comes from `src` (a PreNorm or Normed: its
    residual_out, known once the layer's input projection has run; or the tensor itself)."""

    def __init__(self, src, norm: RMSNorm, defer: bool = False):
        self.src, self.norm, self.defer = src, norm, defer

    @property
    def residual(self) -> torch.Tensor:
        s = self.src
        return s.residual_out if isinstance(s, (PreNorm, Normed)) else s


class PendingOut:
    """A mixer's output projection not run yet (`out_proj` with a deferring post): held back
    so that the MLP after it may run it in one launch with its own two GEMVs
    (`MLP.forward_chained`); value() runs it as out_proj would have."""

    def __init__(self, linear: nn.Module, x, post: NextNorm):
        self.linear, self.x, self.post = linear, x, post

    def value(self):
        return out_proj(self.linear, self.x, NextNorm(self.post.src, self.post.norm))


def out_proj(linear: nn.Module, x, post: NextNorm | None, swiglu: bool = False):
    """A layer's output projection linear(x) (swiglu: see QuantLinear.forward). With `post`,
    where the linear folds them (a mixed-bit GEMV at M = 1, `forward_residual_norm`), the
    residual add and the next norm too: then a Normed (residual_out = y + residual). A post
    with `defer` (the decoder layer's, where its MLP may chain): a PendingOut instead."""
    if post is not None and post.defer and not swiglu:
        return PendingOut(linear, x, post)
    fold = getattr(linear, "forward_residual_norm", None)
    if post is not None and fold is not None:
        y = fold(x, post, swiglu)
        if y is not None:
            return y
    return linear(x, swiglu=True) if swiglu else linear(x)


def materialize(x):
    """x itself, or the value of a PreNorm, GroupScaled or Normed."""
    return x.value() if isinstance(x, (PreNorm, GroupScaled, Normed)) else x


class FusedLinear(nn.Module):
    """Linears that read the same input, as one: forward(x) = cat([m(x) for m in mods], -1).

    One matmul over the concatenated weights when they can share one (plain or column-parallel
    nn.Linear, or QuantLinear of one bit width and group size): at decode, a launch and a
    mostly idle small GEMV saved per projection. Otherwise the parts run one after another.
    Built after loading (the checkpoint keeps the separate tensors).

    pad_to: a fused mixed-bit layer gets zero output rows up to a multiple of it, so that an
    odd total (KDA's projections: 15656) still takes the kernels' unmasked whole-tile paths;
    forward then returns the padded width (`out_features` is the true one)."""

    def __init__(self, mods: list[nn.Module], pad_to: int = 1):
        super().__init__()
        from volundr.model.quant_linear import QuantLinear  # it imports this package

        self.out_features = sum(m.out_features for m in mods)
        self.fused = _concat_linears(mods, pad_to)
        self.parts = None if self.fused is not None else nn.ModuleList(mods)
        self.takes_prenorm = isinstance(self.fused, QuantLinear)  # it may fold the norm

    def forward(self, x: torch.Tensor | PreNorm | Normed) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x if self.takes_prenorm else materialize(x))
        x = materialize(x)
        return torch.cat([m(x) for m in self.parts], dim=-1)


def _concat_linears(mods: list[nn.Module], pad_to: int) -> nn.Module | None:
    from volundr.model.quant_linear import QuantLinear  # it imports this package

    if all(type(m) in (nn.Linear, ColumnParallelLinear) for m in mods):
        w = torch.cat([m.weight.detach() for m in mods])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        fused.weight = nn.Parameter(w, requires_grad=False)
        return fused
    if all(isinstance(m, QuantLinear) for m in mods):
        return QuantLinear.concat(mods, pad_to)
    return None


class GroupedLinear(nn.Module):
    """Linears of one shape, each on its own input, as one launch where they share a mixed-bit
    format: forward(x [T, J, in]) = cat([m(x[:, j]) for j, m], -1) (KDA's f_b and g_b on the
    two low-rank halves). Built after loading."""

    def __init__(self, mods: list[nn.Module]):
        super().__init__()
        from volundr.model.quant_linear import QuantLinear  # it imports this package

        same = all(isinstance(m, QuantLinear) and m.out_features == mods[0].out_features
                   for m in mods)
        self.fused = QuantLinear.concat(mods) if same else None
        self.parts = None if self.fused is not None else nn.ModuleList(mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.forward_grouped(x)
        return torch.cat([m(x[:, j]) for j, m in enumerate(self.parts)], dim=-1)


class MLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)); with tensor parallelism each rank holds intermediate / tp."""

    def __init__(self, hidden: int, intermediate: int, tp: TP = TP()):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, tp)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp)  # all-reduces
        self.gate_up_proj: FusedLinear | None = None
        self.swiglu_in_down = False

    def after_load(self) -> None:
        from volundr.model.quant_linear import QuantLinear  # it imports this package

        self.gate_up_proj = FusedLinear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj
        # a mixed-bit down projection takes (gate, up) and applies the SwiGLU itself
        self.swiglu_in_down = isinstance(self.down_proj, QuantLinear)

    def forward_chained(self, p: PendingOut, norm: RMSNorm):
        """The mixer's pending output projection, this MLP and the next norm `norm` in one
        launch (the mixed-bit GEMVs at M = 1 on one rank, `QuantLinear.forward_tail_chain`):
        (the residual stream after the mixer, the Normed of the MLP's output), or None."""
        chain = getattr(self.down_proj, "forward_tail_chain", None)
        if chain is None or not self.gate_up_proj.takes_prenorm:
            return None
        return chain(p.linear, self.gate_up_proj.fused, p.x, p.post, norm)

    def forward(self, x: torch.Tensor | PreNorm | Normed, post: NextNorm | None = None):
        """The MLP's output; with `post`, possibly the Normed of the next norm (`out_proj`)."""
        chain = getattr(self.down_proj, "forward_mlp_chain", None)
        if (chain is not None and post is not None and isinstance(x, Normed)
                and self.gate_up_proj.takes_prenorm):
            y = chain(self.gate_up_proj.fused, x, post)  # both GEMVs in one launch, or None
            if y is not None:
                return y
        gate_up = self.gate_up_proj(x)
        if self.swiglu_in_down:
            return out_proj(self.down_proj, gate_up, post, swiglu=True)
        return out_proj(self.down_proj, ops.swiglu(*gate_up.chunk(2, dim=-1)), post)
