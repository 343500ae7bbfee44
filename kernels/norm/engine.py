"""Fused RMSNorm (+ residual add, or a sigmoid output gate) and SwiGLU in Triton; the engine
calls these on CUDA.

Both are memory-bound: each element is read once and written once, math in fp32. RMSNorm
handles ROWS rows per program so that narrow rows (the KDA per-head norm, 128 wide) still give
each program a few KiB of work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_rows, n_cols, eps,
                     stride_x, stride_r, stride_y, stride_s,
                     HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pdl.trigger()  # a PDL-launched successor may start
    cols = tl.arange(0, BLOCK)
    cmask = cols < n_cols
    # the norm weight is never written by a kernel: loaded while the kernel before drains
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    pdl.wait()  # PDL: inputs come from the kernel before
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        # round the sum to the activation dtype first, as `x + residual` does in PyTorch: the
        # stored residual stream and the normalised value then agree with the reference
        x = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + rows64[:, None] * stride_s + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / n_cols + eps)
    y = xf * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, o_ptr, n_cols, stride_g, stride_u, stride_o,
                   BLOCK: tl.constexpr):
    pdl.trigger()  # a PDL-launched successor may start
    pdl.wait()  # PDL: inputs come from the kernel before
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(o_ptr + row * stride_o + cols, y.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_gated_kernel(x_ptr, g_ptr, w_ptr, y_ptr, n_rows, n_cols, eps,
                           stride_x, stride_g, stride_y, g_heads, stride_gh,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of the gate sits at (r // g_heads) stride_g + (r % g_heads) stride_gh: a [T, H, C]
    gate with any token and head strides (KDA's, a column slice) needs no copy."""
    pdl.trigger()  # a PDL-launched successor may start
    cols = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)  # (as above)
    pdl.wait()  # PDL: inputs come from the kernel before
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    xf = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / n_cols + eps)
    # the normalised value is rounded to the activation dtype before the gate, as the reference
    y = (xf * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty).to(tl.float32)
    g_off = (rows // g_heads) * stride_g + (rows % g_heads) * stride_gh
    g = tl.load(g_ptr + g_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :],
             (y * tl.sigmoid(g)).to(y_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] as a 2-D [R, C] view (a copy only if no view exists) with unit column stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[0] == 0 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """y = x / rms(x) * weight over the last dim (x [..., C], weight [C]); y in x.dtype.

    With `residual` [..., C]: s = x + residual, returns (norm(s), s), s being the next residual
    stream (as volundr.kernels.norm.naive.naive_rms_norm).
    """
    C = x.shape[-1]
    x2 = _rows(x)
    R = x2.shape[0]
    dtype = x.dtype if residual is None else torch.result_type(x, residual)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    y2 = y.view(-1, C)
    if residual is not None:
        r2 = _rows(residual)
        s = torch.empty(x.shape, dtype=dtype, device=x.device)
        s2 = s.view(-1, C)
    else:
        r2, s2 = x2, y2  # unused
    if R == 0:
        return (y, s) if residual is not None else y
    block = triton.next_power_of_2(C)
    rows = max(1, min(16, 4096 // block))
    num_warps = 4 if block <= 2048 else 8
    _rms_norm_kernel[(triton.cdiv(R, rows),)](
        x2, r2, weight, y2, s2, R, C, eps,
        x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0),
        HAS_RES=residual is not None, ROWS=rows, BLOCK=block, num_warps=num_warps,
        launch_pdl=pdl.ON.value)
    return (y, s) if residual is not None else y


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """RMSNorm(x) * sigmoid(gate) over the last dim in one pass (KDA's output norm: per head,
    C = head_dim). x, gate [..., C] (any row strides); weight [C]; out in x.dtype (as
    volundr.kernels.norm.naive.naive_rms_norm_gated)."""
    C = x.shape[-1]
    x2 = _rows(x)
    if gate.dim() == 3 and gate.stride(-1) == 1:  # [T, H, C], any token / head strides
        g2, g_heads, stride_gh = gate, gate.shape[1], gate.stride(1)
    else:
        g2, g_heads, stride_gh = _rows(gate), 1, 0
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, C)
    R = x2.shape[0]
    if R == 0:
        return y
    block = triton.next_power_of_2(C)
    rows = max(1, min(16, 4096 // block))
    _rms_norm_gated_kernel[(triton.cdiv(R, rows),)](
        x2, g2, weight, y2, R, C, eps, x2.stride(0), g2.stride(0), y2.stride(0), g_heads,
        stride_gh, ROWS=rows, BLOCK=block, num_warps=4 if block <= 2048 else 8,
        launch_pdl=pdl.ON.value)
    return y


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up elementwise (gate, up [..., I], e.g. the halves of a fused projection);
    output in gate.dtype."""
    C = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    o2 = out.view(-1, C)
    R = g2.shape[0]
    if R == 0 or C == 0:
        return out
    block = min(4096, triton.next_power_of_2(C))
    _swiglu_kernel[(R, triton.cdiv(C, block))](
        g2, u2, o2, C, g2.stride(0), u2.stride(0), o2.stride(0), BLOCK=block, num_warps=4,
        launch_pdl=pdl.ON.value)
    return out
