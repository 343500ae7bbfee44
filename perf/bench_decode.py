"""End-to-end decode of Volundr-32B with random weights on one GPU (H200).

Measures, in one run: the HBM copy bandwidth; single-stream greedy decode tok/s (eager and with
CUDA graphs); 16-concurrent decode throughput; and the byte limit = measured bandwidth / bytes
of GPU weights read per token. With graphs also the GPU time of one decode step (graph replays
alone), so that ms_per_step - graph_ms is the host's share; and a kernel-time breakdown of one
eager decode step (torch.profiler) when --profile-dir is given.

Variants: bf16; mixed (~3.2 bits); NAME:G runs NAME under a G GiB GPU budget (the allocator cap),
e.g. mixed:16 for the 16 GiB profile; a suffix @K decodes up to K greedy tokens per engine step
(EngineConfig.decode_steps), e.g. mixed:16@4; +suffixes pick the mixed-bit matmul paths
(volundr.kernels.quant.engine.GEMV_PATH / GEMM16_PATH): +fma = FMA GEMV and tl.dot tiles (the
default before 2026-12-03), +tc = tensor-core GEMV only, +tc16 = both on the tensor cores (the
default before 2026-12-05); +i8 = tc16 with the integer tensor-core GEMV (gemv_i8.py) for the plain,
SwiGLU, rscaled and residual batch-1 GEMVs (the default now, also without a suffix), +dig / +nodig =
with it x's digits written by the residual epilogues or made by a launch before each GEMV
(engine.DIGITS_EPILOGUE), +i8late / +i8top = gemv_i8's PDL trigger after its main loop or at its top
(the default; gemv_i8.LATE_TRIGGER), +i8rowsN = the matmuls of 2..N rows on gemv_i8_rows
(engine.I8_ROWS: 16 by default, +i8rows0 = gemm_tc; --batches 2,4,8 for those rows), +rowsfold /
+norowsfold = with it the residual add + next RMSNorm per row in its epilogue and the next one's
scale (engine.ROWS_FOLD, opt-in), +rowsgated / +norowsgated = a speculative check's KDA gated
output norm in kda_rows and o_proj's gemv_i8_rows (engine.ROWS_GATED_NORM, opt-in), +gi8 / +nogi8 =
at M = 1 o_proj with that norm's head scale on gemv_i8 instead of gemv_tc (engine.GATED_NORM_I8,
opt-in), +i8chunkN = 17..N rows as 16-row gemv_i8_rows calls
(engine.I8_ROWS_CHUNKED: 48 by default, +i8chunk0 off; --max-num-seqs 32 --batches 32); +nopf4 =
gemv_i8_rows at 4 bits up to 4 rows without its prefetch (gemv_i8_rows.FEW4 = FEW); +fold = the
residual add + RMSNorm into the batch-1 GEMV (engine.NORM_FOLD), +gfold / +nogfold = KDA's gated
output norm folded into its o_proj GEMV or not (engine.GATED_NORM_FOLD), +rfold / +norfold = the
residual add + next RMSNorm in the output projections' GEMV epilogue and the norm's scale in the
next GEMV, or not (engine.RESIDUAL_NORM_FOLD), +chain / +nochain = an MLP's gate_up and down GEMVs
as one persistent launch (kernels/quant/gemv_chain.py, engine.GEMV_CHAIN) or not, +lrfold /
+nolrfold = KDA's f_b / g_b computed in its decode kernel or not (kernels/kda/engine.LOW_RANK_FOLD),
+top = gemv_tc's PDL trigger at its top (pdl.LATE_TRIGGER off; after its main loop is the default
since run 15), +noearly = its first weights of each set loaded after the PDL wait, not before
(pdl.EARLY_WEIGHTS off; one block at 4 bits is the default since run 16), +early = one block at 3
and 4 bits, +e4:2/3:2 = blocks per bit width (VOLUNDR_PDL_EARLY's syntax, "/" for ","), +rN = the
batch-1 GEMV at reps N (32 N rows per program; waves scaled to keep its splits; after it +wN sets
waves N), +uncap = no register cap on the GEMV, +tcminN = the tensor-core paths from N input /
output features up (TC_MIN_DIM), +sN = the tensor-core GEMV/GEMM's weights pipelined through shared
memory in N stages (`stages` of GEMV_TC_CONFIG and GEMM16_TC_CONFIG); e.g. mixed:16@8+fold+top+s2.
PDL itself is per process (VOLUNDR_PDL). +tpN runs the variant tensor parallel over N devices
(volundr.distributed: one process per GPU, NCCL, every rank replaying its decode graphs; a budget G
applies to each GPU; no graph_ms: rank 0's graph alone would wait for the other ranks' collectives),
e.g. --variants mixed:16@8,mixed:16@8+tp2; +symm with it: the decode all-reduces through symmetric
memory's one-shot kernel instead of NCCL (VOLUNDR_TP_ALLREDUCE=symm; not yet run on GPUs). +fp8kv:
the attention KV cache in fp8 e4m3 (EngineConfig.kv_cache_dtype "fp8"), e.g. mixed:16+fp8kv. +draft:
speculative decoding (volundr.speculative) with a random drafter of the preset's drafter sizes
(volundr-draft; random: few guesses right, the machinery's cost), +draftself with the model itself
as drafter (every guess right: the upper bound), +mtp with the model's MTP head (one guess a step);
+kN guesses per step (default 4); the rows then carry the engine's spec_steps, spec_seqs and
spec_tokens (tokens per sequence and step: spec_tokens / spec_seqs). A variant that fails is
recorded with its error; the JSON is rewritten after every variant.
--session-lens L1,L2: an agent's next turn after L tokens, resumed from its parked session
(volundr.session) against from scratch (session_turn), e.g. --max-model-len 65536 --session-lens
8192,54000 for the product page's 54K-token turn. --long-lens L: single-stream decode after an
L-token prompt and the memory peak, e.g. mixed:16@8+fp8kv --max-num-seqs 1 --max-model-len 262144
--long-lens 239000: the product page's 239K-token conversation in 16 GiB.

    python perf/bench_decode.py --out $OUT/decode.json [--variants bf16,mixed:16] [--tokens 256]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import re
import subprocess
import time
import traceback

import torch

from volundr.converter.presets import (
    get_config,
    init_tensor,
    mixed_quantization,
    random_state_dict,
)
from volundr.engine import EngineConfig, LLMEngine
from volundr.kernels.quant.pack import group_size_for, quantizable
from volundr.model.weights import HOST_PARTS, expected_tensors
from volundr.sampling_params import SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: str, gib: float = 4.0) -> float:
    """Device-to-device copy, bytes read + written per second (the HBM ceiling)."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync()
    t, reps = time.perf_counter(), 20
    for _ in range(reps):
        b.copy_(a)
    sync()
    return 2 * a.numel() * 2 * reps / (time.perf_counter() - t)


def device_weight_bytes(engine: LLMEngine) -> int:
    """Bytes of weights a decode step reads from device memory (host tables and MTP excluded;
    tensor parallel: rank 0's shard, what each GPU reads)."""
    m = engine.runner.model

    def size(mod) -> int:
        return sum(t.numel() * t.element_size()
                   for t in list(mod.parameters()) + list(mod.buffers()))

    return size(m) - (size(m.mtp) if m.mtp is not None else 0)


def time_to_first_token(engine: LLMEngine, prompt_len: int) -> dict:
    """One request of `prompt_len` random tokens alone: seconds until its first token (chunked
    prefill, engine steps of max_num_batched_tokens) and the prefill rate."""
    g = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(16, engine.cfg.vocab_size, (prompt_len,), generator=g).tolist()
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0), f"ttft{prompt_len}")
    sync()
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync()
    dt = time.perf_counter() - t
    return {"prompt_len": prompt_len, "ttft_s": dt, "prefill_tok_per_s": prompt_len / dt,
            "steps": steps}


def _first_token_s(engine: LLMEngine, ids: list[int], rid: str,
                   session: str | None = None) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens resumed from a parked session)."""
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0), rid,
                       session_id=session)
    sync()
    t, cached = time.perf_counter(), 0
    while engine.has_unfinished():
        for o in engine.step():
            cached = max(cached, o.num_cached_tokens)
    sync()
    return time.perf_counter() - t, cached


def session_turn(engine: LLMEngine, prompt_len: int, new_tokens: int = 64) -> dict:
    """An agent's next turn: turn 1 (prompt_len random tokens, 16 generated) ends and parks
    under a session id; turn 2 = turn 1 + its output + new_tokens. Seconds to turn 2's first
    token from scratch (no session id) and resumed from the parked state; park_s: the copy of
    turn 1's state and KV to host memory at its end (synchronised, timed alone)."""
    g = torch.Generator().manual_seed(prompt_len + 7)
    ids = torch.randint(16, engine.cfg.vocab_size, (prompt_len,), generator=g).tolist()
    sid = f"bench-{prompt_len}"
    engine.add_request(ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                       f"{sid}-1", session_id=sid)
    park, park_s = engine.runner.park, []

    def timed_park(*args):
        sync()
        t = time.perf_counter()
        nbytes = park(*args)
        sync()
        park_s.append(time.perf_counter() - t)
        return nbytes

    engine.runner.park = timed_park
    out: list[int] = []
    try:
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.new_token_ids]
    finally:
        engine.runner.park = park
    sync()
    parked = engine.sessions.stats()["sessions_host_bytes"]
    turn2 = ids + out + torch.randint(16, engine.cfg.vocab_size, (new_tokens,),
                                      generator=g).tolist()
    scratch_s, _ = _first_token_s(engine, turn2, f"{sid}-scratch")
    resumed_s, cached = _first_token_s(engine, turn2, f"{sid}-2", sid)
    return {"prompt_len": prompt_len, "turn2_len": len(turn2), "cached_tokens": cached,
            "parked_host_bytes": parked, "park_s": sum(park_s), "scratch_ttft_s": scratch_s,
            "resumed_ttft_s": resumed_s, "speedup": scratch_s / resumed_s}


def decode_rate(engine: LLMEngine, batch: int, prompt_len: int, tokens: int,
                temperature: float = 0.0) -> dict:
    """tok/s over the decode steps only (prefill excluded), `batch` requests at once (greedy,
    or sampled unseeded at `temperature`)."""
    p = SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(16, engine.cfg.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(ids, p, f"b{batch}-{i}")
    steps, t0, n = 0, None, 0
    head: list[int] = []  # the first request's first ids: runs of one build compare equal
    while engine.has_unfinished():
        outs = engine.step()
        head += [t for o in outs if o.request_id == f"b{batch}-0" for t in o.new_token_ids]
        if t0 is None and outs and all(o.num_output_tokens >= 1 for o in outs):
            sync()
            t0 = time.perf_counter()  # all prefills done: time decode only
            continue
        if t0 is not None:
            n += sum(len(o.new_token_ids) for o in outs)
            steps += 1
    sync()
    dt = time.perf_counter() - t0
    return {"batch": batch, "prompt_len": prompt_len, "decode_tokens": n, "steps": steps,
            "seconds": dt, "tok_per_s": n / dt, "ms_per_step": 1e3 * dt / max(steps, 1),
            "ms_per_token": 1e3 * dt * batch / max(n, 1),  # per token of one sequence
            "ids_head": head[:32]}


def graph_ms(engine: LLMEngine, bs: int, reps: int = 50) -> float | None:
    """GPU time of one captured decode step of batch `bs` (replays back to back)."""
    graphs = engine.runner.graphs
    if graphs is None or bs not in graphs.graphs or engine.ecfg.tensor_parallel_size > 1:
        return None
    return replay_ms(graphs.graphs[bs], reps)


def replay_ms(g: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    """ms per replay of a captured graph (replays back to back, after one untimed)."""
    g.replay()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        g.replay()
    sync()
    return 1e3 * (time.perf_counter() - t) / reps


# kernel name -> category of the breakdown (first match wins)
CATEGORIES = [("quant_matmul", r"gemv|gemm_q|gemm_tc|_q(uant)?_|dequant"),
              ("gemm_bf16", r"gemm|gemv|cutlass|cublas|sm90_xmma|nvjet"),
              ("kda", r"kda|recurrent|chunk|conv"), ("attention", r"attn|attention|store_kv"),
              ("norm_swiglu", r"rms|norm|swiglu"), ("lookup", r"lookup"),
              ("sampling", r"argmax|max|sort|softmax"), ("copies", r"memcpy|memset|copy|fill")]


def profile_step(engine: LLMEngine, path: str, batch: int = 1) -> dict:
    """Kernel times of eager decode steps (graphs off) by category, top kernels to `path`."""
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.runner.graphs = engine.runner.graphs, None
    k = engine.ecfg.decode_steps  # tokens per engine step: the sequences must outlive the profile
    steps = 3
    p = SamplingParams(max_tokens=(steps + 2) * k + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(list(range(16, 80)), p, f"prof{i}")
    engine.step()  # prefill
    engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    assert engine.has_unfinished(), "the sequences ended inside the profile"
    while engine.has_unfinished():
        engine.step()
    engine.runner.graphs = graphs
    cats: dict[str, float] = collections.defaultdict(float)
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if us <= 0:
            continue
        name = ev.key
        cat = next((c for c, rx in CATEGORIES if re.search(rx, name, re.I)), "other")
        cats[cat] += us / (steps * k)
        rows.append((us / (steps * k), ev.count / (steps * k), cat, name))
    rows.sort(reverse=True)
    with open(path, "a") as f:
        f.write(f"# eager decode, batch {batch} ({k} tokens per engine step): us per token, "
                "launches per token, kernel\n")
        for us, n, cat, name in rows[:60]:
            f.write(f"{us:10.1f} {n:7.2f} {cat:13s} {name[:140]}\n")
    return {"batch": batch, "kernel_us_per_token": dict(sorted(cats.items())),
            "kernel_ms_total": sum(cats.values()) / 1e3,
            "launches_per_token": round(sum(r[1] for r in rows), 1)}


def profile_host(engine: LLMEngine, path: str, steps: int = 30) -> dict:
    """Where the host's time goes in graph decode steps at batch 1: CPU-side ops and CUDA
    runtime calls by self time (top 40 to `path`), per step."""
    from torch.profiler import ProfilerActivity, profile

    k = engine.ecfg.decode_steps  # tokens per engine step
    p = SamplingParams(max_tokens=(steps + 6) * k + 8, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(16, 80)), p, "host")
    for _ in range(4):
        engine.step()
    sync()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    wall = (time.perf_counter() - t) / (steps * k)
    assert engine.has_unfinished(), "the sequence ended inside the profile"
    while engine.has_unfinished():
        engine.step()
    rows = sorted(((ev.self_cpu_time_total / (steps * k), ev.count / (steps * k), ev.key)
                   for ev in prof.key_averages()), reverse=True)
    with open(path, "a") as f:
        f.write(f"# graph decode, batch 1, {k} tokens per engine step (profiled wall "
                f"{wall * 1e3:.2f} ms/token): self CPU us per token, calls per token, op\n")
        for us, n, name in rows[:40]:
            f.write(f"{us:10.1f} {n:7.2f} {name[:120]}\n")
    return {"wall_ms_per_token": wall * 1e3,
            "top_self_cpu_us": {name[:60]: round(us, 1) for us, _, name in rows[:8]}}


@torch.no_grad()
def matmul_census(engine: LLMEngine, path: str, batch: int = 1, min_calls: int = 64) -> dict:
    """Where the matmul time of a decode step goes, by shape: the model's linears (MTP
    excluded) grouped by (name pattern, out N, in K, bits); per group one CUDA graph calls every
    member in turn (distinct weights, as a decode step reads them; a group's weights may still
    sit in L2 when they are small) on x [batch, K], replayed. Table to `path`, sorted by time
    per step; the sum is the matmul time of one step at this batch, launches back to back."""
    from volundr.model.quant_linear import QuantLinear

    m = engine.runner.model
    skip = {id(x) for x in m.mtp.modules()} if m.mtp is not None else set()
    groups: dict[tuple, list] = collections.defaultdict(list)
    for name, mod in m.named_modules():
        if id(mod) in skip or not isinstance(mod, (QuantLinear, torch.nn.Linear)):
            continue
        bits = getattr(mod, "bits", 16)
        groups[(re.sub(r"\.\d+\.", ".*.", name), mod.out_features, mod.in_features,
                bits)].append(mod)
    dev = next(m.parameters()).device
    rows = []
    for (name, n, k, bits), mods in groups.items():
        x = torch.randn(batch, k, dtype=torch.bfloat16, device=dev)
        reps = max(1, -(-min_calls // len(mods)))
        for mod in mods:  # compile outside the capture
            mod(x)
        sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                for mod in mods:
                    mod(x)
        g.replay()
        sync()
        t = time.perf_counter()
        for _ in range(5):
            g.replay()
        sync()
        us = 1e6 * (time.perf_counter() - t) / (5 * reps * len(mods))
        wb = sum(t.numel() * t.element_size()  # weight bytes of one member
                 for t in list(mods[0].buffers()) + list(mods[0].parameters()))
        rows.append({"name": name, "n": n, "k": k, "bits": bits, "count": len(mods),
                     "us_each": us, "ms_per_step": us * len(mods) / 1e3,
                     "GBps": wb / (us * 1e-6) / 1e9})
        del g
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    with open(path, "a") as f:
        f.write(f"# matmul census, batch {batch}: {total:.2f} ms per step in "
                f"{sum(r['count'] for r in rows)} matmuls\n")
        f.write("ms/step  count  us_each   GB/s  bits  out N x in K  module\n")
        for r in rows:
            f.write(f"{r['ms_per_step']:7.3f} {r['count']:6d} {r['us_each']:8.2f} "
                    f"{r['GBps']:6.0f} {r['bits']:5d}  {r['n']:>6d}x{r['k']:<6d} {r['name']}\n")
    return {"batch": batch, "ms_per_step": total, "rows": rows}


def mixed_config(cfg):
    """`cfg` with its ~3.2-bit volundr-mixed quantization_config (presets.mixed_quantization);
    linears too narrow for a quant group stay bf16 (tiny)."""
    q = mixed_quantization(cfg)
    shapes = {n.removesuffix(".weight"): t.shape for n, t in expected_tensors(cfg).items()}
    q = dataclasses.replace(q, bits={m: b for m, b in q.bits.items()
                                     if quantizable(shapes[m][1], q.group_size)})
    return cfg.replace(quantization=q)


@torch.no_grad()
def random_quantized_state_dict(cfg, device: str, keep_on: str | None = None):
    """A random volundr-mixed checkpoint: uniform random codes (qweight bytes), scales that give
    N(0, 1/in)-sized weights, mid-range zeros; loaded through the real repacking path. Drawn on
    `device`; keep_on="cpu" moves each tensor to the host at once (as a checkpoint read from
    disk would be), so that under a GPU budget only the repacked weights occupy the GPU."""
    bits = cfg.quantization.bits
    out: dict[str, torch.Tensor] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for name, spec in expected_tensors(cfg).items():
        module = name.removesuffix(".weight")
        if module not in bits:  # host tables: drawn on the GPU (fast), kept on the host
            t = init_tensor(name, spec, cfg, 0, device, torch.bfloat16)
            out[name] = t.cpu() if spec.part in HOST_PARTS else t
            continue
        b, (n, k) = bits[module], spec.shape
        g = group_size_for(k, cfg.quantization.group_size)
        q = torch.randint(0, 256, (n, k * b // 8), generator=gen, device=device,
                          dtype=torch.uint8)
        out[module + ".qweight"] = q if keep_on is None else q.to(keep_on)
        del q
        scale = 2 * 3 ** 0.5 * k ** -0.5 / (2 ** b - 1)  # uniform codes -> std ~ 1/sqrt(k)
        out[module + ".scales"] = torch.full((n, k // g), scale, dtype=torch.bfloat16,
                                             device=keep_on or device)
        out[module + ".zeros"] = torch.full((n, k // g), (2 ** b - 1) / 2,
                                            dtype=torch.bfloat16, device=keep_on or device)
    return out


def build(variant: str, graphs: bool, max_num_seqs: int, preset: str,
          device: str, gpu_gib: float | None = None, decode_steps: int = 1,
          max_model_len: int = 4096, tp: int = 1, kv_cache_dtype: str = "auto",
          plan_kv: bool = False, batched_tokens: int = 2048, draft: str | None = None,
          spec_k: int | None = None) -> LLMEngine:
    """`preset` (Volundr-32B) with random weights built straight on the device (host tables on
    the CPU); variant "mixed" is its ~3.2-bit mixed quantization. gpu_gib: the engine's budget
    (a hard cap on the allocator from the engine's construction on). tp > 1: the weights are
    kept on the host, where rank 0 shards them for the ranks. plan_kv: the KV pool the memory
    plan leaves under the budget (as `LLM` sizes it), not room for 4K tokens per sequence."""
    cfg = get_config(preset)
    if variant == "bf16":
        sd = random_state_dict(cfg, device, dtype=torch.bfloat16)
        if tp > 1:
            sd = {n: t.cpu() for n, t in sd.items()}
    else:
        cfg = mixed_config(cfg)
        sd = random_quantized_state_dict(cfg, device, "cpu" if gpu_gib or tp > 1 else None)
    pair = None
    if draft == "self":
        pair = (cfg, sd)
    elif draft == "mtp":  # the checkpoint's MTP head (random weights: few guesses right)
        pair = "mtp"
    elif draft:
        dcfg = get_config({"volundr-32b": "volundr-draft", "tiny": "draft-tiny"}.get(preset,
                                                                                    preset))
        dsd = random_state_dict(dcfg, device, dtype=torch.bfloat16, seed=1)
        pair = (dcfg, {n: t.cpu() for n, t in dsd.items()} if gpu_gib else dsd)
    # KV pool: 4K tokens per sequence, at least one whole max_model_len sequence
    blocks = max(max_num_seqs * 4096, max_model_len) // 16
    if plan_kv:
        from volundr.engine import kv_cache_torch_dtype
        from volundr.llm import _default_kv_blocks

        blocks = _default_kv_blocks(cfg, torch.device(device), gpu_gib, max_num_seqs,
                                    batched_tokens, max_model_len, 16, tp,
                                    kv_cache_torch_dtype(kv_cache_dtype, torch.bfloat16),
                                    pair[0] if isinstance(pair, tuple) else None)
        max_model_len = min(max_model_len, blocks * 16)  # as LLM caps it (with a warning)
    ecfg = EngineConfig(device=device, dtype=torch.bfloat16, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=batched_tokens, max_model_len=max_model_len,
                        block_size=16,
                        num_kv_blocks=blocks, cuda_graphs=graphs, gpu_gib=gpu_gib,
                        decode_steps=decode_steps, tensor_parallel_size=tp,
                        kv_cache_dtype=kv_cache_dtype, num_speculative_tokens=spec_k,
                        spec_min_tokens=0.0)  # (random drafts: time the speculative steps
    return LLMEngine(cfg, sd, ecfg, eos_token_ids=(), draft=pair)  # as such, never stop them)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="bf16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--preset", default="volundr-32b", help="e.g. tiny, for a CPU smoke run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument("--profile-dir", help="write a kernel breakdown of an eager step here")
    ap.add_argument("--no-eager", action="store_true", help="with graphs, skip the eager rows")
    ap.add_argument("--prefill-lens", default="",
                    help="comma-separated prompt lengths (< --max-model-len): time to first "
                    "token of each, alone")
    ap.add_argument("--session-lens", default="",
                    help="comma-separated turn-1 lengths: turn 2's time to first token resumed "
                    "from the parked session against from scratch (< --max-model-len - 96)")
    ap.add_argument("--batches", default="",
                    help="more decode rows at these batch sizes (e.g. 2,4: rows batch2, batch4, "
                    "with their graph replay times), each at most --max-num-seqs")
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="below 16: no batch-16 rows, and the KV pool is the memory plan's "
                    "under the budget (as the server sizes it), e.g. 1 for the 16gb profile's "
                    "one conversation")
    ap.add_argument("--plan-kv", action="store_true",
                    help="the KV pool the memory plan leaves under the budget (the server's "
                    "sizing; implied below 16 sequences)")
    ap.add_argument("--batched-tokens", type=int, default=2048,
                    help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--long-lens", default="",
                    help="comma-separated prompt lengths: single-stream decode tok/s after a "
                    "prompt of that length, and the GPU memory peak of its prefill and decode")
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="context of the engine (the decode graphs' attention splits are sized "
                    "for it: compare decode numbers at equal values)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    res = {"commit": commit, "device": name, "preset": args.preset, "torch": torch.__version__,
           "hbm_copy_GBps": copy_bandwidth(args.device, args.copy_gib) / 1e9, "runs": []}
    print(json.dumps(res), flush=True)
    for spec in args.variants.split(","):
        try:
            res["runs"] += run_variant(spec, args, res["hbm_copy_GBps"], dev)
        except Exception as e:  # record it and go on: the other variants still count
            res["runs"].append({"variant": spec, "error": repr(e)[:2000],
                                "traceback": traceback.format_exc()[-3000:]})
            print(json.dumps(res["runs"][-1]), flush=True)
        gc.collect()  # the engine's reference cycles hold GPU memory until collected
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, dev.index or 0)
        with open(args.out, "w") as f:  # after every variant: a later crash keeps these
            json.dump(res, f, indent=1)


def _with(cfgs: dict, **kw) -> dict:
    """A {bits: kernel kwargs} table with kw set at every bit width."""
    return {b: {**c, **kw} for b, c in cfgs.items()}


def run_variant(spec: str, args, hbm_copy_GBps: float, dev: torch.device) -> list[dict]:
    """One variant (see the module doc): build, optional profiles, then decode rates."""
    import volundr.kernels.kda.engine as kengine
    import volundr.kernels.quant.engine as qengine
    from volundr.kernels import pdl
    from volundr.kernels.quant import gemv_i8, gemv_i8_rows

    cuda = dev.type == "cuda"
    spec_main, *suffixes = spec.split("+")
    spec_bits, _, steps = spec_main.partition("@")
    variant, _, gib = spec_bits.partition(":")
    tp, all_reduce = 1, os.environ.get("VOLUNDR_TP_ALLREDUCE")  # +symm sets it for one variant
    kv_cache_dtype = "auto"
    draft, spec_k = None, None  # (None: the engine's default guesses a step)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    paths = {"tc": ("tc", "tile"), "tc16": ("tc", "tc"), "fma": ("fma", "tile"),
             "i8": ("i8", "tc")}
    defaults = (qengine.GEMV_PATH, qengine.GEMM16_PATH, qengine.NORM_FOLD, pdl.LATE_TRIGGER,
                pdl.EARLY_WEIGHTS, qengine.GEMV_TC_CONFIG, qengine.GEMM16_TC_CONFIG,
                qengine.TC_MIN_DIM, qengine.GATED_NORM_FOLD, qengine.RESIDUAL_NORM_FOLD,
                kengine.LOW_RANK_FOLD, qengine.GEMV_TC_SHAPE, qengine.GEMV_CHAIN,
                qengine.DIGITS_EPILOGUE, gemv_i8.LATE_TRIGGER, qengine.I8_ROWS,
                qengine.ROWS_FOLD, qengine.I8_ROWS_CHUNKED, gemv_i8_rows.FEW4)
    for sfx in suffixes:  # read at call time: the graphs capture these choices
        if sfx in paths:
            qengine.GEMV_PATH, qengine.GEMM16_PATH = paths[sfx]
        elif sfx in ("fold", "nofold"):
            qengine.NORM_FOLD = sfx == "fold"
        elif sfx in ("gfold", "nogfold"):  # KDA's gated norm in o_proj's GEMV / not
            qengine.GATED_NORM_FOLD = sfx == "gfold"
        elif sfx in ("rfold", "norfold"):  # norms in the output GEMVs' epilogues / not
            qengine.RESIDUAL_NORM_FOLD = sfx == "rfold"
        elif sfx in ("chain", "nochain"):  # an MLP's two GEMVs in one launch / not
            qengine.GEMV_CHAIN = sfx == "chain"
        elif sfx in ("dig", "nodig"):  # i8: x's digits from the epilogues / launches
            qengine.DIGITS_EPILOGUE = sfx == "dig"
        elif sfx[:7] == "i8chunk" and sfx[7:].isdigit():  # 17-N rows as 16-row calls
            qengine.I8_ROWS_CHUNKED = int(sfx[7:])
        elif sfx == "nopf4":  # gemv_i8_rows at 4 bits up to 4 rows without the prefetch
            gemv_i8_rows.FEW4 = dict(gemv_i8_rows.FEW)
        elif sfx in ("rowsfold", "norowsfold"):  # the residual norm per row on gemv_i8_rows
            qengine.ROWS_FOLD = sfx == "rowsfold"
        elif sfx in ("rowsgated", "norowsgated"):  # a check's gated norm in kda_rows + o_proj
            qengine.ROWS_GATED_NORM = sfx == "rowsgated"
        elif sfx in ("gi8", "nogi8"):  # M = 1: the gated norm's head scale in gemv_i8's digits
            qengine.GATED_NORM_I8 = sfx == "gi8"
        elif sfx[:6] == "i8rows" and sfx[6:].isdigit():  # gemv_i8_rows up to N rows
            qengine.I8_ROWS = int(sfx[6:])
        elif sfx in ("i8late", "i8top"):  # gemv_i8's PDL trigger after its loop / at its top
            gemv_i8.LATE_TRIGGER = sfx == "i8late"
        elif sfx in ("lrfold", "nolrfold"):  # KDA's f_b / g_b in its decode kernel / not
            kengine.LOW_RANK_FOLD = sfx == "lrfold"
        elif sfx in ("late", "top"):
            pdl.LATE_TRIGGER = sfx == "late"
        elif sfx in ("early", "noearly"):  # 1 block at 3 and 4 bits / none
            pdl.EARLY_WEIGHTS = {3: 1, 4: 1} if sfx == "early" else {}
        elif sfx[:1] == "e" and sfx[1:2].isdigit():  # e.g. e4:2/3:2 (VOLUNDR_PDL_EARLY's syntax)
            pdl.EARLY_WEIGHTS = pdl.parse_early(sfx[1:])
        elif sfx[:1] == "r" and sfx[1:].isdigit():  # GEMV rows per warp / 32, same splits
            reps = int(sfx[1:])
            qengine.GEMV_TC_CONFIG = {b: {**c, "reps": reps, "waves": c["waves"] * c["reps"] / reps}
                                      for b, c in qengine.GEMV_TC_CONFIG.items()}
        elif sfx[:1] == "w" and "@" in sfx:  # e.g. w8@15680x5120: waves 8 for that N x K
            waves, _, shape = sfx[1:].partition("@")
            n, k = (int(v) for v in shape.split("x"))
            qengine.GEMV_TC_SHAPE = {**qengine.GEMV_TC_SHAPE, (n, k): {"waves": float(waves)}}
        elif sfx[:1] == "w" and sfx[1:].isdigit():  # the batch-1 GEMV at waves N
            qengine.GEMV_TC_CONFIG = _with(qengine.GEMV_TC_CONFIG, waves=float(sfx[1:]))
        elif sfx[:5] == "tcmin" and sfx[5:].isdigit():  # smaller linears on the tc paths
            qengine.TC_MIN_DIM = int(sfx[5:])
        elif sfx == "uncap":  # no register cap on the batch-1 GEMV
            qengine.GEMV_TC_CONFIG = {b: {k: v for k, v in c.items() if k != "maxnreg"}
                                      for b, c in qengine.GEMV_TC_CONFIG.items()}
        elif sfx[:2] == "tp" and sfx[2:].isdigit():  # tensor parallel over N devices
            tp = int(sfx[2:])
        elif sfx == "symm":  # TP: decode all-reduces through symmetric memory (one-shot)
            os.environ["VOLUNDR_TP_ALLREDUCE"] = "symm"
        elif sfx == "fp8kv":  # the attention KV cache in fp8 e4m3
            kv_cache_dtype = "fp8"
        elif sfx in ("draft", "draftself", "mtp"):  # speculative decoding
            draft = {"draftself": "self", "mtp": "mtp"}.get(sfx, "random")
        elif sfx[:1] == "k" and sfx[1:].isdigit():
            spec_k = int(sfx[1:])
        elif sfx[:1] == "s" and sfx[1:].isdigit():
            qengine.GEMV_TC_CONFIG = _with(qengine.GEMV_TC_CONFIG, stages=int(sfx[1:]))
            qengine.GEMM16_TC_CONFIG = _with(qengine.GEMM16_TC_CONFIG, stages=int(sfx[1:]))
        else:
            raise ValueError(f"unknown suffix +{sfx} ({', '.join(paths)}, fold, late, top, "
                             "gfold, nogfold, rfold, norfold, chain, nochain, lrfold, nolrfold, "
                             "dig, nodig, i8late, i8top, i8rowsN, i8chunkN, nopf4, rowsfold, "
                             "norowsfold, rowsgated, norowsgated, gi8, nogi8, early, noearly, "
                             "e<bits:blocks/...>, rN, wN, wN@NxK, uncap, tcminN, sN, tpN, symm, "
                             "fp8kv, draft, draftself, mtp, kN)")
    try:
        return _measure(spec, variant, gib, steps, args, hbm_copy_GBps, cuda, tp, kv_cache_dtype,
                        draft, spec_k)
    finally:
        if all_reduce is None:
            os.environ.pop("VOLUNDR_TP_ALLREDUCE", None)
        else:
            os.environ["VOLUNDR_TP_ALLREDUCE"] = all_reduce
        (qengine.GEMV_PATH, qengine.GEMM16_PATH, qengine.NORM_FOLD, pdl.LATE_TRIGGER,
         pdl.EARLY_WEIGHTS, qengine.GEMV_TC_CONFIG, qengine.GEMM16_TC_CONFIG,
         qengine.TC_MIN_DIM, qengine.GATED_NORM_FOLD, qengine.RESIDUAL_NORM_FOLD,
         kengine.LOW_RANK_FOLD, qengine.GEMV_TC_SHAPE, qengine.GEMV_CHAIN,
         qengine.DIGITS_EPILOGUE, gemv_i8.LATE_TRIGGER, qengine.I8_ROWS,
         qengine.ROWS_FOLD, qengine.I8_ROWS_CHUNKED, gemv_i8_rows.FEW4) = defaults


def _measure(spec, variant, gib, steps, args, hbm_copy_GBps, cuda, tp=1,
             kv_cache_dtype="auto", draft=None, spec_k=None) -> list[dict]:
    out = []
    t = time.perf_counter()
    engine = build(variant, True, args.max_num_seqs, args.preset, args.device,
                   float(gib) if gib else None, int(steps or 1), args.max_model_len, tp,
                   kv_cache_dtype, plan_kv=args.plan_kv or args.max_num_seqs < 16,
                   batched_tokens=args.batched_tokens, draft=draft, spec_k=spec_k)
    wbytes = device_weight_bytes(engine)
    graphs = engine.runner.graphs
    built = {"build_s": time.perf_counter() - t,
             "gpu_mem_after_build_GB": torch.cuda.memory_allocated() / 1e9 if cuda else None,
             # (the graph runner resets the allocator's peak to measure each capture's need)
             "gpu_mem_peak_build_GB": max(torch.cuda.max_memory_allocated(),
                                          getattr(graphs, "build_peak", 0)) / 1e9
             if cuda else None}
    prof_path = f"{args.profile_dir}/profiles.txt"  # all variants: few files come back
    if args.profile_dir and cuda and tp == 1:  # the profiles see rank 0 only
        os.makedirs(args.profile_dir, exist_ok=True)
        with open(prof_path, "a") as f:
            f.write(f"\n######## {spec}\n")
        try:
            built["profile_bs1"] = profile_step(engine, prof_path, 1)
            built["profile_bs16"] = profile_step(engine, prof_path, 16)
            if graphs is not None:
                built["host_bs1"] = profile_host(engine, prof_path)
            built["census_bs1"] = matmul_census(engine, prof_path, 1)
            built["census_bs16"] = matmul_census(engine, prof_path, 16)
        except Exception as e:  # the breakdown is extra: never lose the run to it
            built["profile_error"] = repr(e)
    modes = (False, True) if graphs is not None else (False,)
    for use_graphs in modes[1:] if args.no_eager and graphs is not None else modes:
        engine.runner.graphs = graphs if use_graphs else None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        entry = {"variant": spec, "cuda_graphs": use_graphs, "gpu_gib": gib or None, "tp": tp,
                 "kv_cache_dtype": kv_cache_dtype,
                 **built, "gpu_weight_GB": wbytes / 1e9,
                 "byte_limit_tok_per_s": hbm_copy_GBps * 1e9 / wbytes}
        # warm-up (Triton compile/autotune; a drafter's prefill at the prompt's length too)
        decode_rate(engine, 1, args.prompt_len, 8)
        entry["single"] = decode_rate(engine, 1, args.prompt_len, args.tokens)
        if args.max_num_seqs >= 16:
            entry["batch16"] = decode_rate(engine, 16, args.prompt_len, args.tokens // 2)
        for bs in (int(b) for b in args.batches.split(",") if b):  # e.g. 2: two streams
            if bs <= args.max_num_seqs:
                entry[f"batch{bs}"] = decode_rate(engine, bs, args.prompt_len, args.tokens // 2)
                if use_graphs:
                    entry[f"batch{bs}"]["graph_ms"] = graph_ms(engine, bs)
        if use_graphs:
            entry["single"]["graph_ms"] = graph_ms(engine, 1)
            if args.max_num_seqs >= 16:
                entry["batch16"]["graph_ms"] = graph_ms(engine, 16)
        if use_graphs or graphs is None:  # prefill never runs in a graph: once per variant
            lens = [int(n) for n in args.prefill_lens.split(",") if n]
            if lens:  # untimed: the first prefill of a length compiles its kernels (run 40)
                time_to_first_token(engine, lens[0])
            entry["prefill"] = [time_to_first_token(engine, n) for n in lens]
            slens = [int(n) for n in args.session_lens.split(",") if n]
            if slens:  # untimed warm-up: both paths' kernels compile at a short length
                session_turn(engine, min(256, slens[0]))
            entry["session"] = [session_turn(engine, n) for n in slens]
            llens = [int(n) for n in args.long_lens.split(",") if n]
            entry["long"] = []
            for n in llens:  # decode after a long prompt; peak memory of its prefill + decode
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                entry["long"].append(decode_rate(engine, 1, n, args.tokens))
                entry["long"][-1]["wall_s"] = time.perf_counter() - t
                if cuda:
                    entry["long"][-1]["gpu_mem_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
                    entry["long"][-1]["gpu_mem_reserved_peak_GB"] = (
                        torch.cuda.max_memory_reserved() / 1e9)
        if cuda:
            entry["gpu_mem_peak_decode_GB"] = torch.cuda.max_memory_allocated() / 1e9
        if draft:
            st = engine.stats()
            entry.update({k: st[k] for k in ("spec_steps", "spec_seqs", "spec_tokens")})
        out.append(entry)
        print(json.dumps(entry), flush=True)
    engine.close()
    return out


if __name__ == "__main__":
    main()
