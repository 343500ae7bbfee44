"""The residual add + next RMSNorm split across two mixed-bit GEMVs (engine.RESIDUAL_NORM_FOLD):
the output projection's epilogue (gemv_tc `residual=`: h = y + r, h w, per-tile sums of h^2)
and the next input projection's scale (`rscale=`) == the naive matmul, residual add, RMSNorm
and matmul; the model's layers with it == without it, the norm kernel not run at the folded
boundaries.

CPU: the kernels run under TRITON_INTERPRET=1 in a subprocess (this file run as a script), so
the variable never reaches other tests. CUDA: Volundr-32B shapes.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from interpreted import run_interpreted  # (tests/ is on the path)
from test_quant import _rel, _seed  # (tests/ is on the path under pytest and as a script)

from volundr.kernels.norm.naive import naive_rms_norm, naive_swiglu
from volundr.kernels.quant.naive import naive_quant_matmul

CUDA = torch.cuda.is_available()
EPS = 1e-6


def _weights(n: int, k: int, bits: int, g: int, device, seed: int):
    from volundr.kernels.quant import quantize_random_linear

    lin = quantize_random_linear(n, k, bits, g, device, seed=seed)
    return lin.qa, lin.qb, lin.sz


def check_pair(d: int, k: int, bits: tuple[int, int], g: int, device, seed: int,
               n_next: int | None = 64, mode: str = "plain", kw=None, kw_next=None) -> None:
    """Producer y = x @ Wp^T ([1, k] -> [1, d]; mode "swiglu": x = SiLU(gate) * up, "gscale":
    x's groups scaled by rsqrt(sum(gs) / g + eps)) with residual r and norm weight w in its
    epilogue, then (n_next: None = none) the consumer z = RMSNorm(h) @ Wc^T through rscale."""
    from volundr.kernels.quant.gemv_tc import gemv_tc, tiles

    gen = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16
    kw, kw_next = kw or dict(reps=2), kw_next or dict(reps=2)
    qp = _weights(d, k, bits[0], g, device, seed)
    xin = torch.randn(1, 2 * k if mode == "swiglu" else k, generator=gen, device=device).to(bf)
    x, extra = xin.float(), {}
    if mode == "swiglu":
        x, extra = naive_swiglu(xin[:, :k], xin[:, k:]).float(), dict(swiglu=True)
    elif mode == "gscale":
        gs = torch.rand(k // g, 2, generator=gen, device=device) * 100 + 1
        x = (x.view(-1, g) * torch.rsqrt(gs.sum(-1) / g + EPS)[:, None]).view(1, k)
        extra = dict(gscale=(gs, EPS))
    r = torch.randn(1, d, generator=gen, device=device).to(bf)
    w = (torch.rand(d, generator=gen, device=device) + 0.5).to(bf)
    y_ref = naive_quant_matmul(x, *qp, bits[0], g, k).to(bf)
    h_ref = y_ref + r
    h = torch.full((1, d), float("nan"), device=device, dtype=bf)
    xw = torch.full_like(h, float("nan"))
    ss = torch.full((tiles(d, kw.get("reps", 4), kw.get("num_warps", 1)),), float("nan"),
                    device=device)
    gemv_tc(xin, *qp, bits[0], g, out=h, residual=(r, w, xw, ss), **extra, **kw)
    if device == "cuda":
        assert _rel(h, h_ref) < 4e-3, "h"
    else:  # the interpreter truncates fp32 -> bf16 (y, then y + r) where the GPU rounds to
        # nearest: up to 3 bf16 ulps of the larger of y and h per element are that, and only
        # the error beyond them counts (a plain norm-relative bound failed when one element
        # dominated the norm and its two truncations added up)
        mag = torch.maximum(y_ref.abs(), h_ref.abs()).float()
        excess = ((h.float() - h_ref.float()).abs() - mag * 3 * 2.0 ** -7).clamp_min(0)
        assert excess.norm() < 1e-2 * h_ref.float().norm(), "h"
    xw_ref = (h.float() * w.float()).to(bf)
    assert torch.equal(xw, xw_ref) if device == "cuda" else _rel(xw, xw_ref) < 8e-3, "h w"
    assert abs(ss.sum().item() / h.float().pow(2).sum().item() - 1) < 1e-4, "sum of h^2"
    if n_next is None:
        return
    qc = _weights(n_next, d, bits[1], g, device, seed + 1)
    z_ref = naive_quant_matmul(naive_rms_norm(h, w, EPS).float(), *qc, bits[1], g, d)
    z = torch.full((1, n_next), float("nan"), device=device)
    gemv_tc(xw, *qc, bits[1], g, out=z, rscale=(ss, EPS), **kw_next)
    assert _rel(z, z_ref) < (8e-3 if device == "cuda" else 2e-2), "next GEMV"


def _model_layers(seed: int, device: str, g: int = 64, hidden: int = 128, mlp: int = 256,
                  bits: int = 4):
    """Two KDA decoder layers (hidden 128, 2 heads of 32, MLP 256), every linear 4-bit (o_proj
    at groups of 32 = the head dim: its gated norm folds too), bf16, weights loaded; hidden,
    mlp and bits (but o_proj's) as given."""
    import dataclasses

    from volundr.config import EngramConfig, KDAConfig
    from volundr.converter.presets import get_config
    from volundr.kernels.quant import quantize_random_linear
    from volundr.model.quant_linear import QuantLinear
    from volundr.model.volundr import DecoderLayer

    cfg = dataclasses.replace(
        get_config("tiny"), hidden_size=hidden, intermediate_size=mlp,
        kda=KDAConfig(num_heads=2, head_dim=32, conv_size=4, low_rank_dim=32),
        engram=EngramConfig(layers=()))
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList(DecoderLayer(cfg, False, False) for _ in range(2))
    with torch.no_grad():
        for p in layers.parameters():
            p.normal_(0, 0.3)
        for m in layers.modules():
            if hasattr(m, "weight") and m.weight.dim() == 1:  # norms
                m.weight.uniform_(0.5, 1.5)
    for name, m in list(layers.named_modules()):
        if isinstance(m, torch.nn.Linear):
            parent, _, attr = name.rpartition(".")
            q = quantize_random_linear(m.out_features, m.in_features,
                                       4 if attr == "o_proj" else bits,
                                       32 if attr == "o_proj" else min(g, m.in_features),
                                       "cpu", seed=seed + len(name))
            if attr in ("o_proj", "down_proj"):
                q.parallel = "row"
            setattr(layers.get_submodule(parent), attr, q)
    layers = layers.to(device=device, dtype=torch.bfloat16)
    for m in [m for m in layers.modules() if hasattr(m, "after_load")]:
        m.after_load()
    assert isinstance(layers[0].mlp.down_proj, QuantLinear)
    return cfg, layers


def _decode_inputs(cfg, layers, device: str):
    """(h0, batch, reset): one decode token's input, its batch, and a reset of the layers'
    KDA states to fixed random ones."""
    state0 = torch.randn(3, 2, 32, 32, device=device) * 0.3
    conv0 = torch.randn(3, 3 * 2 * 32, 3, device=device).to(torch.bfloat16)
    b = SimpleNamespace(max_q_len=1, slot_ids=torch.tensor([2], device=device), cu_list=[0, 1],
                        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=device))
    h0 = torch.randn(1, cfg.hidden_size, device=device).to(torch.bfloat16)

    def reset():
        for layer in layers:
            layer.kda.state, layer.kda.conv_state = state0.clone(), conv0.clone()

    return h0, b, reset


def check_model_digits(seed: int) -> None:
    """Two KDA layers (hidden 512, MLP 1024, 3-bit, groups of 128) at one decode token on
    gemv_i8, with x's digits from the epilogues (VOLUNDR_I8_DIGITS_EPILOGUE: Normed carries
    them, the MLPs run as quant_mlp_i8) and from launches: fewer launches, the same output."""
    from volundr.kernels.quant import engine, gemv_i8
    from volundr.model.volundr import run_layers

    cfg, layers = _model_layers(seed, "cuda", 128, 512, 1024, 3)
    h0, b, reset = _decode_inputs(cfg, layers, "cuda")
    out = {}
    for on in (True, False):
        reset()
        with (mock.patch.object(engine, "TC_MIN_DIM", 0),
              mock.patch.object(engine, "GEMV_PATH", "i8"),
              mock.patch.object(engine, "DIGITS_EPILOGUE", on),
              mock.patch.object(gemv_i8, "x_digits", wraps=gemv_i8.x_digits) as calls):
            y = run_layers(layers, h0, b)
        out[on] = (y, [lay.kda.state.clone() for lay in layers], calls.call_count)
    (y1, s1, n1), (y0, s0, n0) = out[True], out[False]
    # gate_up's and down's launches go in both layers but the last down's, and the second
    # in_proj's; two stay: the first in_proj's input comes from a norm kernel, and the last
    # layer's MLP has no next norm to fold (run_layers), so it runs unfused (H100 run 92: 2 of 6)
    assert n0 - n1 >= 4 and n1 <= 2, (n1, n0)
    assert all(_rel(a, c) < 1e-2 for a, c in zip(s1, s0)), "states"
    assert _rel(y1, y0) < 1e-2, _rel(y1, y0)


def naive_rows(x, qa, qb, sz, bits, group_size=128, swiglu=False, out=None, rscale=None,
               residual=None, **config):
    """gemv_i8_rows' contract in torch (naive_quant_matmul, then its epilogue's rounding): the
    CPU check of the engine's wiring around it, which the interpreter cannot run (its PTX)."""
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    xf = naive_swiglu(x[:, :k], x[:, k:]).float() if swiglu else x.float()
    y = naive_quant_matmul(xf, qa, qb, sz, bits, group_size, k)
    if rscale is not None:
        rs, eps = rscale
        y = y * torch.rsqrt(rs.sum(1, keepdim=True) / k + eps)
    if residual is not None:
        r, w, xw, ss = residual
        h = (y.to(x.dtype).float() + r.float()).to(x.dtype)
        xw.copy_((h.float() * w.float()).to(x.dtype))
        ss.copy_(h.float().pow(2).view(h.shape[0], ss.shape[1], -1).sum(-1))
        y = h
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def check_model_rows_fold(seed: int, device: str = "cpu", m: int = 3) -> None:
    """Two KDA layers (hidden 512, MLP 1024, 3-bit, groups of 128) at m decode tokens on
    gemv_i8_rows, with the residual add + next RMSNorm folded per row (engine.ROWS_FOLD) and
    not: the folded boundaries skip the norm kernel, each Normed carries ss [m, tiles], and the
    output and states equal the unfolded run's. On the CPU gemv_i8_rows stands in as
    `naive_rows` (its PTX cannot run there) and the other kernels run in the interpreter."""
    from contextlib import ExitStack

    from volundr import ops
    from volundr.kernels.quant import engine, gemv_i8_rows
    from volundr.model.volundr import run_layers

    cfg, layers = _model_layers(seed, device, 128, 512, 1024, 3)
    state0 = torch.randn(m, 2, 32, 32, device=device) * 0.3
    conv0 = torch.randn(m, 3 * 2 * 32, 3, device=device).to(torch.bfloat16)
    b = SimpleNamespace(max_q_len=1, slot_ids=torch.arange(m, device=device),
                        cu_list=list(range(m + 1)),
                        cu_seqlens=torch.arange(m + 1, dtype=torch.int32, device=device))
    h0 = torch.randn(m, cfg.hidden_size, device=device).to(torch.bfloat16)
    kernel = ({"side_effect": naive_rows} if device == "cpu"
              else {"wraps": gemv_i8_rows.gemv_i8_rows})
    out = {}
    for fold in (True, False):
        for layer in layers:
            layer.kda.state, layer.kda.conv_state = state0.clone(), conv0.clone()
        with ExitStack() as stack:
            if device == "cpu":
                stack.enter_context(mock.patch.object(
                    ops, "_fast", lambda t, name: ops._fast_module(name)))
                stack.enter_context(mock.patch.object(engine, "GEMM16_PATH", "tile"))
            for name, value in (("TC_MIN_DIM", 0), ("GEMV_PATH", "i8"), ("I8_ROWS", 16),
                                ("ROWS_FOLD", fold)):
                stack.enter_context(mock.patch.object(engine, name, value))
            rows = stack.enter_context(mock.patch.object(gemv_i8_rows, "gemv_i8_rows",
                                                         **kernel))
            calls = stack.enter_context(mock.patch.object(ops, "rms_norm", wraps=ops.rms_norm))
            y = run_layers(layers, h0, b)
            assert rows.call_count >= 4, rows.call_count
            if fold:
                folded = [c for c in rows.call_args_list if c.kwargs.get("residual")]
                assert folded and all(c.kwargs["residual"][3].shape[0] == m for c in folded)
        out[fold] = (y, [lay.kda.state.clone() for lay in layers], calls.call_count)
    (y1, s1, n1), (y0, s0, n0) = out[True], out[False]
    assert n1 < n0, (n1, n0)  # (o_proj's groups of 32 keep its boundary on the norm kernel)
    assert all(_rel(a, c) < 1e-2 for a, c in zip(s1, s0)), "states"
    assert y1.shape == (m, cfg.hidden_size) and _rel(y1, y0) < 2e-2, _rel(y1, y0)


def check_model_layers(seed: int, device: str = "cpu") -> None:
    """run_layers over two KDA layers at one decode token: with RESIDUAL_NORM_FOLD the three
    boundaries (mixer -> MLP twice, layer 0 -> 1) skip the norm kernel and Normed.value; same
    output and states as without (the first layer's input norm runs either way). On the CPU
    the kernels take CPU tensors (the interpreter)."""
    from contextlib import nullcontext

    from volundr import ops
    from volundr.kernels.quant import engine
    from volundr.model.layers import Normed
    from volundr.model.volundr import run_layers

    cfg, layers = _model_layers(seed, device)
    h0, b, reset = _decode_inputs(cfg, layers, device)
    on_cpu = mock.patch.object(ops, "_fast", lambda t, name: ops._fast_module(name))
    out = {}
    for fold in (True, False):
        reset()
        with (on_cpu if device == "cpu" else nullcontext(),
              mock.patch.object(engine, "TC_MIN_DIM", 0),
              mock.patch.object(engine, "RESIDUAL_NORM_FOLD", fold),
              mock.patch.object(Normed, "value", side_effect=AssertionError("not folded")),
              mock.patch.object(ops, "rms_norm", wraps=ops.rms_norm) as calls):
            y = run_layers(layers, h0, b)
        out[fold] = (y, [lay.kda.state.clone() for lay in layers], calls.call_count)
    (y1, s1, n1), (y0, s0, n0) = out[True], out[False]
    assert (n1, n0) == (1, 4), (n1, n0)  # 3 of the 4 norms folded
    assert all(_rel(a, c) < 1e-2 for a, c in zip(s1, s0)), "states"
    assert y1.shape == (1, cfg.hidden_size) and _rel(y1, y0) < 2e-2, _rel(y1, y0)


def run_cpu() -> None:
    from volundr.kernels.quant import engine

    # every width as producer and as consumer; the producer's N = 640 (10 tiles of 64) so the
    # consumer reads 5 groups (a ragged last set); one split and split-K on each side
    check_pair(640, 512, (4, 2), 128, "cpu", _seed(), kw=dict(reps=2, splits=1),
               kw_next=dict(reps=2, splits=2))
    check_pair(640, 512, (2, 3), 128, "cpu", _seed(), mode="swiglu", kw=dict(reps=2, splits=2),
               kw_next=dict(reps=1, splits=1))
    check_pair(640, 512, (3, 4), 128, "cpu", _seed(), mode="gscale",
               kw=dict(reps=2, splits=1, early=1))
    check_pair(200, 512, (3, 3), 128, "cpu", _seed(), n_next=None,  # a ragged last tile
               kw=dict(reps=1, splits=2))
    check_pair(576, 256, (2, 4), 64, "cpu", _seed(), kw=dict(reps=4, splits=1))  # ragged, G 64
    # the engine's entry points: on by default, off with the switch (None: the caller runs
    # the norm); at M = 1 only, with a residual of the output's shape (the size floor lifted:
    # small shapes)
    assert engine.RESIDUAL_NORM_FOLD
    engine.TC_MIN_DIM = 0
    qa, qb, sz = _weights(256, 256, 4, 128, "cpu", 0)
    x = torch.randn(2, 256).to(torch.bfloat16)
    args = (x[:1], x[1:], x[0], qa, qb, sz, 4, 128)
    engine.RESIDUAL_NORM_FOLD = False
    assert engine.quant_matmul_residual_norm(*args) is None
    engine.RESIDUAL_NORM_FOLD = True
    h, xw, ss, dg = engine.quant_matmul_residual_norm(*args)
    assert dg is None  # (x's digits: on the i8 path only)
    assert h.shape == xw.shape == (1, 256) and ss.shape == (1, 4)  # 4 tiles of 64 rows
    assert engine.quant_matmul_rscaled(xw, ss[0], EPS, qa, qb, sz, 4, 128).shape == (1, 256)
    assert engine.quant_matmul_residual_norm(x, x, x[0], qa, qb, sz, 4, 128) is None
    assert engine.quant_matmul_rscaled(x, ss[0], EPS, qa, qb, sz, 4, 128) is None
    engine.TC_MIN_DIM = 2048
    check_model_layers(_seed())
    check_model_rows_fold(_seed())


def test_interpreter():
    run_interpreted(__file__, timeout=900, VOLUNDR_QUANT_GEMV="tc")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [(4, 3), (2, 4), (3, 2)])
def test_cuda_residual_norm_fold_volundr_shapes(bits):
    """o_proj (5120 x 5120, gscale) -> gate_up (34816 x 5120); down_proj (5120 x 17408,
    SwiGLU) -> in_proj (15680 x 5120), with the engine's GEMV configs."""
    from volundr.kernels.quant.engine import GEMV_TC_CONFIG

    kp, kc = GEMV_TC_CONFIG[bits[0]], GEMV_TC_CONFIG[bits[1]]
    check_pair(5120, 5120, bits, 128, "cuda", _seed(), 34816, "gscale", kp, kc)
    check_pair(5120, 17408, bits, 128, "cuda", _seed(), 15680, "swiglu", kp, kc)
    check_pair(5120, 5120, bits, 128, "cuda", _seed(), 5120, "plain", kp, kc)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_model_layers_digits_epilogue():
    check_model_digits(_seed())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_model_layers_rows_fold():
    check_model_rows_fold(_seed(), "cuda")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_model_layers_fold():
    """check_model_layers on the GPU: the CUDA kernels throughout, gemv_tc's real PTX."""
    check_model_layers(_seed(), "cuda")


if __name__ == "__main__":
    run_cpu()
