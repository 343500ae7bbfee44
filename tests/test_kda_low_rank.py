"""KDA's low-rank gate projections (f_b, g_b: rank -> H K each, 4-bit, one quant group per row)
folded into the decode kernel (kernels/kda/decode.py `low_rank`): the kernel's gate logits and
output gate == the mixed-bit GEMV's (naive matmul, bf16 output) fed to the unfolded kernel;
the KDA layer's decode step with the fold == without.

CPU: the kernels run under TRITON_INTERPRET=1 in a subprocess (this file run as a script), so
the variable never reaches other tests. CUDA: Volundr-32B shapes (40 heads of 128, rank 128).
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

from volundr.kernels.quant.naive import naive_quant_matmul

CUDA = torch.cuda.is_available()


def check_low_rank(N: int, H: int, K: int, R: int, device: str, seed: int, pad=(),
                   tol: float = 1e-2) -> None:
    """kda_decode(low_rank=(xs, qa, sz), gated=(None, w)) == kda_decode(g = f_b(xs[:, :R]),
    gated=(g_b(xs[:, R:2R]), w)) with f_b / g_b the naive 4-bit matmuls rounded to bf16 (as the
    GEMV returns them): u, ss, the state and the conv tails; xs a column slice (row stride >
    2R), a padding row in `pad`."""
    from volundr.kernels.kda.decode import kda_decode
    from volundr.kernels.quant import quantize_random_linear
    from volundr.model.quant_linear import QuantLinear

    torch.manual_seed(seed)
    bf, V, W = torch.bfloat16, K, 4
    C, slots = 3 * H * K, N + 3
    fb = quantize_random_linear(H * K, R, 4, R, device, seed=seed)
    gb = quantize_random_linear(H * V, R, 4, R, device, seed=seed + 1)
    fg = QuantLinear.concat([fb, gb])  # the layout GroupedLinear holds: f rows, then g rows
    qkv = torch.randn(N, C + 8, device=device).to(bf)[:, 4:4 + C]
    xs = (torch.randn(N, 2 * R + H + 5, device=device) * 2).to(bf)[:, 3:3 + 2 * R]
    beta = torch.randn(N, H, device=device).to(bf)
    cw = torch.randn(C, W, device=device).to(bf)
    A_log = torch.rand(H, device=device) * 2 - 0.5
    dt_bias = torch.randn(H * K, device=device) * 0.5
    nw = (torch.rand(V, device=device) + 0.5).to(bf)
    ids = torch.randperm(slots, device=device)[:N]
    ids[list(pad)] = -1
    cs = torch.randn(slots, C, W - 1, device=device).to(bf)
    pool = torch.randn(slots, H, K, V, device=device) * 0.3
    ref_st, st = (cs.clone(), pool.clone()), (cs.clone(), pool.clone())
    f = naive_quant_matmul(xs[:, :R].float(), fb.qa, fb.qb, fb.sz, 4, R, R).to(bf)
    z = naive_quant_matmul(xs[:, R:].float(), gb.qa, gb.qb, gb.sz, 4, R, R).to(bf)
    u0, ss0 = kda_decode(qkv, cw, ref_st[0], f.view(N, H, K), beta, ref_st[1], ids, K ** -0.5,
                         A_log, dt_bias, gated=(z.view(N, H, V), nw))
    u1, ss1 = kda_decode(qkv, cw, st[0], None, beta, st[1], ids, K ** -0.5, A_log, dt_bias,
                         gated=(None, nw), low_rank=(xs, fg.qa, fg.sz))
    live = ids >= 0
    assert torch.equal(st[0], ref_st[0]), "conv tails"
    errs = [_rel(st[1], ref_st[1]), _rel(u1[live], u0[live]), _rel(ss1[live], ss0[live])]
    assert max(errs) < tol, ("state, u, ss", errs)
    assert not u1[~live].any() and not ss1[~live].any(), "padding rows"


def check_layer(seed: int, device: str = "cpu") -> None:
    """A KDA layer's decode step (the mixed-bit fg_b 4-bit, rank 32, 2 heads of 32; the gated
    output norm folded, as by default) with the low-rank fold == without; the fold never runs
    the grouped GEMV."""
    import dataclasses
    from contextlib import nullcontext
    from types import SimpleNamespace
    from unittest import mock

    from volundr import ops
    from volundr.config import KDAConfig
    from volundr.converter.presets import get_config
    from volundr.kernels.kda import engine as kda_engine
    from volundr.kernels.quant import engine, quantize_random_linear
    from volundr.model.layers import GroupedLinear

    cfg = dataclasses.replace(get_config("tiny"), hidden_size=128,
                              kda=KDAConfig(num_heads=2, head_dim=32, conv_size=4,
                                            low_rank_dim=32))
    layer = random_kda(cfg, seed)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj",
                              "f_b_proj", "g_b_proj", "o_proj")):
        m = getattr(layer, name)
        g = 32 if name in ("o_proj", "f_b_proj", "g_b_proj") else 64
        setattr(layer, name, quantize_random_linear(m.out_features, m.in_features, 4, g,
                                                    "cpu", seed=seed + i))
    layer = layer.to(device=device, dtype=torch.bfloat16)
    layer.after_load()
    assert layer.fg_b.fused is not None
    state0 = torch.randn(3, 2, 32, 32, device=device) * 0.3
    conv0 = torch.randn(3, 3 * 64, 3, device=device).to(torch.bfloat16)
    b = SimpleNamespace(max_q_len=1, slot_ids=torch.tensor([1], device=device), cu_list=[0, 1],
                        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=device))
    x = torch.randn(1, cfg.hidden_size, device=device).to(torch.bfloat16)
    on_cpu = mock.patch.object(ops, "_fast", lambda t, name: ops._fast_module(name))
    out = {}
    for fold in (True, False):
        layer.state, layer.conv_state = state0.clone(), conv0.clone()
        grouped = mock.patch.object(GroupedLinear, "forward",
                                    side_effect=AssertionError("f_b / g_b ran"))
        with (on_cpu if device == "cpu" else nullcontext(),
              mock.patch.object(engine, "TC_MIN_DIM", 0),
              mock.patch.object(kda_engine, "LOW_RANK_FOLD", fold),
              grouped if fold else nullcontext()):
            y = layer(x, b)
        out[fold] = (y, layer.state.clone(), layer.conv_state.clone())
    (y1, s1, c1), (y0, s0, c0) = out[True], out[False]
    assert torch.equal(c1, c0) and _rel(s1, s0) < 1e-2, "states"
    assert y1.shape == (1, cfg.hidden_size) and _rel(y1, y0) < 2e-2, _rel(y1, y0)


def run_cpu() -> None:
    check_low_rank(3, 2, 32, 32, "cpu", _seed(), pad=(1,))
    check_low_rank(2, 2, 16, 64, "cpu", _seed())  # rank 64: 8 word rows per output
    check_layer(_seed())


def test_interpreter():
    run_interpreted(__file__)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("N", [1, 16])
def test_cuda_low_rank_volundr_shapes(N):
    check_low_rank(N, 40, 128, 128, "cuda", _seed(), pad=(0,) if N > 1 else ())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_layer_low_rank_fold():
    check_layer(_seed(), "cuda")


if __name__ == "__main__":
    run_cpu()
