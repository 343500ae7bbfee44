"""Mixed 2/3/4-bit linears: `QuantLinear` and the load-time swap of a model's nn.Linear modules.

A "volundr-mixed" checkpoint (config.json `quantization_config = {"method": "volundr-mixed",
"group_size": 128, "bits": {module: 2|3|4}}`) stores for each listed linear X, W [out, in]:
  X.qweight  uint8 [out, in * b / 8]  little-endian bit stream of q along the input dim
  X.scales   bf16  [out, in / G]      X.zeros  bf16 [out, in / G]
with W ~= (q - zeros) * scales per group of G inputs (exact definition: volundr.kernels.quant.
pack). G = `group_size_for(in, group_size)` (128, or min(128, in) for small models); the loader
reads it back from the scales' shape, so a tensor-parallel shard (fewer inputs) works too.

At load `apply_quantization` repacks every listed module into the kernels' layout (3-bit as a
2-bit plane plus a 1-bit plane: every load an aligned 32-bit word) and drops its checkpoint
tensors from the state dict, so the rest loads as before. On CUDA `forward` runs the Triton
kernels of volundr.kernels.quant.engine; on the CPU (or VOLUNDR_NAIVE=1) the naive reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from volundr import ops
from volundr.config import VolundrConfig
from volundr.kernels.quant.naive import dequantize_kernel_layout, naive_quant_matmul
from volundr.kernels.quant.pack import (
    group_size_for,
    pack_scale_zero,
    plane_bits,
    to_kernel_layout,
    unpack_bitstream,
)
from volundr.model.layers import GroupScaled, NextNorm, Normed, PreNorm
from volundr.model.parallel import TP, ParallelLMHead, RowParallelLinear, all_reduce
from volundr.model.weights import expected_tensors

SUFFIXES = ("qweight", "scales", "zeros")


class QuantLinear(nn.Module):
    """y = x @ W^T with W held as (qa, qb, sz) in the kernel layout (non-persistent buffers).

    `parallel` keeps the tensor-parallel semantics of the module it replaces: "row" all-reduces
    the partial output (RowParallelLinear), "lm_head" gathers the vocab shards on rank 0."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int,
                 device: torch.device | str | None = None, parallel: str | None = None,
                 tp: TP = TP()):
        super().__init__()
        pa = plane_bits(bits)
        if in_features % group_size or group_size % 32:
            raise ValueError(f"group size {group_size} must be a multiple of 32 dividing "
                             f"in_features {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.parallel, self.tp = parallel, tp
        n, k = out_features, in_features
        kw = dict(dtype=torch.int32, device=device)
        self.register_buffer("qa", torch.zeros(k * pa // 32, n, **kw), persistent=False)
        self.register_buffer("qb", torch.zeros(k // 32 if bits == 3 else 0, n, **kw),
                             persistent=False)
        self.register_buffer("sz", torch.zeros(k // group_size, n, **kw), persistent=False)

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       bits: int, **kw) -> QuantLinear:
        """From q [out, in] (uint8 values) and bf16 scales/zeros [out, in / G]."""
        n, k = q.shape
        layer = cls(k, n, bits, k // scales.shape[1], device=q.device, **kw)
        qa, qb = to_kernel_layout(q, bits, layer.group_size)
        layer.qa.copy_(qa)
        layer.qb.copy_(qb)
        layer.sz.copy_(pack_scale_zero(scales, zeros))
        return layer

    @classmethod
    def from_checkpoint(cls, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        bits: int, device: torch.device | str | None = None,
                        **kw) -> QuantLinear:
        """From the checkpoint tensors; repacks on `device` (default: qweight's), a band of
        output rows at a time: unpacking widens codes to int64, and done at once for lm_head
        (262144 x 5120) that would be a 5 GiB temporary inside a 16 GiB budget."""
        device = qweight.device if device is None else torch.device(device)
        n, k = qweight.shape[0], qweight.shape[1] * 8 // bits
        layer = cls(k, n, bits, k // scales.shape[1], device=device, **kw)
        step = max(256, 2**24 // k)  # int64 temporaries of <= ~128 MiB
        for r in range(0, n, step):
            q = unpack_bitstream(qweight[r:r + step].to(device), bits)
            qa, qb = to_kernel_layout(q, bits, layer.group_size)  # output rows are the last dim
            layer.qa[:, r:r + step].copy_(qa)
            if bits == 3:
                layer.qb[:, r:r + step].copy_(qb)
        layer.sz.copy_(pack_scale_zero(scales.to(device), zeros.to(device)))
        return layer

    @classmethod
    def concat(cls, mods: list[QuantLinear], pad_to: int = 1) -> QuantLinear | None:
        """One layer whose outputs are the outputs of `mods` side by side (same input), then
        zero rows (scale 0: outputs exactly 0) up to a multiple of `pad_to`; or None when they
        differ in bit width, group size, input width or parallel role."""
        a = mods[0]
        if any((m.bits, m.group_size, m.in_features, m.parallel) !=
               (a.bits, a.group_size, a.in_features, None) for m in mods):
            return None
        n = sum(m.out_features for m in mods)
        n_pad = -n % pad_to
        layer = cls(a.in_features, n + n_pad, a.bits, a.group_size, device="meta", tp=a.tp)
        for name in ("qa", "qb", "sz"):  # kernel layout: output features are the last dim
            parts = [getattr(m, name) for m in mods]
            parts.append(parts[0].new_zeros(parts[0].shape[0], n_pad))
            setattr(layer, name, torch.cat(parts, dim=1))
        return layer

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in]."""
        return dequantize_kernel_layout(self.qa, self.qb, self.sz, self.bits, self.group_size,
                                        self.in_features, dtype)

    def forward(self, x: torch.Tensor | PreNorm | GroupScaled | Normed,
                swiglu: bool = False) -> torch.Tensor | None:
        """x [..., in]; swiglu: x [..., 2 in] holds (gate, up) and the input is SiLU(gate) * up
        (on CUDA fused into the decode kernels' x loads: the MLP's SwiGLU launch saved).
        x a PreNorm [T, in]: where the kernels can, the residual add and RMSNorm run inside
        the matmul (ops-level `quant_matmul_rms_norm`); otherwise the norm runs first. x a
        GroupScaled (KDA's gated output norm, per-head scale pending): likewise at M = 1
        (`quant_matmul_group_scaled`). x a Normed (the previous output projection made h and
        h w): the norm's 1 / rms scales the GEMV's y (`quant_matmul_rscaled`)."""
        if isinstance(x, (PreNorm, GroupScaled, Normed)):
            if isinstance(x, PreNorm):
                y = self._forward_prenorm(x)
            else:
                y = self._forward_scaled(x) if isinstance(x, GroupScaled) else self._rscaled(x)
            if y is not None:
                return self._finish(y)
            x = x.value()
        if self.qa.device != x.device:  # built on the host (apply_quantization without device)
            self.to(x.device)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features * (2 if swiglu else 1))
        fast = ops._fast(x2, "quant")
        if x2.shape[0] == 0:
            y = x2.new_empty(0, self.out_features)
        elif fast is not None:
            y = fast.quant_matmul(x2, self.qa, self.qb, self.sz, self.bits, self.group_size,
                                  swiglu=swiglu)
        else:
            if swiglu:
                x2 = ops.swiglu(*x2.chunk(2, dim=-1))
            y = naive_quant_matmul(x2, self.qa, self.qb, self.sz, self.bits, self.group_size,
                                   self.in_features)
        return self._finish(y.reshape(*shape[:-1], self.out_features))

    def _forward_prenorm(self, p: PreNorm) -> torch.Tensor | None:
        """y of the folded norm (and p.residual_out set), or None where no kernel folds it."""
        fast = ops._fast(p.x, "quant")
        if fast is None or p.x.dim() != 2 or self.qa.device != p.x.device:
            return None
        r = fast.quant_matmul_rms_norm(p.x, p.residual, p.norm.weight, p.norm.eps, self.qa,
                                       self.qb, self.sz, self.bits, self.group_size)
        if r is None:
            return None
        y, p.residual_out = r
        return y

    def folds_gated_norm(self, like: torch.Tensor, head_dim: int) -> bool:
        """Whether forward folds a GroupScaled input at this call (KDA asks before its decode
        kernel, which then writes what the fold reads); like: any tensor with the call's
        rows, dtype and device."""
        fast = ops._fast(like, "quant")
        return (fast is not None and self.qa.device == like.device
                and fast.folds_group_scale(like.shape[0], self.in_features, self.out_features,
                                           like.dtype, self.bits, self.group_size, head_dim))

    def _forward_scaled(self, g: GroupScaled) -> torch.Tensor | None:
        """y of the folded per-head scale (M = 1; 2-16 rows where the kernels fold it per
        row), or None where no kernel folds it."""
        fast = ops._fast(g.x, "quant")
        if fast is None or self.qa.device != g.x.device:
            return None
        return fast.quant_matmul_group_scaled(g.x, g.row_ss(), g.eps, self.qa, self.qb,
                                              self.sz, self.bits, self.group_size)

    def _rscaled(self, p: Normed) -> torch.Tensor | None:
        """y of RMSNorm(h) from p's h w and sums of squares (M = 1; 2-16 rows where the
        kernels fold it per row), or None."""
        fast = ops._fast(p.xw, "quant")
        if fast is None or p.xw.dim() != 2 or self.qa.device != p.xw.device:
            return None
        ss = p.ss[0] if p.xw.shape[0] == 1 else p.ss
        return fast.quant_matmul_rscaled(p.xw, ss, p.eps, self.qa, self.qb, self.sz,
                                         self.bits, self.group_size, p.digits)

    def forward_residual_norm(self, x: torch.Tensor | GroupScaled, post: NextNorm,
                              swiglu: bool = False) -> Normed | None:
        """As an output projection: y = forward(x, swiglu), then h = y + post.residual and
        post.norm's h w and sums of squares made in the GEMV's epilogue (at M = 1, one rank),
        returned as a Normed for the next input projection (M = 1; 2-16 rows where the kernels
        fold it per row); None where no kernel does that (the caller then runs `forward`)."""
        if self.parallel is not None and self.tp.size > 1:  # the all-reduce comes first
            return None
        g = x if isinstance(x, GroupScaled) else None
        xx = x.x if g is not None else x
        fast = ops._fast(xx, "quant")
        if fast is None or xx.dim() != 2 or self.qa.device != xx.device:
            return None
        norm = post.norm
        r = fast.quant_matmul_residual_norm(
            xx, post.residual, norm.weight, self.qa, self.qb, self.sz, self.bits,
            self.group_size, swiglu=swiglu, gscale=None if g is None else (g.row_ss(), g.eps))
        if r is None:
            return None
        h, xw, ss, dg = r
        return Normed(xw, ss, norm.eps, h, dg)

    def forward_mlp_chain(self, gate_up: QuantLinear, x: Normed, post: NextNorm) -> Normed | None:
        """As an MLP's down projection after `gate_up` (the fused gate and up projections) on
        a Normed x: both GEMVs and the SwiGLU, the residual add and post's norm in one launch
        (ops-level `quant_mlp_chain`, at M = 1 on one rank), or in two on gemv_i8 with x's
        digits from the epilogues (`quant_mlp_i8`); None where neither applies (the caller
        then runs the two projections)."""
        if self.parallel is not None and self.tp.size > 1:  # the all-reduce comes first
            return None
        fast = ops._fast(x.xw, "quant")
        if (fast is None or x.xw.shape[0] != 1 or self.qa.device != x.xw.device
                or gate_up.qa.device != x.xw.device):
            return None
        r = fast.quant_mlp_chain(x.xw, x.ss[0], x.eps, gate_up._layer(), self._layer(),
                                 post.residual, post.norm.weight)
        if r is not None:
            h, xw, ss = r
            return Normed(xw, ss, post.norm.eps, h)
        r = fast.quant_mlp_i8(x.xw, x.ss[0], x.eps, x.digits, gate_up._layer(), self._layer(),
                              post.residual, post.norm.weight)  # two launches, no digits ones
        if r is None:
            return None
        h, xw, ss, dg = r
        return Normed(xw, ss, post.norm.eps, h, dg)

    def forward_tail_chain(self, o_proj: nn.Module, gate_up: QuantLinear,
                           x: torch.Tensor | GroupScaled, post: NextNorm,
                           norm: nn.Module) -> tuple | None:
        """As an MLP's down projection: the mixer's output projection o_proj(x) with post's
        residual add and norm, then gate_up and this projection with the residual add and
        `norm` (the next layer's input norm), in one launch (ops-level `quant_mlp_chain` with
        its o_proj stage, at M = 1 on one rank): (the stream after the mixer, the Normed of
        the MLP's output); None where that does not apply."""
        if not isinstance(o_proj, QuantLinear) or any(
                m.parallel is not None and m.tp.size > 1 for m in (self, o_proj, gate_up)):
            return None
        g = x if isinstance(x, GroupScaled) else None
        xx = x.x if g is not None else x
        fast = ops._fast(xx, "quant")
        if (fast is None or xx.dim() != 2 or xx.shape[0] != 1
                or any(m.qa.device != xx.device for m in (self, o_proj, gate_up))):
            return None
        r = fast.quant_mlp_chain(
            None, None, post.norm.eps, gate_up._layer(), self._layer(), post.residual,
            norm.weight, o_proj=(xx, None if g is None else (g.ss[0], g.eps), o_proj._layer(),
                                 post.norm.weight))
        if r is None:
            return None
        h0, h, xw, ss = r
        return h0, Normed(xw, ss, norm.eps, h)

    def _layer(self) -> tuple:
        """(qa, qb, sz, bits, group_size): the weights as the kernels take them."""
        return self.qa, self.qb, self.sz, self.bits, self.group_size

    def _finish(self, y: torch.Tensor) -> torch.Tensor | None:
        """The tensor-parallel tail: a row-parallel layer all-reduces, a vocab-parallel lm_head
        gathers on rank 0."""
        if self.parallel == "row":
            return all_reduce(y, self.tp)
        if self.parallel == "lm_head" and self.tp.size > 1:
            parts = ([torch.empty_like(y) for _ in range(self.tp.size)]
                     if self.tp.rank == 0 else None)
            dist.gather(y, parts, dst=0)
            return torch.cat(parts, dim=-1) if parts is not None else None
        return y

    def forward_grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, J, in] -> [T, out] where output rows j out/J .. (j + 1) out/J - 1 read x[:, j]:
        the layer holds J linears of one shape stacked (`concat`), each on its own input, run as
        one launch at decode."""
        if self.qa.device != x.device:
            self.to(x.device)
        fast = ops._fast(x, "quant")
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        if fast is not None:
            return fast.quant_matmul_grouped(x, self.qa, self.qb, self.sz, self.bits,
                                             self.group_size)
        t, j, k = x.shape
        w = self.dequantize().view(j, self.out_features // j, k)
        return torch.einsum("tjk,jnk->tjn", x.float(), w).reshape(t, -1).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}")


def _module_tp(old: nn.Module) -> tuple[str | None, TP]:
    tp = getattr(old, "tp", TP())
    if isinstance(old, ParallelLMHead):
        return "lm_head", tp
    if isinstance(old, RowParallelLinear):
        return "row", tp
    return None, tp


def apply_quantization(model: nn.Module, cfg: VolundrConfig,
                       state_dict: dict[str, torch.Tensor],
                       device: torch.device | str | None = None) -> None:
    """Replace each nn.Linear listed in cfg.quantization.bits by a QuantLinear built from the
    checkpoint's X.qweight / X.scales / X.zeros (popped from `state_dict`), repacked on `device`
    (default: where the checkpoint tensors are). Raises ValueError naming a missing tensor, a
    module that is not a linear, or a shape that disagrees with the module."""
    qc = cfg.quantization
    if qc is None:
        return
    for module, bits in qc.bits.items():
        names = [f"{module}.{s}" for s in SUFFIXES]
        missing = [n for n in names if n not in state_dict]
        if missing:
            raise ValueError(f"quantized module {module}: missing {', '.join(missing)}")
        parent_name, _, attr = module.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, attr)
        except AttributeError:
            raise ValueError(f"quantized module {module} is not in the model") from None
        if not isinstance(old, nn.Linear):
            raise ValueError(f"quantized module {module} is a {type(old).__name__}, "
                             "not a linear")
        qweight, scales, zeros = (state_dict.pop(n) for n in names)
        n, k = old.out_features, old.in_features
        if (tuple(qweight.shape) != (n, k * bits // 8) or scales.shape != zeros.shape
                or scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]):
            raise ValueError(f"{module}: qweight {tuple(qweight.shape)}, scales "
                             f"{tuple(scales.shape)} do not fit a {bits}-bit [{n}, {k}] linear")
        parallel, tp = _module_tp(old)
        new = QuantLinear.from_checkpoint(qweight, scales, zeros, bits, device=device,
                                          parallel=parallel, tp=tp)
        setattr(parent, attr, new)


def expected_quant_tensors(cfg: VolundrConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every X.qweight / X.scales / X.zeros that cfg's checkpoint holds."""
    qc = cfg.quantization
    if qc is None:
        return {}
    specs = expected_tensors(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for module, bits in qc.bits.items():
        spec = specs.get(f"{module}.weight")
        if spec is None or not spec.linear:
            raise ValueError(f"quantization_config lists {module}, which is not a linear of "
                             "this model")
        n, k = spec.shape
        g = group_size_for(k, qc.group_size)
        out[f"{module}.qweight"] = (n, k * bits // 8)
        out[f"{module}.scales"] = (n, k // g)
        out[f"{module}.zeros"] = (n, k // g)
    return out
