"""gemv_i8_rows (kernels/quant/gemv_i8_rows.py): x_digits of several rows == naive_x_digits row
by row (the CPU through TRITON_INTERPRET=1: a subprocess, this file as a script); on CUDA the
GEMV == the naive reference for 2-8 rows, SwiGLU x and split-K or not. Its PTX steps are
gemv_i8's, whose operand order tests/test_gemv_i8.py checks on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from volundr.kernels.quant.naive import naive_quant_matmul, naive_x_digits

CUDA = torch.cuda.is_available()


def check_rows_digits(device: str) -> None:
    from volundr.kernels.quant.digits import x_digits

    gen = torch.Generator().manual_seed(5)
    for bits in (2, 4):
        for swiglu in (False, True):
            x = torch.randn(3, 1024 * (2 if swiglu else 1), generator=gen).to(torch.bfloat16)
            x = x.to(device)
            xd, xg = x_digits(x, bits, swiglu=swiglu)
            assert xd.shape[0] == 3 and xg.shape[0] == 3
            for r in range(3):
                rd, rg = naive_x_digits(x[r:r + 1], bits, swiglu=swiglu)
                one_d, one_g = x_digits(x[r:r + 1], bits, swiglu=swiglu)
                assert torch.equal(xd[r], one_d) and torch.equal(xg[r], one_g), (bits, r)
                # (one row == naive is test_gemv_i8's check_digits; here: rows don't mix)
                assert torch.allclose(xg[r][:, 0], rg[:, 0], rtol=1 / 128 if swiglu else 0)


def test_rows_digits_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, __file__, "digits"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "rows digits ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def _layer(n: int, k: int, bits: int, seed: int):
    from volundr.kernels.quant.pack import pack_scale_zero, to_kernel_layout

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    qa, qb = to_kernel_layout(q, bits, 128)
    s = (torch.rand(n, k // 128, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    z = (torch.rand(n, k // 128, generator=gen) * (2**bits - 1)).to(torch.bfloat16)
    return qa.cuda(), qb.cuda(), pack_scale_zero(s, z).cuda()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n,k", [(1024, 512), (17408, 5120), (5120, 17408)])
def test_cuda_gemv_i8_rows(bits, n, k):
    from volundr.kernels.quant import gemv_i8_rows as gr

    layer = _layer(n, k, bits, n + k + bits)

    def rel(y, r):
        return ((y.float() - r).norm() / r.norm()).item()

    for m in (2, 3, 5, 8):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = naive_quant_matmul(x.float(), *layer, bits, 128, k)
        for kw in ({}, {"splits": 1}):
            y = gr.gemv_i8_rows(x, *layer, bits, 128, **kw)
            assert y.shape == (m, n) and rel(y, ref) < 4e-3, (m, kw, rel(y, ref))
        gu = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16)
        xs = (torch.nn.functional.silu(gu[:, :k].float()) * gu[:, k:].float()).to(torch.bfloat16)
        y = gr.gemv_i8_rows(gu, *layer, bits, 128, swiglu=True)
        assert rel(y, naive_quant_matmul(xs.float(), *layer, bits, 128, k)) < 4e-3, m


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_engine_rows_path(monkeypatch):
    """VOLUNDR_I8_ROWS=2: the engine's 2-row matmuls (plain and with the MLP's SwiGLU) take
    gemv_i8_rows, == the naive reference; 3 rows stay on gemm_tc."""
    from volundr.kernels.quant import engine as qe
    from volundr.kernels.quant import gemv_i8_rows as gr

    monkeypatch.setattr(qe, "I8_ROWS", 2)
    calls = []
    monkeypatch.setattr(gr, "gemv_i8_rows", lambda *a, _f=gr.gemv_i8_rows, **kw:
                        calls.append(a[0].shape[0]) or _f(*a, **kw))
    for bits in (2, 3, 4):
        n, k = 5120, 5120
        layer = _layer(n, k, bits, bits)
        for m in (2, 3):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = naive_quant_matmul(x.float(), *layer, bits, 128, k)
            y = qe.quant_matmul(x, *layer, bits, 128)
            assert ((y.float() - ref).norm() / ref.norm()).item() < 4e-3
            gu = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16)
            xs = (torch.nn.functional.silu(gu[:, :k].float()) * gu[:, k:].float())
            y = qe.quant_matmul(gu, *layer, bits, 128, swiglu=True)
            ref = naive_quant_matmul(xs.to(torch.bfloat16).float(), *layer, bits, 128, k)
            assert ((y.float() - ref).norm() / ref.norm()).item() < 4e-3
    assert calls == [2, 2] * 3


if __name__ == "__main__":
    if sys.argv[1:] == ["digits"]:
        check_rows_digits("cpu")
        print("rows digits ok")
