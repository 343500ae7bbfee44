"""Dependent batch-1 GEMVs in one persistent launch (kernels/quant/gemv_chain.py) == the same
gemv_tc calls launched one by one, and the model's MLP through it == the MLP without it.

CPU: under TRITON_INTERPRET=1 (a subprocess: this file run as a script) the chain runs one
launch per stage (programs run one after another there, so a grid barrier would never open):
every stage's item mapping, the shared split-K workspace, the stage plumbing and the model hook
are checked, the barrier is not. CUDA: the real barrier at Volundr-32B shapes, in CUDA graphs.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from interpreted import run_interpreted  # (tests/ is on the path)

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
bf = torch.bfloat16


def _layer(n: int, k: int, bits: int, device: str, seed: int):
    from volundr.kernels.quant.fit import minmax_quant
    from volundr.kernels.quant.pack import pack_scale_zero, to_kernel_layout

    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device) / k ** 0.5
    q, s, z = minmax_quant(w, bits, 128, shrink=0.9)
    return *to_kernel_layout(q, bits, 128), pack_scale_zero(s, z)


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def check_chain(bits: int, device: str, d: int, f: int, tail: bool, programs: int | None,
                splits: int | None, reps: int = 1) -> None:
    """[o_proj (residual epilogue) ->] gate_up (x = h w, rscale) -> down (SwiGLU, residual
    epilogue) as a chain and as launches; with equal splits bit for bit equal, else close.
    All outputs compared: gate_up, and each residual epilogue's h, h w and sums of squares."""
    from volundr.kernels.quant.gemv_chain import _barriers, gemv_chain
    from volundr.kernels.quant.gemv_tc import gemv_tc, tiles

    lay_o = _layer(d, d, 4, device, _seed()) if tail else None
    lay_u = _layer(2 * f, d, bits, device, _seed())
    lay_d = _layer(d, f, bits, device, _seed())
    r0, nw0, x0, r1, nw1 = (torch.randn(1, d, device=device).to(bf) for _ in range(5))
    nw0, nw1 = nw0[0].abs() + 0.5, nw1[0].abs() + 0.5
    n_t = tiles(d, reps)

    def bufs():
        return dict(h0=torch.empty(1, d, device=device, dtype=bf),
                    xw0=torch.empty(1, d, device=device, dtype=bf),
                    ss0=torch.empty(n_t, device=device),
                    gu=torch.empty(1, 2 * f, device=device, dtype=bf),
                    h=torch.empty(1, d, device=device, dtype=bf),
                    xw=torch.empty(1, d, device=device, dtype=bf),
                    ss=torch.empty(n_t, device=device))

    def stages(b):
        kw = dict(group_size=128, reps=reps, splits=splits)
        st = []
        if tail:
            st.append(dict(x=x0, qa=lay_o[0], qb=lay_o[1], sz=lay_o[2], bits=4, out=b["h0"],
                           residual=(r0, nw0, b["xw0"], b["ss0"]), **kw))
            xw, ss, res = b["xw0"], b["ss0"], b["h0"]
        else:  # the MLP's input as an output projection would have left it
            xw, ss, res = r0 * nw0, torch.rand(n_t, device=device) * d, x0
        st.append(dict(x=xw, qa=lay_u[0], qb=lay_u[1], sz=lay_u[2], bits=bits, out=b["gu"],
                       rscale=(ss, 1e-6), **kw))
        st.append(dict(x=b["gu"], qa=lay_d[0], qb=lay_d[1], sz=lay_d[2], bits=bits, out=b["h"],
                       swiglu=True, residual=(res, nw1, b["xw"], b["ss"]), **kw))
        return st

    torch.manual_seed(_seed())
    ref, got = bufs(), bufs()
    st_ref = stages(ref)
    for s in st_ref:
        s = dict(s)
        gemv_tc(s.pop("x"), s.pop("qa"), s.pop("qb"), s.pop("sz"), s.pop("bits"),
                s.pop("group_size"), **s)
    st = stages(got)
    if not tail:  # the same random input as the reference's
        st[0]["x"], st[0]["rscale"] = st_ref[0]["x"], st_ref[0]["rscale"]
    gemv_chain(st, programs=programs)
    for name in ref:
        if not tail and name in ("h0", "xw0", "ss0"):
            continue
        if splits is not None:
            assert torch.equal(got[name], ref[name]), (bits, tail, name)
        else:
            a, b = got[name].double(), ref[name].double()
            assert ((a - b).norm() / b.norm()).item() < 2e-2, (bits, tail, name)
    if device == "cuda":
        assert int(_barriers(x0.device).abs().sum()) == 0  # left at zero for the next launch


def _mlp(bits: int, device: str, d: int, f: int):
    """The model's MLP with random mixed-bit gate, up and down projections, after loading."""
    from volundr.kernels.quant import quantize_random_linear
    from volundr.model.layers import MLP

    mlp = MLP(d, f)
    mlp.gate_proj = quantize_random_linear(f, d, bits, 128, device, seed=_seed())
    mlp.up_proj = quantize_random_linear(f, d, bits, 128, device, seed=_seed())
    mlp.down_proj = quantize_random_linear(d, f, bits, 128, device, seed=_seed())
    mlp.after_load()
    return mlp


def check_mlp_module(bits: int, device: str, d: int = 256, f: int = 256) -> None:
    """The model's MLP on a Normed input with `post`: with engine.GEMV_CHAIN its two GEMVs
    run as one chain (and the two-launch path never runs), giving the unchained path's
    Normed (h, h w and the norm's scale) within rounding."""
    from volundr import ops
    from volundr.kernels.quant import engine, gemv_chain
    from volundr.model.layers import NextNorm, Normed, RMSNorm

    mlp = _mlp(bits, device, d, f)
    norm = RMSNorm(d, 1e-6).to(device=device, dtype=bf)
    norm.weight.data = (torch.rand(d, device=device) + 0.5).to(bf)
    h = torch.randn(1, d, device=device).to(bf)
    xw = (h.float() * 1.3).to(bf)
    ss = (h.float() ** 2).sum(-1, keepdim=True) * torch.tensor([[0.25, 0.75]], device=device)
    on_cpu = mock.patch.object(ops, "_fast", lambda t, name: ops._fast_module(name))
    outs = []
    with on_cpu if device == "cpu" else nullcontext():
        for chained in (True, False):
            x = Normed(xw, ss, 1e-6, h)
            with mock.patch.object(engine, "GEMV_CHAIN", chained), \
                    mock.patch.object(gemv_chain, "gemv_chain",
                                      side_effect=gemv_chain.gemv_chain) as spy:
                y = mlp(x, post=NextNorm(x, norm))
            assert isinstance(y, Normed) and spy.call_count == int(chained), (chained, bits)
            outs.append(y)
    a, b = outs
    # ss [1, P] as the launches make it, so that the next input projection folds the scale
    assert a.ss.shape == b.ss.shape, (a.ss.shape, b.ss.shape)
    for t, u in ((a.residual_out, b.residual_out), (a.value(), b.value())):
        assert ((t.double() - u.double()).norm() / u.double().norm()).item() < 2e-2, bits


def check_tail_module(bits: int, device: str, gated: bool, d: int = 256, f: int = 256) -> None:
    """A decoder layer's tail: the mixer's pending output projection (x plain, or gated: KDA's
    GroupScaled) and the MLP with the next norm, chained in one launch
    (`MLP.forward_chained`), == out_proj's Normed and then the MLP, stream and output."""
    from volundr import ops
    from volundr.kernels.quant import engine, gemv_chain, quantize_random_linear
    from volundr.model.layers import GroupScaled, NextNorm, Normed, PendingOut, RMSNorm

    mlp = _mlp(bits, device, d, f)
    o_proj = quantize_random_linear(d, d, 4, 128, device, seed=_seed())
    norms = [RMSNorm(d, 1e-6).to(device=device, dtype=bf) for _ in range(2)]
    for n in norms:
        n.weight.data = (torch.rand(d, device=device) + 0.5).to(bf)
    h = torch.randn(1, d, device=device).to(bf)
    u = torch.randn(1, d, device=device).to(bf)
    x = GroupScaled(u, torch.rand(1, d // 128, 2, device=device) * 50 + 1, 1e-6) if gated else u
    on_cpu = mock.patch.object(ops, "_fast", lambda t, name: ops._fast_module(name))
    with on_cpu if device == "cpu" else nullcontext(), \
            mock.patch.object(engine, "GEMV_CHAIN", True), \
            mock.patch.object(gemv_chain, "gemv_chain", side_effect=gemv_chain.gemv_chain) as spy:
        h0, y = mlp.forward_chained(PendingOut(o_proj, x, NextNorm(h, norms[0], True)),
                                    norms[1])
        assert spy.call_count == 1 and len(spy.call_args[0][0]) == 3
        mid = PendingOut(o_proj, x, NextNorm(h, norms[0], True)).value()
        assert isinstance(mid, Normed)
        with mock.patch.object(engine, "GEMV_CHAIN", False):
            ref = mlp(mid, post=NextNorm(mid, norms[1]))
    assert y.ss.shape == ref.ss.shape, (y.ss.shape, ref.ss.shape)
    for t, r in ((h0, mid.residual_out), (y.residual_out, ref.residual_out),
                 (y.value(), ref.value())):
        assert ((t.double() - r.double()).norm() / r.double().norm()).item() < 2e-2, bits


def run_cpu() -> None:
    from volundr.kernels.quant import engine

    engine.TC_MIN_DIM = 0  # (a child process: the small shapes take the tensor-core path)
    for bits in (2, 3, 4):
        # more items than programs (3 programs: several items each, some with none), split K
        check_chain(bits, "cpu", 256, 256, tail=False, programs=3, splits=2)
        check_mlp_module(bits, "cpu")
    # three stages (o_proj first), one split, 2 reps; the layer-tail hook, KDA's and attention's
    check_chain(4, "cpu", 256, 256, tail=True, programs=5, splits=1, reps=2)
    check_tail_module(4, "cpu", gated=True)
    check_tail_module(3, "cpu", gated=False)


def test_chain_interpreter():
    run_interpreted(__file__, timeout=900, VOLUNDR_QUANT_GEMV="tc")


def test_occupancy_matches_sm90_limits():
    """P sizing: sm_90's register file (64 K, per-warp units of 256), 32 blocks, 64 warps and
    228 KiB of shared memory per SM."""
    from volundr.kernels.quant.gemv_chain import occupancy

    assert occupancy(128, 0, 1) == 16 and occupancy(168, 0, 1) == 12
    assert occupancy(64, 0, 1) == 32 and occupancy(32, 0, 1) == 32  # the block limit
    assert occupancy(128, 0, 4) == 4 and occupancy(255, 0, 2) == 4
    assert occupancy(64, 100 * 1024, 1) == 2  # shared memory


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cuda_chain_matches_launches(bits):
    """Volundr-32B's MLP (5120 / 17408) and a KDA layer's tail (o_proj first): bit for bit
    with the launches' splits; at the chain's own P and splits within rounding."""
    d, f = 5120, 17408
    check_chain(bits, "cuda", d, f, tail=False, programs=None, splits=4, reps=2)
    check_chain(bits, "cuda", d, f, tail=True, programs=None, splits=None, reps=2)
    check_chain(bits, "cuda", d, f, tail=False, programs=264, splits=None, reps=2)


@gpu
@pytest.mark.parametrize("bits", [2, 4])
def test_cuda_chain_in_a_graph_and_the_model_path(bits):
    """The engine's MLP chain, twice back to back in a CUDA graph (the second launched while
    the first runs, by PDL), replayed twice (barrier and split-K counters left at zero),
    == eager; and the model's MLP and layer-tail hooks."""
    from volundr.kernels.quant import engine
    from volundr.kernels.quant.gemv_chain import _barriers

    d, f = 5120, 17408
    up, down = _layer(2 * f, d, bits, "cuda", _seed()), _layer(d, f, bits, "cuda", _seed())
    xw, res = torch.randn(1, d, device="cuda").to(bf), torch.randn(1, d, device="cuda").to(bf)
    ss = torch.rand(80, device="cuda") * d
    nw = torch.rand(d, device="cuda").to(bf) + 0.5
    with mock.patch.object(engine, "GEMV_CHAIN", True):
        run = lambda: engine.quant_mlp_chain(xw, ss, 1e-6, (*up, bits, 128),  # noqa: E731
                                             (*down, bits, 128), res, nw)
        eager = [t.clone() for t in run()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # two chains back to back (PDL between them)
            outs = run() + run()
        for _ in range(2):
            for t in outs:
                t.fill_(float("nan"))
            graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, eager + eager))
        assert int(_barriers(xw.device).abs().sum()) == 0
    check_mlp_module(bits, "cuda", 5120, 17408)
    for gated in (False, True):
        check_tail_module(bits, "cuda", gated, 5120, 17408)


if __name__ == "__main__":
    run_cpu()
