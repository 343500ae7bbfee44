"""Mixed 2/3/4-bit weights: formats, fit, Triton kernels vs the naive reference, QuantLinear
loading, the quantizing converter end to end, and logits-level quality bounds.

CPU: the Triton kernels run under TRITON_INTERPRET=1 in a subprocess (this file run as a
script), so the variable never reaches other tests. CUDA: the same checks at Volundr-32B shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

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


def run_cpu(group: str) -> None:
    for bits in (2, 3, 4):
        if group == "gemv":
            check_matmul(1, 200, 256, bits, 64, "cpu", _seed(), bn=128, splits=3)
            check_matmul(1, 96, 384, bits, 128, "cpu", _seed(), bn=64, splits=1)
            check_matmul(1, 64, 256, bits, 128, "cpu", _seed(), bn=64)  # engine-like split
            check_matmul(1, 64, 256, bits, 64, "cpu", _seed(), bn=64, prefetch=False)
        elif group == "batch":
            check_matmul(5, 100, 256, bits, 64, "cpu", _seed(), block_m=16, bn=32, splits=2)
            check_matmul(40, 64, 256, bits, 128, "cpu", _seed(), block_m=16, bn=32, splits=1)
            check_dequant(7, 100, 256, bits, 64, "cpu", _seed(), chunk_n=48)
            check_engine(96, 256, bits, 128, "cpu", _seed())


@pytest.mark.parametrize("group", ["gemv", "batch"])
def test_interpreter(group):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, __file__, group], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


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
def test_cuda_lm_head_shape_and_random_linear():
    from volundr.kernels.quant import quantize_random_linear

    layer = quantize_random_linear(262144, 5120, 4, 128, "cuda")
    x = torch.randn(1, 5120, device="cuda", dtype=torch.bfloat16)
    w = layer.dequantize(torch.bfloat16)
    assert _rel(layer(x), x.float() @ w.float().t()) < 8e-3


if __name__ == "__main__":
    run_cpu(sys.argv[1])
