"""Mixed 2/3/4-bit weights: formats, fit, Triton kernels vs the naive reference, QuantLinear
loading, the quantizing converter end to end, and logits-level quality bounds.

CPU: the Triton kernels run under TRITON_INTERPRET=1 in a subprocess (this file run as a
script), so the variable never reaches other tests. CUDA: the same checks at Volundr-32B shapes.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from interpreted import run_interpreted  # (tests/ is on the path)

from volundr.kernels.quant.fit import fit_quant, minmax_quant, output_error
from volundr.kernels.quant.naive import dequantize, naive_quant_matmul
from volundr.kernels.quant.pack import (
    from_kernel_layout,
    group_size_for,
    pack_bitstream,
    pack_scale_zero,
    to_kernel_layout,
    unpack_bitstream,
    unpack_scale_zero,
)

CUDA = torch.cuda.is_available()


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _layer(n: int, k: int, bits: int, g: int, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device) / k ** 0.5
    q, s, z = minmax_quant(w, bits, g, shrink=0.9)
    qa, qb = to_kernel_layout(q, bits, g)
    return qa, qb, pack_scale_zero(s, z)


def random_kda(cfg, seed: int):
    """A KDA layer of cfg with N(0, 0.3) weights and output norm weights in [0.5, 1.5] (the
    KDA tests' layer; fp32 on the CPU)."""
    from volundr.model.kda import KDA

    torch.manual_seed(seed)
    layer = KDA(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.o_norm.weight.uniform_(0.5, 1.5)
    return layer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


# ---- formats and fit --------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_formats_round_trip_and_match_the_documented_bits(bits):
    gen = torch.Generator().manual_seed(_seed())
    n, k, g = 5, 256, 64
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    packed = pack_bitstream(q, bits)
    assert packed.shape == (n, k * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bitstream(packed, bits), q)
    # the documented stream: q[n, k] at bits [k*b, (k+1)*b), bit j = bit j%8 of byte j//8
    for row, col in [(0, 0), (1, 7), (4, 255), (2, 100)]:
        val = sum(((int(packed[row, (col * bits + t) // 8]) >> ((col * bits + t) % 8)) & 1) << t
                  for t in range(bits))
        assert val == int(q[row, col])
    qa, qb = to_kernel_layout(q, bits, g)
    pa = 4 if bits == 4 else 2
    wa = g * pa // 32
    assert qa.shape == (k * pa // 32, n) and qb.shape == ((k // 32 if bits == 3 else 0), n)
    assert torch.equal(from_kernel_layout(qa, qb, bits, g, k), q)
    # kernel layout: word row g*WA + r, slot i holds the low bits of q[:, g*G + i*WA + r]
    grp, r, i = 2, 3, 5
    word = qa[grp * wa + r].to(torch.int64) & 0xFFFFFFFF
    assert torch.equal((word >> (pa * i)) & ((1 << pa) - 1),
                       q[:, grp * g + i * wa + r].to(torch.int64) & ((1 << pa) - 1))
    s = torch.randn(n, k // g).to(torch.bfloat16)
    z = (torch.rand(n, k // g) * 3).to(torch.bfloat16)
    s2, z2 = unpack_scale_zero(pack_scale_zero(s, z))
    assert torch.equal(s2, s) and torch.equal(z2, z)


def test_group_size_rule():
    assert group_size_for(5120) == 128 and group_size_for(17408) == 128
    assert group_size_for(64) == 64 and group_size_for(192) == 64 and group_size_for(96) == 32
    with pytest.raises(ValueError):
        group_size_for(16)


@pytest.mark.parametrize("bits,bound", [(2, 0.36), (3, 0.195), (4, 0.1)])
def test_fit_beats_min_max_rounding(bits, bound):
    gen = torch.Generator().manual_seed(_seed())
    w = torch.randn(256, 512, generator=gen)
    fitted = output_error(w, dequantize(*fit_quant(w, bits, 128)))
    plain = output_error(w, dequantize(*minmax_quant(w, bits, 128)))
    assert fitted < plain and fitted < bound  # bounds: optimal uniform quantizers of N(0, 1)


# ---- Triton kernels vs naive (CPU interpreter in a subprocess) --------------------------------
def check_matmul(m, n, k, bits, g, device, seed, tol=1e-4, dtype=torch.float32, **kw) -> None:
    from volundr.kernels.quant.gemv import quant_matmul_triton

    qa, qb, sz = _layer(n, k, bits, g, device, seed)
    x = torch.randn(m, k, device=device).to(dtype)
    ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, g, k)
    out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
    y = quant_matmul_triton(x, qa, qb, sz, bits, g, out=out, **kw)
    err = _rel(y, ref)
    assert err < tol, (m, n, k, bits, g, kw, err)


def check_dequant(m, n, k, bits, g, device, seed, tol=1e-5, dtype=torch.float32, **kw) -> None:
    from volundr.kernels.quant.gemm import dequant_matmul

    qa, qb, sz = _layer(n, k, bits, g, device, seed)
    x = torch.randn(m, k, device=device).to(dtype)
    ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, g, k)
    assert _rel(dequant_matmul(x, qa, qb, sz, bits, g, **kw), ref) < tol


def check_engine(n, k, bits, g, device, seed, ms=(1, 5, 40, 200), tol=1e-4) -> None:
    """The engine's dispatch (GEMV, 16-row tiles, 64-row tiles, dequantise + matmul)."""
    from volundr.kernels.quant.engine import quant_matmul

    qa, qb, sz = _layer(n, k, bits, g, device, seed)
    for m in ms:
        x = torch.randn(m, k, device=device)
        ref = naive_quant_matmul(x, qa, qb, sz, bits, g, k)
        assert _rel(quant_matmul(x, qa, qb, sz, bits, g), ref) < tol, (bits, m)


def _x_in(m: int, k: int, device, swiglu: bool, row_pad: int = 0):
    """(x [m, k] bf16, the kernel's input): x itself, or with swiglu the (gate, up) [m, 2k] whose
    SwiGLU (the SwiGLU kernel's rounding) is x; row_pad: the input as a column slice of a wider
    tensor."""
    from volundr.kernels.norm.naive import naive_swiglu

    width = 2 * k if swiglu else k
    xin = torch.randn(m, width + row_pad, device=device).to(torch.bfloat16)[:, :width]
    x = naive_swiglu(xin[:, :k], xin[:, k:]) if swiglu else xin
    return x, xin


def check_tc(n, k, bits, g, device, seed, tol=1e-4, out_dtype=torch.float32, **kw) -> None:
    """gemv_tc (M = 1, bf16 x) vs naive on the same bf16 x; fp32 out isolates the kernel's own
    error from the output rounding."""
    from volundr.kernels.quant.gemv_tc import gemv_tc

    qa, qb, sz = _layer(n, k, bits, g, device, seed)
    x, xin = _x_in(1, k, device, kw.get("swiglu", False))
    ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, g, k)
    out = torch.full((1, n), float("nan"), device=device, dtype=out_dtype)
    err = _rel(gemv_tc(xin, qa, qb, sz, bits, g, out=out, **kw), ref)
    assert err < tol, (n, k, bits, g, kw, err)


def check_tc_norm(n, k, bits, g, device, seed, tol=None, via_engine=False, **kw) -> None:
    """gemv_tc with the layer's residual add + RMSNorm folded in (norm=...) == rms_norm then
    the naive matmul; the written residual stream h == delta + residual exactly. via_engine:
    through engine.quant_matmul_rms_norm (as the model calls it)."""
    from volundr.kernels.norm.naive import naive_rms_norm
    from volundr.kernels.quant import engine
    from volundr.kernels.quant.gemv_tc import gemv_tc

    qa, qb, sz = _layer(n, k, bits, g, device, seed)
    bf = torch.bfloat16
    delta, res = (torch.randn(1, k, device=device) * 3).to(bf), torch.randn(1, k, device=device)
    res, w = res.to(bf), (torch.rand(k, device=device) + 0.5).to(bf)
    x_ref, h_ref = naive_rms_norm(delta, w, 1e-6, res)
    ref = naive_quant_matmul(x_ref.float(), qa, qb, sz, bits, g, k)
    if via_engine:
        y, h = engine.quant_matmul_rms_norm(delta, res, w, 1e-6, qa, qb, sz, bits, g)
    else:
        h = torch.full_like(delta, float("nan"))
        out = torch.full((1, n), float("nan"), device=device, dtype=torch.float32)
        y = gemv_tc(delta, qa, qb, sz, bits, g, out=out, norm=(res, w, 1e-6, h), **kw)
    # (exact on the GPU; the interpreter truncates fp32 -> bf16 where PyTorch rounds: every
    # x' rounds the same way there, so y's error adds up, hence its wider tolerance)
    assert torch.equal(h, h_ref) if device == "cuda" else _rel(h, h_ref) < 8e-3, "residual"
    tol = tol or (8e-3 if device == "cuda" else 2e-2)
    err = _rel(y, ref)
    assert err < tol, (n, k, bits, g, kw, err)


def check_tc_gscale(n, k, bits, g, device, seed, parts=2, tol=None, via_engine=False,
                    m=1, **kw) -> None:
    """gemv_tc with each group's sums scaled by rsqrt(sum(gs[group]) / g + eps) (gscale=...:
    KDA's gated output norm, per-head scale from the decode kernel's sums of squares) == the
    naive matmul of x with each group scaled first. via_engine: through
    engine.quant_matmul_group_scaled (as the model calls it), for m rows of x (gs [m, groups,
    parts] then: kda_rows's)."""
    from volundr.kernels.quant import engine
    from volundr.kernels.quant.gemv_tc import gemv_tc

    qa, qb, sz = _layer(n, k, bits, g, device, seed)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    gs = torch.rand(m, k // g, parts, device=device) * 100 + 1  # heads of different scales
    r = torch.rsqrt(gs.sum(-1) / g + 1e-6)
    ref = naive_quant_matmul((x.float().view(m, -1, g) * r[..., None]).view(m, k), qa, qb, sz,
                             bits, g, k)
    gs = gs if m > 1 else gs[0]
    if via_engine:
        y = engine.quant_matmul_group_scaled(x, gs, 1e-6, qa, qb, sz, bits, g)
    else:
        out = torch.full((1, n), float("nan"), device=device, dtype=torch.float32)
        y = gemv_tc(x, qa, qb, sz, bits, g, out=out, gscale=(gs, 1e-6), **kw)
    tol = tol or (8e-3 if via_engine else 1e-3)  # (the engine's y is bf16)
    err = _rel(y, ref)
    assert err < tol, (n, k, bits, g, kw, err)


def check_scaled_module(bits: int, device: str = "cpu", heads: int = 4, n: int = 64,
                        m: int = 1) -> None:
    """The model's path: a GroupScaled [m, heads * 128] into a mixed-bit QuantLinear (KDA's
    o_proj) is folded into its GEMV (the unfolded value is never made) and gives the unfolded
    path's y; the layer says so beforehand (`folds_gated_norm`), and not for another head dim."""
    from contextlib import nullcontext
    from unittest import mock

    from volundr import ops
    from volundr.kernels.quant import quantize_random_linear
    from volundr.model.layers import GroupScaled

    lin = quantize_random_linear(n, heads * 128, bits, 128, device, seed=_seed())
    u = torch.randn(m, heads * 128, device=device).to(torch.bfloat16)
    ss = torch.rand(m, heads, 2, device=device) * 200 + 1
    on_cpu = mock.patch.object(ops, "_fast", lambda t, name: ops._fast_module(name))
    with on_cpu if device == "cpu" else nullcontext():
        assert lin.folds_gated_norm(u, 128) and not lin.folds_gated_norm(u, 64)
        with mock.patch.object(GroupScaled, "value", side_effect=AssertionError("not folded")):
            y = lin(GroupScaled(u, ss, 1e-6))
        y_ref = lin(GroupScaled(u, ss, 1e-6).value())
    assert y.shape == (m, n) and _rel(y, y_ref) < (8e-3 if device == "cuda" else 2e-2), bits


def check_kda_layer_fold(seed: int) -> None:
    """The model's KDA decode step with its gated output norm folded (the decode kernel's gated
    epilogue, then a GroupScaled into the mixed-bit o_proj's GEMV; neither the norm kernel nor
    the unfolded value runs) == the same step unfolded (engine.GATED_NORM_FOLD off), states
    included; on the CPU through the interpreter: 2 heads of 32 = o_proj's group size, 4-bit."""
    import dataclasses
    from types import SimpleNamespace
    from unittest import mock

    from volundr import ops
    from volundr.config import KDAConfig
    from volundr.converter.presets import get_config
    from volundr.kernels.quant import engine, quantize_random_linear
    from volundr.model.layers import GroupScaled

    cfg = dataclasses.replace(get_config("tiny"), kda=KDAConfig(num_heads=2, head_dim=32,
                                                                conv_size=4, low_rank_dim=16))
    layer = random_kda(cfg, seed)
    layer.o_proj = quantize_random_linear(cfg.hidden_size, 64, 4, 32, "cpu", seed=seed)
    layer = layer.to(torch.bfloat16)
    layer.after_load()
    state0 = torch.randn(3, 2, 32, 32) * 0.3
    conv0 = torch.randn(3, 3 * 64, 3).to(torch.bfloat16)
    b = SimpleNamespace(max_q_len=1, slot_ids=torch.tensor([1]), cu_list=[0, 1],
                        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32))
    x = torch.randn(1, cfg.hidden_size).to(torch.bfloat16)
    out = {}
    for fold in (True, False):
        layer.state, layer.conv_state = state0.clone(), conv0.clone()
        no_norm = mock.patch.object(ops, "rms_norm_gated", side_effect=AssertionError("norm"))
        no_value = mock.patch.object(GroupScaled, "value", side_effect=AssertionError("value"))
        with (mock.patch.object(ops, "_fast", lambda t, name: ops._fast_module(name)),
              mock.patch.object(engine, "GATED_NORM_FOLD", fold)):
            if fold:
                with no_norm, no_value:
                    y = layer(x, b)
            else:
                y = layer(x, b)
        out[fold] = (y, layer.state, layer.conv_state)
    (y1, s1, c1), (y0, s0, c0) = out[True], out[False]
    assert torch.equal(c1, c0) and _rel(s1, s0) < 1e-6, "states"
    assert y1.shape == (1, cfg.hidden_size) and _rel(y1, y0) < 2e-2, _rel(y1, y0)


def check_prenorm_module(bits: int, device: str = "cpu", k: int = 512,
                         parts: tuple = (64, 32)) -> None:
    """The model's path: a PreNorm into a FusedLinear of mixed-bit layers folds the norm (the
    norm kernel never runs) and gives the materialised path's y and residual stream. On the
    CPU (the interpreter) the kernels are made to take CPU tensors."""
    from contextlib import nullcontext
    from unittest import mock

    from volundr import ops
    from volundr.kernels.quant import quantize_random_linear
    from volundr.model.layers import FusedLinear, PreNorm, RMSNorm

    bf = torch.bfloat16
    fused = FusedLinear([quantize_random_linear(n, k, bits, 128, device, seed=_seed())
                         for n in parts], pad_to=64)
    norm = RMSNorm(k, 1e-6).to(device=device, dtype=bf)
    norm.weight.data = (torch.rand(k, device=device) + 0.5).to(bf)
    delta, h = (torch.randn(2, 1, k, device=device) * 3).to(bf).unbind(0)
    on_cpu = mock.patch.object(ops, "_fast", lambda t, name: ops._fast_module(name))
    with on_cpu if device == "cpu" else nullcontext():
        p = PreNorm(delta, h, norm)
        with mock.patch.object(ops, "rms_norm", side_effect=AssertionError("norm kernel ran")):
            y = fused(p)
        q = PreNorm(delta, h, norm)
        y_ref = fused(q.value())
    tol = 0 if device == "cuda" else 8e-3  # (the interpreter truncates fp32 -> bf16)
    assert _rel(y, y_ref) < (8e-3 if device == "cuda" else 2e-2), bits
    assert _rel(p.residual_out, q.residual_out) <= tol, bits


def check_gemm_tc(m, n, k, bits, g, device, seed, tol=1e-4, out_dtype=torch.float32,
                  row_pad=0, **kw) -> None:
    """gemm_tc (2 <= M <= 16, bf16 x) vs naive on the same bf16 x; fp32 out isolates the
    kernel's own error from the output rounding. row_pad: x rows are a column slice of a
    wider tensor (row stride K + row_pad)."""
    from volundr.kernels.quant.gemm_tc import gemm_tc

    qa, qb, sz = _layer(n, k, bits, g, device, seed)
    x, xin = _x_in(m, k, device, kw.get("swiglu", False), row_pad)
    ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, g, k)
    out = torch.full((m, n), float("nan"), device=device, dtype=out_dtype)
    err = _rel(gemm_tc(xin, qa, qb, sz, bits, g, out=out, **kw), ref)
    assert err < tol, (m, n, k, bits, g, kw, err)


def check_grouped(m, nj, k, bits, g, device, seed, j=2, tol=1e-4, dtype=torch.float32) -> None:
    """quant_matmul_grouped: J stacked linears, each on its own input x[:, i] (x a strided
    view, as KDA's low-rank halves) == naive per block."""
    from volundr.kernels.quant.engine import quant_matmul_grouped
    from volundr.kernels.quant.naive import dequantize_kernel_layout

    qa, qb, sz = _layer(j * nj, k, bits, g, device, seed)
    x = torch.randn(m, j * k + 8, device=device).to(dtype)[:, :j * k].view(m, j, k)
    w = dequantize_kernel_layout(qa, qb, sz, bits, g, k).view(j, nj, k)
    ref = torch.einsum("mjk,jnk->mjn", x.float(), w).reshape(m, j * nj)
    assert _rel(quant_matmul_grouped(x, qa, qb, sz, bits, g), ref) < tol, (m, nj, k, bits)


def check_graph_replay(kernel, m: int, bits: int) -> None:
    """kernel(x [m, 5120], ...) captured in a CUDA graph and replayed twice (the split-K
    counters are left at zero between replays) == naive."""
    qa, qb, sz = _layer(5120, 5120, bits, 128, "cuda", _seed())
    x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
    ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, 128, 5120)
    out = torch.empty(m, 5120, device="cuda", dtype=torch.bfloat16)
    kernel(x, qa, qb, sz, bits, 128, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(x, qa, qb, sz, bits, 128, out=out)
    out.fill_(float("nan"))
    graph.replay()
    graph.replay()
    assert _rel(out, ref) < 8e-3


def run_cpu(group: str) -> None:
    if group == "gemm_tc":  # the pure-Triton twin of gemm_tc's inline-PTX blocks
        from volundr.kernels.quant import engine
        from volundr.kernels.quant.gemm_tc import supported

        assert engine.GEMM16_PATH == "tc"  # set by test_interpreter
        x2 = torch.zeros(2, 256, dtype=torch.bfloat16)
        assert supported(x2, 2, 128, 64) and supported(x2, 4, 64, 64)
        assert not supported(x2.float(), 4, 128, 64) and not supported(x2[:1], 4, 128, 64)
        assert not supported(torch.zeros(17, 256, dtype=torch.bfloat16), 4, 128, 64)
        assert not supported(x2, 3, 64, 64) and not supported(x2, 4, 128, 66)
        for bits in (2, 3, 4):
            check_gemm_tc(2, 200, 512, bits, 128, "cpu", _seed(), reps=1, splits=1)  # ragged N
            check_gemm_tc(3, 96, 768, bits, 128, "cpu", _seed(), reps=2, splits=3)
            check_gemm_tc(8, 128, 384, bits, 128, "cpu", _seed(), reps=4)  # split-K
            check_gemm_tc(16, 100, 256, bits, 128, "cpu", _seed(), reps=1, num_warps=2)
            check_gemm_tc(5, 64, 512, bits, 128, "cpu", _seed(), reps=2, splits=1, stages=2)
            check_gemm_tc(11, 64, 256, bits, 128, "cpu", _seed(), tol=8e-3,
                          out_dtype=torch.bfloat16, reps=1, splits=1)
            # SwiGLU in the x loads (tolerance: see gemv_tc's case); x rows with a stride
            check_gemm_tc(3, 64, 256, bits, 128, "cpu", _seed(), tol=8e-3, reps=2, splits=2,
                          swiglu=True)
            check_gemm_tc(9, 64, 256, bits, 128, "cpu", _seed(), reps=2, row_pad=40)
            if bits == 4:
                check_gemm_tc(5, 64, 256, bits, 64, "cpu", _seed(), reps=2)
                # 20 splits: the last program sums them in two chunks (sum_splits), one ragged
                check_gemm_tc(2, 64, 2560, bits, 128, "cpu", _seed(), reps=1, splits=20)
            # engine with VOLUNDR_QUANT_GEMM16=tc: bf16 x at 2 <= M <= 16 takes gemm_tc (at
            # these small shapes only with the size floor lifted; this is a child process)
            engine.TC_MIN_DIM = 0
            qa, qb, sz = _layer(64, 256, bits, 128, "cpu", _seed())
            for m in (2, 16):
                x = torch.randn(m, 256).to(torch.bfloat16)
                ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, 128, 256)
                assert _rel(engine.quant_matmul(x, qa, qb, sz, bits, 128), ref) < 8e-3
        return
    if group == "gemv_tc":  # the pure-Triton twin of the inline-PTX blocks, same kernel
        from volundr.kernels.quant import engine
        from volundr.kernels.quant.gemv_tc import supported

        assert engine.GEMV_PATH == "tc"  # set by test_interpreter
        x16 = torch.zeros(1, 256, dtype=torch.bfloat16)
        assert not supported(x16.float(), 4, 128, 64) and not supported(x16, 3, 64, 64)
        assert not supported(x16, 4, 128, 66) and supported(x16, 2, 64, 64)
        for bits in (2, 3, 4):
            check_tc(200, 512, bits, 128, "cpu", _seed(), reps=1, splits=1)  # ragged N
            check_tc(96, 1024, bits, 128, "cpu", _seed(), reps=2, splits=2)
            check_tc(128, 1024, bits, 128, "cpu", _seed(), reps=4)  # EVEN, split-K
            check_tc(64, 640, bits, 128, "cpu", _seed(), reps=1, num_warps=2)  # 5 groups
            check_tc(64, 1536, bits, 128, "cpu", _seed(), reps=1, splits=1, stages=2)  # 3 sets
            # the words and scales through TMA descriptors (5-D views): pipelined, split-K
            check_tc(128, 1536, bits, 128, "cpu", _seed(), reps=2, splits=1, stages=2, tma=True)
            check_tc(64, 1024, bits, 128, "cpu", _seed(), reps=1, splits=2, tma=True)
            # each set's first block of words loaded before the PDL wait (VOLUNDR_PDL_EARLY):
            # several sets per program, a ragged N and last set, G = 64
            check_tc(64, 1536, bits, 128, "cpu", _seed(), reps=1, splits=1, early=True)
            check_tc(200, 640, bits, 128, "cpu", _seed(), reps=2, splits=1, early=True)
            if bits != 3:
                check_tc(64, 512, bits, 64, "cpu", _seed(), reps=1, splits=1, early=True)
            # the first 2 blocks, and all (4 at 4 bits; more than a set has: all 2 at 2/3 bits)
            check_tc(64, 1536, bits, 128, "cpu", _seed(), reps=1, splits=1, early=2)
            check_tc(200, 640, bits, 128, "cpu", _seed(), reps=2, splits=1, early=4)
            # 2 splits of 2 sets
            check_tc(96, 2048, bits, 128, "cpu", _seed(), reps=1, splits=2, early=4)
            check_tc(64, 512, bits, 128, "cpu", _seed(), tol=8e-3, out_dtype=torch.bfloat16,
                     reps=1, splits=1)
            # SwiGLU in the x loads (tolerance: the interpreter truncates fp32 -> bf16 where
            # the GPU and the SwiGLU kernel round to nearest)
            check_tc(64, 512, bits, 128, "cpu", _seed(), tol=8e-3, reps=2, splits=2, swiglu=True)
            # residual add + RMSNorm in the x loads: split-K (partial sums of squares), one
            # split, a ragged last set (5 groups), a ragged N
            check_tc_norm(64, 1024, bits, 128, "cpu", _seed(), reps=2, splits=2)
            check_tc_norm(64, 640, bits, 128, "cpu", _seed(), reps=1, splits=1)
            check_tc_norm(200, 512, bits, 128, "cpu", _seed(), reps=1, splits=2)
            # per-group scales (KDA's gated output norm): split-K, a ragged N and last set (5
            # groups), early weights, one partial per group
            check_tc_gscale(64, 1024, bits, 128, "cpu", _seed(), reps=2, splits=2)
            check_tc_gscale(200, 640, bits, 128, "cpu", _seed(), reps=1, splits=1, early=1)
            check_tc_gscale(64, 512, bits, 128, "cpu", _seed(), parts=1, reps=1)
            if bits != 3:
                check_tc(64, 256, bits, 64, "cpu", _seed(), reps=2)
            if bits == 4:  # 18 splits: summed in two chunks (sum_splits), the second ragged
                check_tc(64, 9216, bits, 128, "cpu", _seed(), reps=1, splits=18)
            # engine with VOLUNDR_QUANT_GEMV=tc: bf16 x at M = 1 takes gemv_tc (at these small
            # shapes only with the size floor lifted; this is a child process)
            engine.TC_MIN_DIM = 0
            qa, qb, sz = _layer(64, 512, bits, 128, "cpu", _seed())
            x = torch.randn(1, 512).to(torch.bfloat16)
            ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, 128, 512)
            assert _rel(engine.quant_matmul(x, qa, qb, sz, bits, 128), ref) < 8e-3
            engine.NORM_FOLD = True  # (off by default until measured on the GPU)
            check_tc_norm(64, 512, bits, 128, "cpu", _seed(), via_engine=True)
            check_prenorm_module(bits)
            engine.GATED_NORM_FOLD = True  # (the default; VOLUNDR_GATED_NORM_FOLD=0 is off)
            check_tc_gscale(64, 512, bits, 128, "cpu", _seed(), via_engine=True)
            check_scaled_module(bits)
            if bits == 4:  # (a group of 32 = the head dim needs 4 bits)
                check_kda_layer_fold(_seed())
        return
    for bits in (2, 3, 4):
        if group == "gemv":
            check_matmul(1, 200, 256, bits, 64, "cpu", _seed(), bn=128, splits=3)
            check_matmul(1, 96, 384, bits, 128, "cpu", _seed(), bn=64, splits=1)
            check_matmul(1, 64, 256, bits, 128, "cpu", _seed(), bn=64)  # engine-like split
            check_matmul(1, 64, 256, bits, 64, "cpu", _seed(), bn=64, prefetch=False)
            check_grouped(1, 256, 128, bits, 128, "cpu", _seed())  # the engine's GEMV config
            if bits == 4:  # 20 splits: summed in two chunks (sum_splits), the second ragged
                check_matmul(1, 64, 2560, bits, 128, "cpu", _seed(), bn=64, splits=20)
        elif group == "batch":
            check_matmul(5, 100, 256, bits, 64, "cpu", _seed(), block_m=16, bn=32, splits=2)
            check_matmul(40, 64, 256, bits, 128, "cpu", _seed(), block_m=16, bn=32, splits=1)
            check_dequant(7, 100, 256, bits, 64, "cpu", _seed(), chunk_n=48)
            check_engine(96, 256, bits, 128, "cpu", _seed())
            for m in (3, 20, 130):  # 16-row tiles, 64-row tiles, dequantise + matmul
                check_grouped(m, 128, 128, bits, 128, "cpu", _seed(), j=3)


@pytest.mark.parametrize("group", ["gemv", "batch", "gemv_tc", "gemm_tc"])
def test_interpreter(group):
    run_interpreted(__file__, group,
                    VOLUNDR_QUANT_GEMV="tc" if group == "gemv_tc" else "fma",
                    VOLUNDR_QUANT_GEMM16="tc" if group == "gemm_tc" else "tile")


# ---- gemv_tc's inline PTX, emulated (the interpreter runs its pure-Triton twin instead) -------
def _f32(u: int) -> float:
    return float(torch.tensor([u & 0xFFFFFFFF], dtype=torch.int64).to(torch.int32)
                 .view(torch.float32).item())


def _f32_bits(v: float) -> int:
    return int(torch.tensor([v], dtype=torch.float32).view(torch.int32).item()) & 0xFFFFFFFF


def _bf16(h: int) -> float:
    return _f32((h & 0xFFFF) << 16)


def _run_ptx(asm: str, ops: list[list]) -> list[list]:
    """Run gemv_tc's PTX on a warp in lock step: ops[lane] = operand values ($0.. outputs
    None). Supports the handful of instructions it uses; mma.m16n8k16 with the PTX fragment
    layouts (lane = 4 groupID + threadID_in_group). Undefined registers read as NaN."""
    import re

    regs = [{} for _ in range(32)]

    def val(t, tok):
        if tok.startswith("$"):
            return ops[t][int(tok[1:])]
        if tok.startswith(("0x", "0f")):
            return int(tok[2:], 16)
        return regs[t].get(tok, 0x7FC00000)

    def shift(t, tok):  # immediate or register shift amount
        return int(tok) if tok.isdigit() else val(t, tok)

    def put(t, tok, v):
        if tok.startswith("$"):
            ops[t][int(tok[1:])] = v & 0xFFFFFFFF
        else:
            regs[t][tok] = v & 0xFFFFFFFF

    for line in asm.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op.startswith("mma.sync"):
            groups = re.findall(r"{([^}]*)}", rest)
            d, a, b, c = [[x.strip() for x in g.split(",")] for g in groups]
            A = torch.zeros(16, 16, dtype=torch.float64)
            B, C = A[:, :8].clone(), A[:, :8].clone()
            for t in range(32):
                g, i = t // 4, t % 4
                for r, (row, col) in enumerate([(g, 2 * i), (g + 8, 2 * i), (g, 2 * i + 8),
                                                (g + 8, 2 * i + 8)]):
                    A[row, col], A[row, col + 1] = _bf16(val(t, a[r])), _bf16(val(t, a[r]) >> 16)
                for r, k0 in enumerate([2 * i, 2 * i + 8]):
                    B[k0, g], B[k0 + 1, g] = _bf16(val(t, b[r])), _bf16(val(t, b[r]) >> 16)
                for r, (row, col) in enumerate([(g, 2 * i), (g, 2 * i + 1), (g + 8, 2 * i),
                                                (g + 8, 2 * i + 1)]):
                    C[row, col] = _f32(val(t, c[r]))
            D = A @ B + C
            for t in range(32):
                g, i = t // 4, t % 4
                for r, (row, col) in enumerate([(g, 2 * i), (g, 2 * i + 1), (g + 8, 2 * i),
                                                (g + 8, 2 * i + 1)]):
                    put(t, d[r], _f32_bits(D[row, col].item()))
            continue
        x = [v.strip() for v in rest.split(",")]
        for t in range(32):
            if op == "shr.u32":
                put(t, x[0], val(t, x[1]) >> shift(t, x[2]))
            elif op == "shl.b32":
                put(t, x[0], val(t, x[1]) << shift(t, x[2]))
            elif op == "lop3.b32":  # LUT index = 4 a + 2 b + c per bit
                a_, b_, c_, lut = val(t, x[1]), val(t, x[2]), val(t, x[3]), int(x[4], 16)
                put(t, x[0], sum(((lut >> (4 * (a_ >> k & 1) + 2 * (b_ >> k & 1)
                                          + (c_ >> k & 1))) & 1) << k for k in range(32)))
            elif op in ("mov.f32", "mov.b32"):
                put(t, x[0], val(t, x[1]))
            elif op == "prmt.b32":
                src = [(val(t, x[1]) >> 8 * k) & 0xFF for k in range(4)]
                src += [(val(t, x[2]) >> 8 * k) & 0xFF for k in range(4)]
                put(t, x[0], sum(src[(int(x[3], 16) >> 4 * k) & 7] << 8 * k for k in range(4)))
            elif op == "fma.rn.bf16x2":
                h = [torch.tensor(_bf16(val(t, x[1]) >> 16 * e) * _bf16(val(t, x[2]) >> 16 * e)
                                  + _bf16(val(t, x[3]) >> 16 * e)).to(torch.bfloat16)
                     for e in range(2)]
                put(t, x[0], sum((int(v.view(torch.int16).item()) & 0xFFFF) << 16 * e
                                 for e, v in enumerate(h)))
            else:
                raise NotImplementedError(op)
    return ops


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gemv_tc_ptx_emulated(bits):
    """One warp (8 quads, 1 rep), one set of 4 groups, 32 output rows, random words: the PTX of
    gemv_tc with the lane layout the kernel relies on, including masked x lanes and the mma
    fragment semantics, against the naive reference (the GPU itself is tested by the cuda
    tests; this one runs anywhere)."""
    from volundr.kernels.quant import gemv_tc as T
    from volundr.kernels.quant.naive import dequantize_kernel_layout

    g_, n_, k_ = 128, 64, 1024
    pa = 4 if bits == 4 else 2
    wa, half = g_ * pa // 32, 16 // pa
    gen = torch.Generator().manual_seed(_seed())
    qa, qb, sz = _layer(n_, k_, bits, g_, "cpu", 0)
    qa = torch.randint(-2**31, 2**31 - 1, qa.shape, generator=gen, dtype=torch.int32)
    qb = torch.randint(-2**31, 2**31 - 1, qb.shape, generator=gen, dtype=torch.int32)
    x = torch.randn(1, k_, generator=gen).to(torch.bfloat16)
    xb = (x.view(torch.int16).to(torch.int64) & 0xFFFF)[0].tolist()
    u32 = lambda v: (v.to(torch.int64) & 0xFFFFFFFF).tolist()  # noqa: E731
    qa_u, qb_u, sz_u = u32(qa), u32(qb), u32(sz)
    st, tile = 1, 1  # groups 4..7, rows 32..63
    kc = T.kernel_consts(bits)
    d = [[0] * 4 for _ in range(32)]
    xs = [[0] * 4 for _ in range(32)]
    for blk in range(wa // 4):
        xps = []
        for t in range(32):
            grp, sel = st * 4 + t % 4, (t // 4) // 2 == t % 4  # masked x lanes load zeros
            row = []
            for p in range(half):
                lo = [xb[grp * g_ + p * wa + blk * 4 + e] if sel else 0 for e in range(4)]
                hi = [xb[grp * g_ + (p + half) * wa + blk * 4 + e] if sel else 0
                      for e in range(4)]
                for e in (0, 2):
                    ops = [[None, None, lo[e] | lo[e + 1] << 16, hi[e] | hi[e + 1] << 16]] * 32
                    row += _run_ptx(kc["ASM_PAIRS"][kc["OFFS"][p]], [list(o) for o in ops])[0][:2]
            xps.append(row)
        for s in range(4):
            r = blk * 4 + s
            step, xsum = [], []
            for t in range(32):
                grp, n0 = st * 4 + t % 4, tile * 32 + 4 * (t // 4)
                words = [qa_u[grp * wa + r][n0 + j] for j in range(4)]
                if bits == 3:
                    words += [qb_u[grp * (wa // 2) + r % (wa // 2)][n0 + j] for j in range(4)]
                step.append([None] * 4 + d[t] + words + xps[t])
                ka = [kc["XS"][e][kr] for kr in range(4) for e in range(4)]
                xsum.append([None] * 4 + xs[t] + ka + xps[t])
            d = [o[:4] for o in _run_ptx(kc["ASM_STEP"][(blk * 4) // (wa // 2) * 4 + s], step)]
            xs = [o[:4] for o in _run_ptx(kc["ASM_XSUM"][s], xsum)]
    y = torch.zeros(32, dtype=torch.float64)
    for t in range(32):
        grp = st * 4 + t % 4
        for j in range(4):
            w = sz_u[grp][tile * 32 + 4 * (t // 4) + j]
            s_, z_ = _f32(w << 16), _f32(w & 0xFFFF0000)
            y[4 * (t // 4) + j] += s_ * (_f32(d[t][j]) - (_f32(xs[t][1]) + z_ * _f32(xs[t][0])))
    w_ = dequantize_kernel_layout(qa, qb, sz, bits, g_, k_).double()
    ks = slice(st * 4 * g_, (st + 1) * 4 * g_)
    ref = w_[tile * 32:(tile + 1) * 32, ks] @ x.double()[0, ks]
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("m", [2, 3, 8, 16])
def test_gemm_tc_ptx_emulated(bits, m):
    """gemm_tc's PTX (M = 2..16) on one warp (8 quads, 1 rep, 32 output rows), one group,
    random words: lane c's word rows c NS + s, the per-lane B shifts of 3-bit, x^T as the B
    operand (sequences >= M zero), the D fragment as (row, sequence) sums and the X/B mma,
    against the naive reference."""
    from volundr.kernels.quant import gemm_tc as T
    from volundr.kernels.quant.gemv_tc import kernel_consts as tc_consts
    from volundr.kernels.quant.naive import dequantize_kernel_layout

    g_, n_, k_ = 128, 64, 256
    pa = 4 if bits == 4 else 2
    wa, np_ = g_ * pa // 32, 16 // pa
    ns, tt = wa // 4, 1 if m <= 8 else 2
    gen = torch.Generator().manual_seed(_seed())
    qa, qb, sz = _layer(n_, k_, bits, g_, "cpu", 0)
    qa = torch.randint(-2**31, 2**31 - 1, qa.shape, generator=gen, dtype=torch.int32)
    qb = torch.randint(-2**31, 2**31 - 1, qb.shape, generator=gen, dtype=torch.int32)
    x = torch.randn(m, k_, generator=gen).to(torch.bfloat16)
    xb = (x.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    u32 = lambda v: (v.to(torch.int64) & 0xFFFFFFFF).tolist()  # noqa: E731
    qa_u, qb_u, sz_u = u32(qa), u32(qb), u32(sz)
    grp, tile = 1, 1  # the second group, rows 32..63
    kc = T.kernel_consts(bits, tt, ns)
    offs = tc_consts(bits)["OFFS"]
    xv = lambda row, k: xb[row][k] if row < m else 0  # noqa: E731
    # x pair tensors (u, p) per lane: element e = step e // (4 // ns)
    xps = [[] for _ in range(32)]
    for t in range(32):
        c, g = t % 4, (t // 4) % 8
        for u in range(tt):
            for p in range(np_):
                el = []
                for s in range(ns):
                    k0 = grp * g_ + c * ns + s
                    ops = [[None, None, xv(8 * u + g, k0 + p * wa),
                            xv(8 * u + g, k0 + (p + np_) * wa)]] * 32
                    el.append(_run_ptx(kc["ASM_PAIRS"][offs[p]], [list(o) for o in ops])[0][0])
                xps[t] += [el[e // (4 // ns)] for e in range(4)]
    nf = 2 * tt
    f = [[0] * (4 * nf) for _ in range(32)]
    xs = [[[0] * 4 for _ in range(32)] for _ in range(tt)]
    ka = [kc["XS"][e][kr] for kr in range(4) for e in range(4)]
    for s in range(ns):
        step = []
        for t in range(32):
            c, n0 = t % 4, tile * 32 + 4 * (t // 4)
            r = c * ns + s
            ops = [None] * (4 * nf) + f[t] + [qa_u[grp * wa + r][n0 + j] for j in range(4)]
            if bits == 3:
                ops += [qb_u[grp * (wa // 2) + r % (wa // 2)][n0 + j] for j in range(4)]
                ops += [1 + (c >= 2)] * 4 + [1 - (c >= 2)] * 4
            step.append(ops + xps[t])
        f = [o[:4 * nf] for o in _run_ptx(kc["ASM_STEP"][s], step)]
        for u in range(tt):
            xsum = [[None] * 4 + xs[u][t] + ka + xps[t][4 * np_ * u:4 * np_ * (u + 1)]
                    for t in range(32)]
            xs[u] = [o[:4] for o in _run_ptx(kc["ASM_XSUM"][s], xsum)]
    y = torch.zeros(16, 32, dtype=torch.float64)
    for t in range(32):
        c, q = t % 4, t // 4
        for u in range(tt):
            for h in range(2):
                for j in range(4):
                    w = sz_u[grp][tile * 32 + 4 * q + j]
                    s_, z_ = _f32(w << 16), _f32(w & 0xFFFF0000)
                    fv = _f32(f[t][4 * (2 * u + h) + j])
                    xx, bb = _f32(xs[u][t][h]), _f32(xs[u][t][2 + h])
                    y[8 * u + 2 * c + h, 4 * q + j] = s_ * (fv - (bb + z_ * xx))
    w_ = dequantize_kernel_layout(qa, qb, sz, bits, g_, k_).double()
    ks = slice(grp * g_, (grp + 1) * g_)
    ref = x.double()[:, ks] @ w_[tile * 32:(tile + 1) * 32, ks].t()
    assert not y[m:].any()  # padding sequences stay zero
    assert ((y[:m] - ref).norm() / ref.norm()).item() < 1e-5


# ---- QuantLinear and loading ------------------------------------------------------------------
def test_quant_linear_cpu_and_apply_quantization_errors():
    from torch import nn

    from volundr.config import QuantConfig
    from volundr.converter.presets import get_config
    from volundr.model.quant_linear import QuantLinear, apply_quantization

    gen = torch.Generator().manual_seed(_seed())
    w = torch.randn(48, 128, generator=gen)
    q, s, z = fit_quant(w, 3, 64)
    layer = QuantLinear.from_checkpoint(pack_bitstream(q, 3), s, z, 3)
    assert layer.group_size == 64 and not layer.state_dict()  # buffers are not checkpoint keys
    x = torch.randn(2, 3, 128, generator=gen)
    torch.testing.assert_close(layer(x), x @ dequantize(q, s, z).t())

    cfg = get_config("tiny").replace(quantization=QuantConfig(bits={"lm_head": 4}))
    model = nn.Module()
    model.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    w = torch.randn(cfg.vocab_size, cfg.hidden_size)
    q, s, z = fit_quant(w, 4, 64)
    good = {"lm_head.qweight": pack_bitstream(q, 4), "lm_head.scales": s, "lm_head.zeros": z}
    with pytest.raises(ValueError, match="missing lm_head.zeros"):
        apply_quantization(model, cfg, {k: v for k, v in good.items() if "zeros" not in k})
    with pytest.raises(ValueError, match="do not fit"):
        apply_quantization(model, cfg, {**good, "lm_head.qweight": good["lm_head.qweight"][:5]})
    sd = dict(good, other=torch.zeros(1))
    apply_quantization(model, cfg, sd)
    assert list(sd) == ["other"] and isinstance(model.lm_head, QuantLinear)


# ---- converter end to end and quality ---------------------------------------------------------
def test_quantize_tiny_checkpoint_end_to_end(tmp_path, capsys):
    from volundr.converter.loader import load_checkpoint
    from volundr.converter.quant_eval import eval_prompt, logits_error, prefill_logits
    from volundr.converter.quantize import main
    from volundr.converter.tiny import build_tiny
    from volundr.model.quant_linear import expected_quant_tensors

    src = build_tiny(tmp_path / "src", seed=3)
    out = tmp_path / "q"
    assert main([str(src), str(out), "--target-bits", "3.7", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 3.3 < summary["avg_bits_per_weight"] <= 3.7 and summary["target_met"]
    assert summary["modules_by_bits"]["3"] + summary["modules_by_bits"]["4"] > 1
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "quant_report.json", "quant_report.txt"):
        assert (out / f).exists(), f
    cfg, sd = load_checkpoint(out)
    assert cfg.quantization.bits["lm_head"] >= 4
    assert "model.layers.0.kda.f_b_proj.weight" in sd  # in_features 16: stays bf16
    for name, shape in expected_quant_tensors(cfg).items():
        assert tuple(sd[name].shape) == shape, name
    rep = json.loads((out / "quant_report.json").read_text())
    q = rep["quality"]
    # each uniform width and the mixed result: logits error vs bf16 (random model, 8 layers)
    assert q["uniform_4"]["rel_l2"] < q["uniform_3"]["rel_l2"] < q["uniform_2"]["rel_l2"]
    assert q["uniform_4"]["rel_l2"] < 0.45 and q["uniform_3"]["rel_l2"] < 0.7
    assert q["mixed"]["rel_l2"] < q["uniform_2"]["rel_l2"]
    # the QuantLinear path of the engine gives the logits the report measured
    cfg0, sd0 = load_checkpoint(src)
    ids = eval_prompt(cfg)
    err = logits_error(prefill_logits(cfg0, sd0, ids), prefill_logits(cfg, sd, ids))
    assert abs(err["rel_l2"] - q["mixed"]["rel_l2"]) < 1e-3


def test_fused_linear_pads_mixed_bit_rows_with_zeros_and_swiglu_input():
    """FusedLinear over mixed-bit layers of one format: one matmul whose first outputs are the
    parts' and whose padding rows are exactly 0 (KDA's six projections, padded to whole 64-row
    tiles); a part of another width keeps them apart. QuantLinear(swiglu=True) on (gate, up)
    == the layer on SiLU(gate) * up."""
    from volundr.kernels.norm.naive import naive_swiglu
    from volundr.kernels.quant import quantize_random_linear
    from volundr.model.layers import FusedLinear

    mods = [quantize_random_linear(n, 256, 4, 128, "cpu", seed=i)
            for i, n in enumerate((96, 32, 8))]
    fused = FusedLinear(mods, pad_to=64)
    assert fused.fused is not None and fused.out_features == 136
    x = torch.randn(3, 256)
    y = fused(x)
    assert y.shape == (3, 192) and (y[:, 136:] == 0).all()
    torch.testing.assert_close(y[:, :136], torch.cat([m(x) for m in mods], -1))
    other = quantize_random_linear(8, 256, 3, 128, "cpu")
    assert FusedLinear(mods + [other], pad_to=64).fused is None
    gu = torch.randn(5, 512).to(torch.bfloat16)
    down = quantize_random_linear(64, 256, 3, 128, "cpu")
    torch.testing.assert_close(down(gu, swiglu=True),
                               down(naive_swiglu(gu[:, :256], gu[:, 256:])))


def test_mid_size_random_model_quality():
    """hidden 256, 3 layers: uniform widths and a 3.2-bit mix, logits error vs full precision."""
    from volundr.converter.presets import random_state_dict
    from volundr.converter.quant_eval import mid_config
    from volundr.converter.quantize import allocate, average_bits, evaluate, measure

    cfg = mid_config(vocab_size=2048, hidden_size=256, num_layers=3, intermediate_size=768)
    sd = random_state_dict(cfg, "cpu", dtype=torch.float32, seed=5)
    stats = measure(cfg, sd, 128, "cpu", iters=2, progress=False)
    bits = allocate(stats, 3.2)
    assert 3.0 < average_bits(stats, bits) <= 3.2 and bits["lm_head"] >= 4
    q = evaluate(cfg, sd, stats, bits, prompt_len=32)
    assert q["uniform_4"]["rel_l2"] < 0.25 and q["uniform_3"]["rel_l2"] < 0.45
    assert q["uniform_2"]["rel_l2"] < 0.9 and q["uniform_4"]["top1"] > 0.6
    # 3.2 bits allocated by measured error do about as well as 3.25 bits of uniform 3-bit
    assert q["mixed"]["rel_l2"] < min(q["uniform_2"]["rel_l2"], 1.15 * q["uniform_3"]["rel_l2"])


# ---- CUDA at Volundr-32B shapes -----------------------------------------------------------------
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
SHAPES_32B = [(5120, 5120), (17408, 5120), (5120, 17408)]


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n,k", SHAPES_32B)
def test_cuda_engine_matches_naive(n, k, bits):
    from volundr.kernels.quant.engine import quant_matmul

    qa, qb, sz = _layer(n, k, bits, 128, "cuda", _seed())
    for m in (1, 4, 16, 100, 600):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, 128, k)
        assert _rel(quant_matmul(x, qa, qb, sz, bits, 128), ref) < 8e-3, m


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n,k", SHAPES_32B + [(262144, 5120)])
def test_cuda_gemv_tc_matches_naive(n, k, bits):
    """The inline-PTX M = 1 path (kernels/quant/gemv_tc.py): fp32 out (the kernel's own error:
    exact products, fp32 accumulation) and bf16 out, engine-like configs."""
    check_tc(n, k, bits, 128, "cuda", _seed(), tol=1e-3, reps=4, num_warps=1, waves=16.0)
    if n < 100000:  # the lm_head shape once (building the layer dominates)
        check_tc(n, k, bits, 128, "cuda", _seed(), tol=8e-3, out_dtype=torch.bfloat16, reps=2,
                 num_warps=2, waves=4.0)


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cuda_gemv_tc_configs_and_edges(bits):
    """Ragged N, partial group sets, G = 64, splits 1 .. many, several warps; repeated calls
    (the split-K counters must be left at zero) and CUDA-graph replay."""
    cases = [(200, 640, dict(reps=1, splits=1)), (5120, 5120, dict(reps=2, splits=10)),
             (1000, 1152, dict(reps=4, num_warps=2)), (4096, 5120, dict(reps=1, num_warps=4))]
    for n, k, kw in cases:
        for _ in range(2):
            check_tc(n, k, bits, 128, "cuda", _seed(), tol=1e-3, **kw)
    if bits != 3:
        check_tc(512, 1024, bits, 64, "cuda", _seed(), tol=1e-3, reps=2)
    from volundr.kernels.quant.gemv_tc import gemv_tc

    check_graph_replay(gemv_tc, 1, bits)


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("path,ms", [("GEMV_PATH", (1, 4)), ("GEMM16_PATH", (1, 2, 4, 16, 17))])
def test_cuda_engine_tc_path(bits, path, ms, monkeypatch):
    """The engine's dispatch with the tensor-core GEMV (M = 1) / GEMM16 (2 <= M <= 16) on."""
    from volundr.kernels.quant import engine

    monkeypatch.setattr(engine, path, "tc")
    qa, qb, sz = _layer(17408, 5120, bits, 128, "cuda", _seed())
    for m in ms:
        x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
        ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, 128, 5120)
        assert _rel(engine.quant_matmul(x, qa, qb, sz, bits, 128), ref) < 8e-3, m


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n,k", SHAPES_32B + [(262144, 5120)])
def test_cuda_gemm_tc_matches_naive(n, k, bits):
    """The inline-PTX 2 <= M <= 16 path (kernels/quant/gemm_tc.py) at M = 2, 8, 16: fp32 out
    (the kernel's own error: exact products, fp32 accumulation) and bf16 out, engine-like
    configs; one layer per shape (building the lm_head one dominates)."""
    from volundr.kernels.quant.gemm_tc import gemm_tc
    from volundr.kernels.quant.naive import dequantize_kernel_layout

    qa, qb, sz = _layer(n, k, bits, 128, "cuda", _seed())
    w = dequantize_kernel_layout(qa, qb, sz, bits, 128, k)
    for m in (2, 8, 16):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = x.float() @ w.t()
        for dtype, tol, kw in [(torch.float32, 1e-3, dict(reps=2, num_warps=1, waves=8.0)),
                               (torch.bfloat16, 8e-3, dict(reps=1, num_warps=2, waves=4.0))]:
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            err = _rel(gemm_tc(x, qa, qb, sz, bits, 128, out=out, **kw), ref)
            assert err < tol, (m, dtype, kw, err)


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cuda_gemm_tc_configs_and_edges(bits):
    """Ragged N (200, 1000: not a multiple of the tile nor of 16; 2/3-bit ones were wrong on
    the H200 until the kernel told Triton N % 4 == 0), odd M, G = 64 (4-bit), splits 1 ..
    many, several warps; repeated calls (the split-K counters must be left at zero), CUDA-graph
    replay and the engine switch."""
    cases = [(3, 200, 640, dict(reps=1, splits=1)), (16, 5120, 5120, dict(reps=2, splits=10)),
             (5, 1000, 1152, dict(reps=4, num_warps=2)), (9, 4096, 5120, dict(reps=1, num_warps=4)),
             (13, 5120, 17408, dict(reps=2, waves=16.0)),
             # the group loop pipelined through shared memory (stages), few and many groups
             (16, 17408, 5120, dict(reps=2, waves=8.0, stages=2)),
             (4, 5120, 17408, dict(reps=2, splits=4, stages=3)),
             (16, 15680, 5120, dict(reps=2, splits=1, stages=2))]
    for m, n, k, kw in cases:
        for _ in range(2):
            check_gemm_tc(m, n, k, bits, 128, "cuda", _seed(), tol=1e-3, **kw)
    if bits == 4:  # G = 64 (2 steps per group, as 2/3-bit), N a multiple of the tile and ragged
        for n in (512, 200):
            check_gemm_tc(7, n, 1024, bits, 64, "cuda", _seed(), tol=1e-3, reps=2)
    from volundr.kernels.quant.gemm_tc import gemm_tc

    check_graph_replay(gemm_tc, 16, bits)


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cuda_gemv_tc_pipelined_sets(bits):
    """gemv_tc with its set loop software-pipelined (weights through shared memory by
    cp.async): == naive at Volundr-32B shapes, several sets per program and one."""
    for n, k in ((17408, 5120), (5120, 17408), (15680, 5120)):
        for stages, splits in ((2, 2), (3, 1), (2, None)):
            check_tc(n, k, bits, 128, "cuda", _seed(), tol=1e-3, reps=2, stages=stages,
                     splits=splits)


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cuda_gemv_tc_tma(bits):
    """gemv_tc with the words and scales brought by TMA (tma_descs' 5-D views, whose boxes land
    in the mma fragment's order): == naive at Volundr-32B shapes, pipelined and not, split-K
    and one split, two tile heights."""
    for n, k in ((17408, 5120), (5120, 17408), (15680, 5120)):
        for reps, stages, splits in ((2, 2, None), (1, 3, 1), (2, 1, 2)):
            check_tc(n, k, bits, 128, "cuda", _seed(), tol=1e-3, reps=reps, stages=stages,
                     splits=splits, tma=True)


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cuda_gemv_tc_early_weights(bits):
    """gemv_tc with each set's first 1, 2 or all blocks of weight words loaded before the PDL
    wait: == naive at Volundr-32B shapes, one set per program and several (3 at waves 8),
    capped at 128 registers (spills at 4 blocks) and not, and in a replayed CUDA graph of PDL
    launches (the engine's setting)."""
    for n, k in ((17408, 5120), (5120, 17408), (15680, 5120)):
        for splits in (None, 2):
            for early, kw in ((True, {}), (2, {"maxnreg": 128}), (4, {}),
                              (4, {"maxnreg": 128, "reps": 1}),
                              (1, {"maxnreg": 128, "waves": 8.0}), (2, {"waves": 8.0})):
                check_tc(n, k, bits, 128, "cuda", _seed(), tol=1e-3, splits=splits,
                         early=early, **{"reps": 2, **kw})
    from functools import partial

    from volundr.kernels.quant.gemv_tc import gemv_tc

    for kw in (dict(early=True), dict(early=4), dict(early=1, splits=2)):
        check_graph_replay(partial(gemv_tc, **kw), 1, bits)


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cuda_gemv_tc_group_scales(bits, monkeypatch):
    """Per-group scales (KDA's gated output norm folded into o_proj) at its shape (5120 x 5120,
    40 heads of 128): the engine's config, split-K and one split, early weights and not, one
    partial per group, through engine.quant_matmul_group_scaled, the module path."""
    from volundr.kernels.quant import engine

    monkeypatch.setattr(engine, "GATED_NORM_FOLD", True)
    check_tc_gscale(5120, 5120, bits, 128, "cuda", _seed(), **engine.GEMV_TC_CONFIG[bits])
    check_tc_gscale(5120, 5120, bits, 128, "cuda", _seed(), reps=2, splits=1, early=1)
    check_tc_gscale(5120, 5120, bits, 128, "cuda", _seed(), parts=1, reps=1, splits=3, early=0)
    check_tc_gscale(5120, 5120, bits, 128, "cuda", _seed(), parts=4, via_engine=True)
    check_scaled_module(bits, "cuda", 40, 5120)
    # the scale in x's digits (opt-in): gemv_i8 at M = 1, gemv_i8_rows for a check's rows
    monkeypatch.setattr(engine, "GATED_NORM_I8", True)
    monkeypatch.setattr(engine, "ROWS_GATED_NORM", True)
    for m in (1, 3, 16):
        check_tc_gscale(5120, 5120, bits, 128, "cuda", _seed(), parts=4, via_engine=True, m=m)
        check_scaled_module(bits, "cuda", 40, 5120, m)


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cuda_norm_folded_into_gemv(bits, monkeypatch):
    """The residual add + RMSNorm folded into gemv_tc at Volundr-32B's shapes that read a norm
    (KDA's fused projections, attention's q|k|v, the MLP's gate_up), split-K and one split,
    the engine's config and through engine.quant_matmul_rms_norm: == norm then naive, the
    residual stream exact; and the PreNorm module path skips the norm kernel."""
    from volundr.kernels.quant import engine

    monkeypatch.setattr(engine, "NORM_FOLD", True)
    for n in (15680, 5632, 34816):
        check_tc_norm(n, 5120, bits, 128, "cuda", _seed(), **engine.GEMV_TC_CONFIG[bits])
        check_tc_norm(n, 5120, bits, 128, "cuda", _seed(), reps=2, splits=1)
        check_tc_norm(n, 5120, bits, 128, "cuda", _seed(), via_engine=True)
    check_prenorm_module(bits, "cuda", 5120, (15360, 296))


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cuda_engine_swiglu_in_down(bits):
    """The MLP's down projection on (gate, up) [M, 2 * 17408]: the tensor-core paths apply the
    SwiGLU in their x loads (M <= 16), the others after the SwiGLU kernel; all == naive."""
    from volundr.kernels.norm.naive import naive_swiglu
    from volundr.kernels.quant.engine import quant_matmul

    k = 17408
    qa, qb, sz = _layer(5120, k, bits, 128, "cuda", _seed())
    for m in (1, 4, 16, 40):
        gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
        ref = naive_quant_matmul(naive_swiglu(gu[:, :k], gu[:, k:]).float(), qa, qb, sz, bits,
                                 128, k)
        assert _rel(quant_matmul(gu, qa, qb, sz, bits, 128, swiglu=True), ref) < 8e-3, m


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cuda_grouped_low_rank_pair(bits):
    """KDA's f_b + g_b shape (2 x 5120 x 128) in one launch, bf16, decode to prefill sizes."""
    for m in (1, 4, 16, 40, 300):
        check_grouped(m, 5120, 128, bits, 128, "cuda", _seed(), tol=8e-3, dtype=torch.bfloat16)


@gpu
def test_cuda_lm_head_shape_and_random_linear():
    from volundr.kernels.quant import quantize_random_linear

    layer = quantize_random_linear(262144, 5120, 4, 128, "cuda")
    x = torch.randn(1, 5120, device="cuda", dtype=torch.bfloat16)
    w = layer.dequantize(torch.bfloat16)
    assert _rel(layer(x), x.float() @ w.float().t()) < 8e-3


if __name__ == "__main__":
    run_cpu(sys.argv[1])
