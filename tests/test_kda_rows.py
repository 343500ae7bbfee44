"""A speculative check's conv + KDA and its commit in one launch each (kernels/kda/rows.py) against
the naive references: the check's output == naive conv -> naive recurrence on each sequence's
rows, with the states untouched; the commit's state and conv tail == the naive ones after each
sequence's rows; gap rows and a padding sequence's rows are zeros. And the KDA layer's check +
commit with the fused launches == without (ops.kda_rows vs `_mix`).

CPU: the kernels run under TRITON_INTERPRET=1 in a subprocess (this file run as a script,
tests/interpreted.py), so the variable never reaches other tests; the math in fp32 there, bf16
loosely (the interpreter truncates to bf16). CUDA: Volundr-32B shapes (40 heads of 128).
"""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted  # (tests/ is on the path)
from test_quant import (  # (tests/ is on the path under pytest and as a script)
    _rel,
    _seed,
    random_kda,
)

from volundr.kernels.kda.naive import kda_gate, naive_causal_conv1d, naive_recurrent_kda
from volundr.kernels.norm.naive import naive_rms_norm_gated
from volundr.model.layers import GroupScaled

CUDA = torch.cuda.is_available()


def _layout(lens: list[int], L: int, slots: list[int], device: str):
    """check_layout's cu [2n + 1] and slot ids [2n] for sequences of lens[i] rows out of L."""
    cu = [0]
    for i, q in enumerate(lens):
        cu += [i * L + q, (i + 1) * L]
    ids = [x for s in slots for x in (s, -1)]
    return (torch.tensor(cu, dtype=torch.int32, device=device),
            torch.tensor(ids, dtype=torch.long, device=device))


def _naive_rows(qkv, cw, tail, g, beta, h0, A_log, dt_bias, H, K, V):
    """One sequence's rows: (o [t, H, V] in qkv.dtype, final state, new tail)."""
    t = qkv.shape[0]
    tail = tail.clone()[None]
    y = naive_causal_conv1d(qkv, cw, tail, None, "silu")
    q, k, v = y[:, :H * K].view(t, H, K), y[:, H * K:2 * H * K].view(t, H, K), y[:, 2 * H * K:]
    o, hT = naive_recurrent_kda(
        q[None], k[None], v.reshape(t, H, V)[None], kda_gate(g, A_log, dt_bias)[None],
        torch.sigmoid(beta.float())[None], scale=K ** -0.5, initial_state=h0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0], hT[0], tail[0]


def check_rows(lens: list[int], L: int, H: int, K: int, W: int, device: str, seed: int,
               pad: tuple = (), BV: int | None = None, tol: float = 1e-2,
               bf: torch.dtype = torch.bfloat16) -> None:
    """kda_rows's check and commit on sequences of lens[i] rows out of L each (check_layout's
    rows, a padding sequence at the indices in `pad`) == `_naive_rows` per sequence; the check
    leaves both states bit for bit as they were; the commit touches no other slot and leaves
    the arrival counters at zero. `bf`: the activations' dtype. The gated check (o w
    sigmoid(z) and the partial sums of squares) == o with the naive gated output norm, its
    per-head scale applied as o_proj's GEMV does (GroupScaled)."""
    from volundr.kernels.kda.decode import _counters
    from volundr.kernels.kda.rows import kda_rows

    torch.manual_seed(seed)
    V, n = K, len(lens)
    C, slots, T = 2 * H * K + H * V, n + 3, n * L
    qkv = torch.randn(T, C + 8, device=device).to(bf)[:, 4:4 + C]  # a column slice
    g = torch.randn(T, 2 * H * K, device=device).to(bf)[:, :H * K].view(T, H, K)
    beta = torch.randn(T, H + 3, device=device).to(bf)[:, 3:]
    cw = torch.randn(C, W, device=device).to(bf)
    A_log = torch.rand(H, device=device) * 2 - 0.5
    dt_bias = torch.randn(H * K, device=device) * 0.5
    ids = torch.randperm(slots, device=device)[:n].tolist()
    for i in pad:
        ids[i] = -1
    cu, slot_ids = _layout(lens, L, ids, device)
    cs = torch.randn(slots, C, W - 1, device=device).to(bf)
    pool = torch.randn(slots, H, K, V, device=device) * 0.3
    cs0, pool0 = cs.clone(), pool.clone()
    args = (qkv, cw, cs, g, beta, pool, slot_ids, cu, K ** -0.5, A_log, dt_bias)
    o = kda_rows(*args, BV=BV)
    assert torch.equal(cs, cs0) and torch.equal(pool, pool0), "a check wrote a state"
    z = torch.randn(T, 2 * H * V, device=device).to(bf)[:, H * V:].view(T, H, V)  # fg_b's view
    nw = (torch.rand(V, device=device) + 0.5).to(bf)
    u, ss = kda_rows(*args, BV=BV, gated=(z, nw))
    assert torch.equal(cs, cs0) and torch.equal(pool, pool0), "a gated check wrote a state"
    kda_rows(*args, update=True, BV=BV)
    assert not _counters(qkv.device, n * H)[:n * H].any(), "counters left non-zero"
    dead = torch.ones(T, dtype=torch.bool, device=device)
    for i, (q, s) in enumerate(zip(lens, ids)):
        if s < 0:
            continue
        r = slice(i * L, i * L + q)
        dead[r] = False
        o_ref, h_ref, tail_ref = _naive_rows(qkv[r], cw, cs0[s], g[r], beta[r], pool0[s],
                                             A_log, dt_bias, H, K, V)
        errs = [_rel(o[r], o_ref), _rel(pool[s], h_ref)]
        assert max(errs) < tol, (i, "output, state", errs)
        assert torch.equal(cs[s], tail_ref), (i, "conv tail")
        ref = naive_rms_norm_gated(o_ref, nw, z[r], 1e-6).float()
        got = GroupScaled(u[r].reshape(q, H * V), ss[r], 1e-6).value().view(q, H, V).float()
        assert _rel(got, ref) < tol, (i, "gated", _rel(got, ref))
    assert not o[dead].any() and not u[dead].any() and not ss[dead].any(), "gap / padding rows"
    others = [s for s in range(slots) if s not in ids]
    assert torch.equal(pool[others], pool0[others]) and torch.equal(cs[others], cs0[others])


def check_layer(seed: int, device: str = "cpu", gated: bool = False) -> None:
    """A KDA layer's check of 2 sequences x 3 rows (tiny shapes, mixed-bit projections) and its
    commit of 1 and 3 rows with ops.kda_rows == with the unfused conv and recurrence. gated
    (heads of 128 = the quant group): with the check's gated output norm folded into kda_rows
    and o_proj's gemv_i8_rows (ROWS_GATED_NORM) == without; on the CPU gemv_i8_rows (PTX) is
    replaced by `_naive_i8_rows`, so that the fold's plumbing is checked there too."""
    import dataclasses
    from contextlib import ExitStack
    from functools import partial
    from types import SimpleNamespace
    from unittest import mock

    from volundr import ops
    from volundr.config import KDAConfig
    from volundr.converter.presets import get_config
    from volundr.kernels.kda import engine as kda_engine
    from volundr.kernels.quant import engine, quantize_random_linear
    from volundr.model.kda import KDA

    H, D = (4, 128) if gated else (2, 32)
    cfg = dataclasses.replace(get_config("tiny"), hidden_size=128 * (4 if gated else 1),
                              kda=KDAConfig(num_heads=H, head_dim=D, conv_size=4,
                                            low_rank_dim=32))
    layer = random_kda(cfg, seed)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
        m = getattr(layer, name)
        setattr(layer, name, quantize_random_linear(m.out_features, m.in_features, 4, D,
                                                    "cpu", seed=seed + i))
    layer = layer.to(device=device, dtype=torch.bfloat16)
    layer.after_load()
    L, state0 = 3, torch.randn(4, H, D, D, device=device) * 0.3
    conv0 = torch.randn(4, 3 * H * D, 3, device=device).to(torch.bfloat16)
    x = torch.randn(2 * L, cfg.hidden_size, device=device).to(torch.bfloat16)
    cu, ids = _layout([L, L], L, [2, 0], device)
    cu_c, _ = _layout([1, 3], L, [2, 0], device)
    b = SimpleNamespace(max_q_len=L, slot_ids=ids, cu_seqlens=cu, cu_list=cu.tolist(),
                        rows=True, stash=[])
    bc = SimpleNamespace(max_q_len=L, slot_ids=ids, cu_seqlens=cu_c, cu_list=cu_c.tolist(),
                         rows=True, stash=None)
    out, scaled = {}, []
    for on in (True, False):  # fused (or, with gated, the norm folded) or not
        layer.state, layer.conv_state = state0.clone(), conv0.clone()
        b.stash = []
        with ExitStack() as stack:
            for p in (mock.patch.object(engine, "TC_MIN_DIM", 0),
                      mock.patch.object(kda_engine, "ROWS_FUSED", on or gated),
                      mock.patch.object(engine, "ROWS_GATED_NORM", on and gated)):
                stack.enter_context(p)
            if device == "cpu":
                stack.enter_context(mock.patch.object(
                    ops, "_fast", lambda t, name: ops._fast_module(name)))
                if gated:
                    stack.enter_context(mock.patch.object(
                        engine.gemv_i8_rows, "gemv_i8_rows", partial(_naive_i8_rows, scaled)))
            if on:  # the fused path taken: no unfused mixer, no norm launch
                stack.enter_context(mock.patch.object(KDA, "_mix",
                                                      side_effect=AssertionError("_mix ran")))
            if on and gated:
                stack.enter_context(mock.patch.object(
                    ops, "rms_norm_gated", side_effect=AssertionError("norm ran")))
            y = layer(x, b)
            assert torch.equal(layer.state, state0), "the check wrote the state"
            for module, inputs in b.stash:
                module.commit(inputs, bc)
        out[on] = (y, layer.state.clone(), layer.conv_state.clone())
    assert scaled == ([1] if gated and device == "cpu" else []), "o_proj's scale not folded"
    (y1, s1, c1), (y0, s0, c0) = out[True], out[False]
    assert torch.equal(c1, c0) and _rel(s1, s0) < 1e-2, ("states", _rel(s1, s0))
    assert not torch.equal(s1, state0), "the commit advanced nothing"
    assert _rel(y1, y0) < 2e-2, _rel(y1, y0)


def _naive_i8_rows(scaled: list, x, qa, qb, sz, bits, group_size, swiglu=False, out=None,
                   gscale=None, **config):
    """gemv_i8_rows's result by the naive matmul (its PTX does not run in the interpreter);
    a 1 in `scaled` for each call with a head scale."""
    from volundr.kernels.quant.naive import naive_quant_matmul

    assert not swiglu and out is None and config
    if gscale is not None:
        scaled.append(1)
        x = GroupScaled(x, gscale[0], gscale[1]).value()
    return naive_quant_matmul(x, qa, qb, sz, bits, group_size, x.shape[1])


def run_cpu() -> None:
    # The interpreter casts fp32 to bf16 by truncation (a GPU rounds to nearest): with bf16
    # activations its outputs sit ~0.5% (up to ~1.6%) off the naive ones on these few
    # elements, so the math is checked tightly in fp32 and the bf16 path loosely.
    f32 = dict(bf=torch.float32, tol=1e-4)
    check_rows([3, 1, 2], 3, 2, 16, 4, "cpu", _seed(), pad=(1,), BV=4, **f32)  # 4 programs a head
    check_rows([2, 4], 4, 2, 16, 3, "cpu", _seed(), BV=8, **f32)   # conv width 3
    check_rows([1, 2], 2, 1, 32, 2, "cpu", _seed(), **f32)         # width 2, one head, one program
    check_rows([3, 1, 2], 3, 2, 16, 4, "cpu", _seed(), pad=(1,), BV=4, tol=4e-2)
    check_layer(_seed())
    check_layer(_seed(), gated=True)


def test_interpreter():
    run_interpreted(__file__)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("lens,L", [([2], 2), ([4, 1, 3], 4), ([8] * 4 + [5], 8)])
def test_cuda_rows_volundr_shapes(lens, L):
    check_rows(lens, L, 40, 128, 4, "cuda", _seed(), pad=(1,) if len(lens) > 2 else ())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("gated", [False, True])
def test_cuda_layer_rows(gated):
    check_layer(_seed(), "cuda", gated)


if __name__ == "__main__":
    run_cpu()
