"""Fused RMSNorm (+ residual, or gated) and SwiGLU Triton kernels == naive references, fresh
random inputs.

CPU: TRITON_INTERPRET=1 in a subprocess (this file run as a script), so the variable never
reaches other test modules. The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to
nearest even), so bf16 on the CPU is held to 1-2 bf16 ulps, and exact equality of the residual
sum is checked on CUDA and for fp16/fp32.
"""

from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_interpreted  # (tests/ is on the path)

from volundr.kernels.norm.naive import naive_rms_norm, naive_rms_norm_gated, naive_swiglu

CUDA = torch.cuda.is_available()
# max |out - ref| / max(1, |ref|): 2 ulps of the output dtype (rounding of fp32 math)
ULP2 = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _close(out: torch.Tensor, ref: torch.Tensor, dtype, msg: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, msg
    o, r = out.double(), ref.double()
    assert torch.isfinite(o).all(), msg
    if o.numel() == 0:
        return
    err = ((o - r).abs() / r.abs().clamp_min(1.0)).max().item()
    assert err <= ULP2[dtype], f"{msg}: err {err}"


def check_rms_norm(shape, dtype, device, seed, residual: bool, exact_sum: bool) -> None:
    from volundr.kernels.norm.engine import rms_norm

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    w = (torch.randn(shape[-1], generator=g) + 1).to(dtype).to(device)
    msg = f"seed={seed} shape={shape} {dtype}"
    if not residual:
        _close(rms_norm(x, w, 1e-6), naive_rms_norm(x, w, 1e-6), dtype, msg)
        return
    r = torch.randn(shape, generator=g).to(dtype).to(device)
    y, s = rms_norm(x, w, 1e-6, r)
    yr, sr = naive_rms_norm(x, w, 1e-6, r)
    if exact_sum:
        assert torch.equal(s, sr), msg
    else:
        _close(s, sr, dtype, msg)
    _close(y, yr, dtype, msg)


def check_rms_norm_gated(shape, dtype, device, seed) -> None:
    from volundr.kernels.norm.engine import rms_norm_gated

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    w = (torch.randn(shape[-1], generator=g) + 1).to(dtype).to(device)
    # the gate as the model passes it: a strided view of a wider projection output
    wide = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 2).to(dtype).to(device)
    gate = wide[..., : shape[-1]]
    _close(rms_norm_gated(x, w, gate, 1e-6), naive_rms_norm_gated(x, w, gate, 1e-6), dtype,
           f"gated seed={seed} shape={shape} {dtype}")
    if len(shape) == 3:  # KDA's gate: heads of a token-strided column slice [T, H, C]
        t, h, c = shape
        gate = (torch.randn(t, 2 * h * c + 8, generator=g) * 2).to(dtype).to(device)
        gate = gate[:, 8:8 + h * c].view(t, h, c)
        _close(rms_norm_gated(x, w, gate, 1e-6), naive_rms_norm_gated(x, w, gate, 1e-6), dtype,
               f"gated token-strided seed={seed} shape={shape} {dtype}")


def check_swiglu(rows, cols, dtype, device, seed) -> None:
    from volundr.kernels.norm.engine import swiglu

    g = torch.Generator().manual_seed(seed)
    # the halves of one fused gate_up projection: strided views, as the MLP may pass them
    gu = (torch.randn(rows, 2 * cols, generator=g) * 4).to(dtype).to(device)
    gate, up = gu[:, :cols], gu[:, cols:]
    _close(swiglu(gate, up), naive_swiglu(gate, up), dtype, f"seed={seed} {rows}x{cols}")
    x = torch.randn(3, rows, cols, generator=g).to(dtype).to(device)
    _close(swiglu(x, x * 0.5), naive_swiglu(x, x * 0.5), dtype, f"seed={seed} 3d")


CPU_NORM_SHAPES = [(7, 96), (3, 4, 128), (5, 300), (0, 64)]


def run_cpu() -> None:
    """Interpreter checks at small shapes (called in a TRITON_INTERPRET=1 subprocess)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in CPU_NORM_SHAPES:
            for res in (False, True):
                check_rms_norm(shape, dtype, "cpu", _seed(), res, dtype != torch.bfloat16)
        check_swiglu(5, 200, dtype, "cpu", _seed())
        for shape in [(3, 4, 32), (5, 100), (0, 16)]:
            check_rms_norm_gated(shape, dtype, "cpu", _seed())


def test_interpreter():
    run_interpreted(__file__)


gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@gpu
@pytest.mark.parametrize("shape", [(1, 5120), (1000, 5120), (333, 40, 128), (17, 2048)])
@pytest.mark.parametrize("residual", [False, True])
def test_cuda_rms_norm(shape, residual):
    check_rms_norm(shape, torch.bfloat16, "cuda", _seed(), residual, exact_sum=True)


@gpu
@pytest.mark.parametrize("shape", [(1, 40, 128), (16, 40, 128), (4000, 40, 128)])
def test_cuda_rms_norm_gated(shape):
    check_rms_norm_gated(shape, torch.bfloat16, "cuda", _seed())


@gpu
@pytest.mark.parametrize("rows,cols", [(1, 17408), (512, 17408), (37, 3072)])
def test_cuda_swiglu(rows, cols):
    check_swiglu(rows, cols, torch.bfloat16, "cuda", _seed())


if __name__ == "__main__":
    run_cpu()
