"""Which step compositions make the prefill path's Triton kernels compile again, on a machine
without a GPU (tests/test_kernels_compile.py's stand-in sm_90 driver: each launch compiles and
does not run).

    .venv/bin/python perf/diag_specializations.py --out /tmp/spec.json

Triton compiles a kernel once per specialisation: its constexprs and, for integer and pointer
arguments not listed in do_not_specialize, whether each is 1 / a multiple of 16 (pointers: 16-byte
aligned). An engine step's kernels see the step's composition (tokens, sequences, their lengths)
in such arguments, so a step unlike any before may pay compiles before it runs (bench_serving's
bursts, perf/RESULTS.md session 37). For each composition in turn (one sequence's prompt, then
batches of prompts with decodes among them, as serving waves make them) this calls the wrappers
of one layer's prefill kernels at Volundr-32B's shapes (norms, SwiGLU, host lookups, the KV store
and prefill attention, KDA's conv and chunked mixer, mixed-bit matmuls over the step's rows and
over its logits rows) and lists the new specialisations each composition made
(triton.knobs.runtime.jit_cache_hook) and the seconds its compiles took here.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
# (decodes, prompts, prompt length) per step, in the order a server might meet them
COMPOSITIONS = [(0, 1, 128), (0, 16, 128), (1, 15, 128), (2, 14, 128), (5, 11, 128),
                (0, 16, 136), (3, 13, 136), (1, 15, 128), (0, 1, 136), (4, 1, 200)]

def layer_step(lens: list[int], prefix: list[int] | None = None) -> None:
    """One layer's prefill-path kernels for a step of sequences of these new-token counts, each
    over `prefix` tokens already cached (a later chunk, a resumed session; default none)."""
    from volundr.kernels.attention import engine as attn
    from volundr.kernels.engram.lookup import embedding_lookup, engram_lookup
    from volundr.kernels.kda import engine as kda
    from volundr.kernels.norm.engine import rms_norm, rms_norm_gated, swiglu
    from volundr.kernels.quant import engine as quant
    from volundr.kernels.quant.fit import minmax_quant
    from volundr.kernels.quant.pack import pack_scale_zero, to_kernel_layout

    bf, d, H, K, kvh = torch.bfloat16, 5120, 40, 128, 2
    n, t = len(lens), sum(lens)
    cu_list = [0] + torch.tensor(lens).cumsum(0).tolist()
    cu = torch.tensor(cu_list, dtype=torch.int32)
    x = torch.randn(t, d, dtype=bf)
    rms_norm(x, x[0], 1e-6)
    rms_norm(x, x[0], 1e-6, x)
    rms_norm_gated(torch.randn(t, H, K, dtype=bf), torch.ones(K, dtype=bf),
                   torch.randn(t, H, K, dtype=bf), 1e-6)
    swiglu(torch.randn(t, 1024, dtype=bf), torch.randn(t, 1024, dtype=bf))
    ids = torch.randint(0, 100, (t, 3))
    embedding_lookup(ids, torch.randn(100, d, dtype=bf), torch.empty(t, d, dtype=bf))
    z8 = torch.zeros(8, dtype=torch.long)
    engram_lookup(ids, torch.randn(800, 256, dtype=bf), z8, z8 + 100,
                  torch.full((8,), 2, dtype=torch.int32), z8 + 1,
                  torch.empty(t, 8 * 256, dtype=bf))
    # attention: the new tokens' K/V stored, then attention over cache + themselves
    ctx_list = [a + b for a, b in zip(lens, prefix or [0] * n)]
    blocks = max(1, -(-max(ctx_list) // 16))
    kc = torch.zeros(n * blocks, 16, kvh, K, dtype=bf)
    qkv = torch.randn(t, H + 2 * kvh, K, dtype=bf)
    q, kn, vn = qkv[:, :H], qkv[:, H:H + kvh], qkv[:, H + kvh:]
    attn.store_kv(kn, vn, kc, kc.clone(), torch.arange(t))
    tables = torch.arange(n * blocks, dtype=torch.int32).view(n, blocks)
    ctx = torch.tensor(ctx_list, dtype=torch.int32)
    attn.paged_attention(q, kc, kc.clone(), tables, cu, ctx, K ** -0.5, max(lens),
                         max(ctx_list), kn, vn)
    # KDA: the short conv, then the mixer (chunked, or recurrent for short sequences)
    slots = torch.arange(n)
    y = kda.causal_conv(torch.randn(t, 3 * H * K, dtype=bf), torch.randn(3 * H * K, 4, dtype=bf),
                        torch.zeros(n + 1, 3 * H * K, 3, dtype=bf), slots, cu, "silu")
    qq, kk, vv = y.view(t, 3, H, K).unbind(1)
    kda.kda_mixer(qq, kk, vv, torch.randn(t, H, K, dtype=bf), torch.randn(t, H, dtype=bf),
                  torch.zeros(n + 1, H, K, K), slots, cu, cu_list, K ** -0.5,
                  A_log=torch.zeros(H, dtype=bf), dt_bias=torch.zeros(H * K, dtype=bf))
    # mixed-bit linears (2048 x 2048: at the tensor-core paths' size floor, so small steps take
    # the GPU's paths): over the step's rows (M > 128: dequantised, then cuBLAS), 3-bit, and
    # over one row a sequence, 4-bit (the lm_head's logits rows)
    for rows, bits in ((t, 3), (n, 4)):
        qw, s, zr = minmax_quant(torch.randn(2048, 2048) / 32, bits, 128)
        quant.quant_matmul(torch.randn(rows, 2048, dtype=bf), *to_kernel_layout(qw, bits, 128),
                           pack_scale_zero(s, zr), bits, 128)


def warm_up_steps() -> list[tuple]:
    """volundr.warmup's prefill steps as (decodes, prompts, longest, lens, cached): its requests
    on the tiny model, scheduled as the 48gb profile schedules them (16 sequences, 8192 tokens
    a step, decode_steps 8); the composition is the scheduler's, whatever the model."""
    from volundr.converter.presets import get_config, random_state_dict
    from volundr.engine import EngineConfig, LLMEngine
    from volundr.warmup import warm_up

    cfg = get_config("tiny", vocab_size=512)
    e = LLMEngine(cfg, random_state_dict(cfg, "cpu", dtype=torch.float32, seed=1),
                  EngineConfig(device="cpu", dtype=torch.float32, max_num_seqs=16,
                               max_num_batched_tokens=8192, max_model_len=16384,
                               num_kv_blocks=2048, decode_steps=8, cuda_graphs=False), (2,))
    return [(s.decode_seqs, s.prefill_seqs, max(s.prefill), [1] * s.decode_seqs + s.prefill,
             s.cached) for s in warm_up(e).steps if s.prefill]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--warm-up", action="store_true",
                    help="volundr.warmup's steps first, at the 48gb profile's settings (taken "
                    "from the tiny model's warm-up on the CPU): the compositions after it "
                    "should then compile nothing")
    ap.add_argument("--random", type=int, default=0, metavar="N",
                    help="N more compositions after the listed ones, drawn at random (seeded): "
                    "up to 16 sequences, a random share of them decodes, prompt lengths 1-700 "
                    "each (a serving mix of chat and completions prompts)")
    ap.add_argument("--prefixes", action="store_true",
                    help="the random compositions' sequences over cached prefixes: decodes "
                    "at contexts of 1-6000 tokens, half the prompts over 1-6000 cached tokens "
                    "(resumed sessions, later chunks)")
    args = ap.parse_args()
    sys.path.insert(0, str(TESTS))
    from diag_admission import COMPILED, install_hook
    from test_kernels_compile import _install_fake_driver

    steps = [(decodes, prompts, plen, [1] * decodes + [plen] * prompts, None)
             for decodes, prompts, plen in COMPOSITIONS]
    if args.warm_up:
        steps = warm_up_steps() + steps
    rng = random.Random(0)
    for _ in range(args.random):
        n = rng.randint(1, 16)
        decodes = rng.randint(0, n - 1)
        lens = [1] * decodes + [rng.randint(1, 700) for _ in range(n - decodes)]
        prefix = None
        if args.prefixes:
            prefix = [rng.randint(1, 6000) if i < decodes or rng.random() < 0.5 else 0
                      for i in range(n)]
        steps.append((decodes, n - decodes, max(lens[decodes:]), lens, prefix))
    _install_fake_driver()
    install_hook()
    res = []
    for decodes, prompts, plen, lens, prefix in steps:
        COMPILED.clear()
        t = time.perf_counter()
        layer_step(lens, prefix)
        row = {"decodes": decodes, "prompts": prompts, "prompt_len": plen, "lens": lens,
               "prefix": prefix, "tokens": sum(lens),
               "seconds": round(time.perf_counter() - t, 2), "new": sorted(COMPILED)}
        res.append(row)
        print(f"{decodes:2d} decodes + {prompts:2d} x {plen} ({sum(lens):5d} tokens): "
              f"{row['seconds']:6.2f} s, {len(COMPILED)} new: "
              f"{', '.join(c.split(' ', 1)[0] for c in row['new'])}"[:400],
              flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
