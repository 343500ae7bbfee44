"""Tensor parallelism on the CPU (gloo, one process per rank) with the tiny Volundr: checkpoint
shards reassemble to the full tensors and fit the rank's model, `--tp 2` / `--tp 4` give the
same greedy ids as one device (through the engine and through the generate CLI), and a dead or
failing worker makes the step raise a clear error instead of hanging."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from volundr.config import ConfigError
from volundr.converter.presets import get_config, random_state_dict
from volundr.distributed import WorkerError, share_host_tables
from volundr.engine import EngineConfig, LLMEngine
from volundr.model import VolundrForCausalLM
from volundr.model.engram import back_to_back
from volundr.model.parallel import TP, shard_rule, shard_state_dict
from volundr.model.weights import host_tensor_names
from volundr.sampling_params import SamplingParams

EOS = (2, 0)


@pytest.fixture(scope="module")
def tiny():
    # 4 attention heads over 2 KV heads, 4 KDA heads, MLP 128, vocab 512: splits over 2 and 4
    cfg = get_config("tiny", vocab_size=512, eos_token_id=EOS)
    return cfg, random_state_dict(cfg, "cpu", dtype=torch.float32, seed=1)


def make_engine(tiny, tp: int, **kw) -> LLMEngine:
    cfg, sd = tiny
    args = dict(device="cpu", dtype=torch.float32, max_num_seqs=8, max_num_batched_tokens=24,
                max_model_len=256, num_kv_blocks=160, tensor_parallel_size=tp)
    args.update(kw)
    return LLMEngine(cfg, sd, EngineConfig(**args), EOS)


def run_all(engine: LLMEngine, requests, arrivals) -> dict[str, list[int]]:
    """Runs requests [(id, prompt, params)], adding request i before step arrivals[i]."""
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for (rid, prompt, params), at in zip(requests, arrivals):
            if at == step:
                engine.add_request(prompt, params, rid)
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_shards_reassemble_and_fit_the_rank_model(tiny, tp):
    cfg, sd = tiny
    shards = [shard_state_dict(cfg, sd, r, tp) for r in range(tp)]
    kvh, rows = cfg.num_key_value_heads, cfg.head_dim
    split = {"col": 0, "row": 0}
    for name, full in sd.items():
        parts = [s[name] for s in shards]
        rule = shard_rule(name)
        if rule is None:
            assert all(p is full for p in parts), name  # replicated, incl. host tables
        elif rule == "kv" and tp > kvh:  # each rank holds the KV head its q heads read
            for r, p in enumerate(parts):
                h = r * kvh // tp
                assert torch.equal(p, full[h * rows:(h + 1) * rows]), name
            assert {r * kvh // tp for r in range(tp)} == set(range(kvh))
        else:
            dim = 1 if rule == "row" else 0
            assert torch.equal(torch.cat(parts, dim), full), name
            split["row" if dim else "col"] += 1
    assert split["row"] > 0 and split["col"] > 0
    assert shard_rule("model.layers.1.engram.k_proj.weight") is None  # not attention's k_proj
    for r in range(tp):
        with torch.device("meta"):
            model = VolundrForCausalLM(cfg, TP(r, tp))
        own = {n: tuple(p.shape) for n, p in model.named_parameters()}
        got = {n: tuple(t.shape) for n, t in shards[r].items() if n in own}
        assert got == own  # every parameter present, at the rank's shape


def test_host_tables_shared_once_engram_layers_back_to_back(tiny):
    # The layout lets every CUDA rank lock a layer's tables in place as one lookup buffer.
    cfg, sd = tiny
    host = share_host_tables(cfg, sd)
    assert set(host) == set(host_tensor_names(cfg)) and cfg.engram.layers
    assert all(t.is_shared() and torch.equal(t, sd[n]) for n, t in host.items())
    for i in cfg.engram.layers:
        names = [f"model.layers.{i}.engram.tables.{j}" for j in range(cfg.engram.num_tables)]
        whole = back_to_back([host[n] for n in names])
        assert whole is not None and torch.equal(whole, torch.cat([sd[n] for n in names]))
        assert back_to_back([sd[n] for n in names]) is None  # separate tensors: copied


def test_sizes_that_do_not_split_are_named(tiny):
    cfg, sd = tiny
    with pytest.raises(ConfigError, match="num_attention_heads=4.*num_key_value_heads=2"):
        shard_state_dict(cfg, sd, 0, 3)
    with pytest.raises(ConfigError, match="split over 3"):  # before any process starts
        make_engine(tiny, 3)


@pytest.mark.parametrize("tp,steps", [(2, 1), (4, 1), (2, 4)])
def test_tp_greedy_ids_equal_one_device(tiny, tp, steps):
    """steps > 1: multi-token decode steps, where rank 0 broadcasts each sampled token."""
    rng = random.Random(tp)
    ps = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 50))] for _ in range(4)]
    greedy = SamplingParams(max_tokens=6 if tp == 4 else 12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    reqs = [(f"r{i}", p, seeded if i == 3 else greedy) for i, p in enumerate(ps)]
    arrivals = [0, 0, 1, 3]  # staggered: continuous batching, chunked prefill (24 tokens/step)
    one = run_all(make_engine(tiny, 1), reqs, arrivals)
    engine = make_engine(tiny, tp, decode_steps=steps)
    calls = []
    multi = engine.runner.run_decode_steps
    engine.runner.run_decode_steps = lambda b, k, s=None: calls.append(k) or multi(b, k, s)
    try:
        assert engine.runner.model.model.layers[0].kda.H == 4 // tp  # really split
        many = run_all(engine, reqs, arrivals)
        assert (max(calls, default=1) > 1) == (steps > 1)  # multi-token steps ran
        assert engine.stats()["num_blocks_free"] == 160
    finally:
        engine.close()
    assert many == one
    assert all(len(v) > 0 for v in one.values()) and len({tuple(v) for v in one.values()}) > 1
    assert not any(p.is_alive() for p in engine.runner.procs)  # closed


def _kill_and_step(engine: LLMEngine, how: str) -> str:
    for i in range(2):  # k0 in a session: its prompt's state is held on every rank
        engine.add_request([5 + i, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True),
                           f"k{i}", session_id="s" if i == 0 else None)
    for _ in range(3):
        engine.step()
    if how == "kill":
        os.kill(engine.runner.procs[0].pid, signal.SIGKILL)
    else:  # a plan naming a state slot that does not exist: the worker raises in its forward
        engine.runner.conns[0].send(("run", [(99, (0, [0]), 0, 1, 0, [5], 1, {}, None)], 1, None))
    with pytest.raises(WorkerError) as err:
        engine.step()
    assert not engine.has_unfinished()  # its requests failed and freed their blocks
    assert engine.stats()["num_blocks_free"] == 160 and not engine.runner.runner.snaps
    with pytest.raises(WorkerError):
        engine.add_request([3, 4], SamplingParams(), "late")
    return str(err.value)


@pytest.mark.timeout(90)
def test_killed_worker_fails_the_step_clearly(tiny):
    engine = make_engine(tiny, 2)
    try:
        msg = _kill_and_step(engine, "kill")
    finally:
        engine.close()
    assert "worker rank 1" in msg and "exited with code -9" in msg


@pytest.mark.timeout(90)
def test_worker_exception_reaches_rank0(tiny):
    engine = make_engine(tiny, 2)
    try:
        msg = _kill_and_step(engine, "raise")
    finally:
        engine.close()
    assert "worker rank 1 raised" in msg and "IndexError" in msg


def _llm_ids(model_dir, prompts, tp: int) -> list[list[int]]:
    from volundr.llm import LLM

    with LLM(model_dir, device="cpu", max_num_seqs=len(prompts),
             tensor_parallel_size=tp) as llm:
        return [r["token_ids"] for r in llm.generate(prompts, SamplingParams(
            max_tokens=12, temperature=0.0))]


def test_generate_cli_tp2_equals_tp1(tiny_dir):
    cmd = [sys.executable, "-m", "volundr.generate", "--model", str(tiny_dir), "--json",
           "--max-tokens", "12", "--prompt", "hi", "--prompt", "a longer prompt"]
    out = subprocess.run(cmd + ["--tp", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    tp2 = [json.loads(line)["token_ids"] for line in out.stdout.splitlines()]
    assert tp2 == _llm_ids(tiny_dir, ["hi", "a longer prompt"], 1)
    assert all(tp2)


def test_quantized_checkpoint_tp2_equals_tp1(tiny_dir, tmp_path):
    # Mixed 2/3/4-bit linears shard like their bf16 weights (groups of 32: the tiny o_proj has
    # 64 inputs, 2 groups, one per rank).
    quantize = pytest.importorskip("volundr.converter.quantize")
    quantize.quantize_checkpoint(tiny_dir, tmp_path, group_size=32, device="cpu", iters=1,
                                 eval_logits=False, progress=False)
    prompts = ["hi", "a longer prompt"]
    one = _llm_ids(tmp_path, prompts, 1)
    assert _llm_ids(tmp_path, prompts, 2) == one and all(one)


def test_tp2_carries_input_embeddings_to_the_workers(tiny):
    cfg, _ = tiny
    ids = list(range(20, 40))
    vecs = {p: torch.randn(cfg.hidden_size) for p in range(5, 12)}
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        engine = make_engine(tiny, tp, max_num_batched_tokens=8)  # chunks split the span
        try:
            engine.add_request(ids, greedy, "img", input_embeds=vecs)
            got = []
            while engine.has_unfinished():
                got += [t for o in engine.step() for t in o.new_token_ids]
            outs.append(got)
        finally:
            engine.close()
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_unknown_all_reduce_path_is_named(tiny, monkeypatch):
    monkeypatch.setenv("VOLUNDR_TP_ALLREDUCE", "mpi")
    with pytest.raises(ValueError, match="VOLUNDR_TP_ALLREDUCE must be one of"):
        make_engine(tiny, 2)  # before any worker starts


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("steps,all_reduce", [(1, "nccl"), (4, "nccl"), (4, "symm")])
def test_cuda_tp2_nccl_equals_tp1(tiny, steps, all_reduce, monkeypatch):
    """--tp 2 over two GPUs (NCCL, the Triton kernels on each rank's shard, the decode steps
    replayed from every rank's CUDA graphs, the host tables read in place from shared memory)
    == one GPU; steps = 4: multi-token decode steps, rank 0 broadcasting each sampled token;
    symm: the decode all-reduces through symmetric memory's one-shot kernel."""
    monkeypatch.setenv("VOLUNDR_TP_ALLREDUCE", all_reduce)
    rng = random.Random(7)
    ps = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 50))] for _ in range(4)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [(f"r{i}", p, greedy) for i, p in enumerate(ps)]
    arrivals = [0, 0, 1, 3]
    one = run_all(make_engine(tiny, 1, device="cuda"), reqs, arrivals)
    engine = make_engine(tiny, 2, device="cuda", decode_steps=steps)
    try:
        rank0 = engine.runner.runner
        assert rank0.model.model.layers[0].kda.H == 2  # really split
        assert rank0.graphs is not None, "graph capture failed"
        tables = rank0.model.embed_tokens  # shared memory, locked in place by each rank
        assert rank0.model.lookups_on_gpu and tables.is_shared() and tables.is_pinned()
        replays = []
        replay = rank0.graphs.run
        rank0.graphs.run = lambda b: replays.append(b.num_seqs) or replay(b)
        many = run_all(engine, reqs, arrivals)
        assert replays  # decode ran from the graphs
    finally:
        engine.close()
    assert many == one and all(len(v) == 12 for v in one.values())
