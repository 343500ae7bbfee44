"""A speculative check's conv + KDA and its commit in one launch each (kernels/kda/rows.py) against
the naive references: the check's output == naive conv -> naive recurrence on each sequence's
rows, with the states untouched; the commit's state and conv tail == the naive ones after each
sequence's rows; gap rows and a padding sequence's rows are zeros. And the KDA layer's check +
commit with the fused launches == without (ops.kda_rows vs `_mix`).

CPU: the kernels run under TRITON_INTERPRET=1 in a subprocess (this file run as a script), so
the variable never reaches other tests. CUDA: Volundr-32B shapes (40 heads of 128).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_quant import (  # (tests/ is on the path under pytest and as a script)
    _rel,
    _seed,
    random_kda,
)

from volundr.kernels.kda.naive import kda_gate, naive_causal_conv1d, naive_recurrent_kda

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
               pad: tuple = (), BV: int | None = None, tol: float = 1e-2) -> None:
    """kda_rows's check and commit on sequences of lens[i] rows out of L each (check_layout's
    rows, a padding sequence at the indices in `pad`) == `_naive_rows` per sequence; the check
    leaves both states bit for bit as they were; the commit touches no other slot and leaves
    the arrival counters at zero."""
    from volundr.kernels.kda.decode import _counters
    from volundr.kernels.kda.rows import kda_rows

    torch.manual_seed(seed)
    bf, V, n = torch.bfloat16, K, len(lens)
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
    assert not o[dead].any(), "gap / padding rows"
    others = [s for s in range(slots) if s not in ids]
    assert torch.equal(pool[others], pool0[others]) and torch.equal(cs[others], cs0[others])


def check_layer(seed: int, device: str = "cpu") -> None:
    """A KDA layer's check of 2 sequences x 3 rows (tiny shapes, mixed-bit projections) and its
    commit of 1 and 3 rows with ops.kda_rows == with the unfused conv and recurrence."""
    import dataclasses
    from contextlib import nullcontext
    from types import SimpleNamespace
    from unittest import mock

    from volundr import ops
    from volundr.config import KDAConfig
    from volundr.converter.presets import get_config
    from volundr.kernels.kda import engine as kda_engine
    from volundr.kernels.quant import engine, quantize_random_linear
    from volundr.model.kda import KDA

    cfg = dataclasses.replace(get_config("tiny"), hidden_size=128,
                              kda=KDAConfig(num_heads=2, head_dim=32, conv_size=4,
                                            low_rank_dim=32))
    layer = random_kda(cfg, seed)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
        m = getattr(layer, name)
        setattr(layer, name, quantize_random_linear(m.out_features, m.in_features, 4, 32,
                                                    "cpu", seed=seed + i))
    layer = layer.to(device=device, dtype=torch.bfloat16)
    layer.after_load()
    L, state0 = 3, torch.randn(4, 2, 32, 32, device=device) * 0.3
    conv0 = torch.randn(4, 3 * 64, 3, device=device).to(torch.bfloat16)
    x = torch.randn(2 * L, cfg.hidden_size, device=device).to(torch.bfloat16)
    cu, ids = _layout([L, L], L, [2, 0], device)
    cu_c, _ = _layout([1, 3], L, [2, 0], device)
    b = SimpleNamespace(max_q_len=L, slot_ids=ids, cu_seqlens=cu, cu_list=cu.tolist(),
                        rows=True, stash=[])
    bc = SimpleNamespace(max_q_len=L, slot_ids=ids, cu_seqlens=cu_c, cu_list=cu_c.tolist(),
                         rows=True, stash=None)
    on_cpu = mock.patch.object(ops, "_fast", lambda t, name: ops._fast_module(name))
    out = {}
    for fused in (True, False):
        layer.state, layer.conv_state = state0.clone(), conv0.clone()
        b.stash = []
        unfused = mock.patch.object(KDA, "_mix", side_effect=AssertionError("_mix ran"))
        with (on_cpu if device == "cpu" else nullcontext(),
              mock.patch.object(engine, "TC_MIN_DIM", 0),
              mock.patch.object(kda_engine, "ROWS_FUSED", fused),
              unfused if fused else nullcontext()):
            y = layer(x, b)
            assert torch.equal(layer.state, state0), "the check wrote the state"
            for module, inputs in b.stash:
                module.commit(inputs, bc)
        out[fused] = (y, layer.state.clone(), layer.conv_state.clone())
    (y1, s1, c1), (y0, s0, c0) = out[True], out[False]
    assert torch.equal(c1, c0) and _rel(s1, s0) < 1e-2, ("states", _rel(s1, s0))
    assert not torch.equal(s1, state0), "the commit advanced nothing"
    assert _rel(y1, y0) < 2e-2, _rel(y1, y0)


def run_cpu() -> None:
    check_rows([3, 1, 2], 3, 2, 16, 4, "cpu", _seed(), pad=(1,), BV=4)  # 4 programs a head
    check_rows([2, 4], 4, 2, 16, 3, "cpu", _seed(), BV=8)   # conv width 3
    check_rows([1, 2], 2, 1, 32, 2, "cpu", _seed())         # width 2, one head, one program
    check_layer(_seed())


def test_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("lens,L", [([2], 2), ([4, 1, 3], 4), ([8] * 4 + [5], 8)])
def test_cuda_rows_volundr_shapes(lens, L):
    check_rows(lens, L, 40, 128, 4, "cuda", _seed(), pad=(1,) if len(lens) > 2 else ())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_layer_rows():
    check_layer(_seed(), "cuda")


if __name__ == "__main__":
    run_cpu()
