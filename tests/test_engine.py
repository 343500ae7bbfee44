"""The engine on the CPU with the tiny Volundr (random weights from the converter's presets):
model math vs an independent reference, chunked prefill, continuous batching invariance,
seeded sampling, preemption, abort and stop conditions."""

from __future__ import annotations

import random

import pytest
import torch
from reference_model import reference_logits

from volundr.block_manager import BlockManager, StateSlots
from volundr.converter.presets import get_config, random_state_dict
from volundr.engine import EngineConfig, LLMEngine
from volundr.sampling_params import SamplingParams
from volundr.scheduler import ScheduledSeq
from volundr.sequence import Sequence

EOS = (2, 0)


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("tiny", vocab_size=512, eos_token_id=EOS)
    return cfg, random_state_dict(cfg, "cpu", dtype=torch.float32, seed=1)


def make_engine(tiny, **kw) -> LLMEngine:
    cfg, sd = tiny
    args = dict(device="cpu", dtype=torch.float32, max_num_seqs=8, max_num_batched_tokens=64,
                max_model_len=256, num_kv_blocks=160)
    args.update(kw)
    return LLMEngine(cfg, sd, EngineConfig(**args), EOS)


def run_all(engine: LLMEngine, requests, arrivals=None) -> dict[str, list[int]]:
    """Runs requests [(id, prompt, params)], adding request i before step arrivals[i]."""
    arrivals = arrivals or [0] * len(requests)
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    step = 0
    while True:
        for (rid, prompt, params), at in zip(requests, arrivals):
            if at == step:
                engine.add_request(prompt, params, rid)
        if not engine.has_unfinished() and step > max(arrivals):
            return out
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs CUDA"))])
def test_engine_logits_match_reference_for_any_chunking(tiny, device):
    """On CUDA this runs every Triton kernel of the engine (fp32; their dots may use tf32,
    hence the looser bound) against the independent reference."""
    cfg, sd = tiny
    engine = make_engine(tiny, device=device, cuda_graphs=False)
    runner = engine.runner
    tol = 2e-3 if device == "cpu" else 3e-2
    ids = prompts(1, 0)[0] + list(range(3, 40))
    ref = reference_logits(cfg, sd, ids)
    for chunk in (len(ids), 7, 1):
        seq = Sequence("r", ids, SamplingParams())
        seq.slot = engine.slots.allocate()
        got = []
        with torch.inference_mode():
            for s in range(0, len(ids), chunk):
                n = min(chunk, len(ids) - s)
                engine.block_manager.grow(seq, s + n)
                if s == 0:
                    for t in runner.states:
                        t[seq.slot] = 0
                b = runner.prepare([ScheduledSeq(seq, n)])
                got.append(runner.model.compute_logits(runner.model(b)).cpu())
                seq.num_computed_tokens += n
        torch.testing.assert_close(torch.cat(got), ref, atol=tol, rtol=tol)
        engine.block_manager.free(seq)
        engine.slots.free(seq.slot)


def test_greedy_alone_equals_staggered_continuous_batch(tiny):
    ps = prompts(8, 1)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = {f"r{i}": run_all(make_engine(tiny), [(f"r{i}", p, greedy)])[f"r{i}"]
             for i, p in enumerate(ps)}
    engine = make_engine(tiny, max_num_batched_tokens=24)   # forces chunked prefill + mixing
    batched = run_all(engine, [(f"r{i}", p, greedy) for i, p in enumerate(ps)],
                      arrivals=[0, 0, 1, 3, 3, 4, 7, 9])
    assert batched == alone
    assert all(len(v) == 12 for v in alone.values())
    assert len({tuple(v) for v in alone.values()}) > 1  # not a degenerate model


def test_chunked_prefill_equals_whole_prefill(tiny):
    p = prompts(1, 2)[0] * 3
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    whole = run_all(make_engine(tiny, max_num_batched_tokens=256), [("a", p, greedy)])
    chunked = run_all(make_engine(tiny, max_num_batched_tokens=5), [("a", p, greedy)])
    assert whole == chunked


def test_seeded_sampling_same_alone_and_batched(tiny):
    ps = prompts(5, 3)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, min_p=0.01,
                             seed=100 + i, ignore_eos=True) for i in range(5)]
    alone = {f"s{i}": run_all(make_engine(tiny), [(f"s{i}", p, params[i])])[f"s{i}"]
             for i, p in enumerate(ps)}
    batched = run_all(make_engine(tiny), [(f"s{i}", p, params[i]) for i, p in enumerate(ps)],
                      arrivals=[0, 1, 1, 2, 5])
    assert batched == alone
    reseeded = run_all(make_engine(tiny), [("x", ps[0], params[1])])["x"]
    assert reseeded != alone["s0"]  # the seed matters


def test_preemption_recomputes_to_the_same_ids(tiny):
    ps = prompts(4, 4)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reqs = [(f"p{i}", p, greedy) for i, p in enumerate(ps)]
    roomy = run_all(make_engine(tiny), reqs)
    engine = make_engine(tiny, num_kv_blocks=8, max_model_len=128)  # 128 tokens for all four
    tight = run_all(engine, reqs)
    assert tight == roomy
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats()["num_blocks_free"] == 8


def test_abort_frees_every_block_and_slot(tiny):
    engine = make_engine(tiny)
    full = engine.stats()
    for i, p in enumerate(prompts(6, 5)):
        engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True), f"a{i}")
    for _ in range(4):
        engine.step()
    assert engine.stats()["num_blocks_free"] < full["num_blocks_free"]
    for i in range(6):
        assert engine.abort(f"a{i}")
    assert not engine.abort("a0")
    assert engine.stats() == full
    assert not engine.has_unfinished()


def test_stop_conditions(tiny):
    engine = make_engine(tiny)
    p = prompts(1, 6)[0]
    free = run_all(engine, [("f", p, SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True))])["f"]
    assert len(free) == 8
    stop_at = free[3]
    engine.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=(stop_at,)), "s")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    got = [t for o in outs for t in o.new_token_ids]
    assert got == free[:free.index(stop_at)]          # the stop token itself is not emitted
    with pytest.raises(ValueError, match="context"):
        engine.add_request(list(range(3, 300)), SamplingParams(), "long")
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams(), "empty")


def test_length_limit_by_context(tiny):
    engine = make_engine(tiny, max_model_len=32)
    out = run_all(engine, [("c", list(range(3, 28)), SamplingParams(max_tokens=100,
                                                                    ignore_eos=True))])
    assert len(out["c"]) == 32 - 25


def test_mtp_block_predicts_from_hidden_states(tiny):
    cfg, sd = tiny
    engine = make_engine(tiny)
    runner = engine.runner
    ids = prompts(1, 7)[0] + [5, 6, 7]
    seq = Sequence("m", ids, SamplingParams())
    seq.slot = engine.slots.allocate()
    engine.block_manager.grow(seq, len(ids))
    with torch.inference_mode():
        b = runner.prepare([ScheduledSeq(seq, len(ids))])
        hidden = runner.model(b)
        # MTP at position i reads hidden_i and the id at i + 1 (the last one is a guess).
        nxt = torch.tensor(ids[1:] + [3])
        logits = runner.model.mtp_logits(hidden, nxt, b)
    assert logits.shape == (len(ids), cfg.vocab_size) and torch.isfinite(logits).all()


def test_block_manager_and_slots_bookkeeping():
    bm, slots = BlockManager(8, 4), StateSlots(2)
    seq = Sequence("x", [1, 2, 3], SamplingParams())
    bm.grow(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free == 5
    assert not bm.can_grow(seq, 33)
    bm.free(seq)
    assert bm.num_free == 8 and seq.block_table == []
    a = slots.allocate()
    slots.free(a)
    with pytest.raises(RuntimeError):
        slots.free(a)


def test_table_mirror_follows_growing_freed_and_moved_tables():
    """TableMirror.rows == the block tables zero-padded, every step of a random life: tables
    growing by a block now and then, freed and regrown in the same slot (a new list), another
    sequence taking a freed slot, a sequence moving slots (preempted), a table longer than the
    mirror's width (it widens)."""
    from volundr.block_manager import TableMirror

    gen = torch.Generator().manual_seed(0)
    bm, mirror = BlockManager(400, 4), TableMirror(4, 6)
    seqs = [Sequence(f"s{i}", [1], SamplingParams()) for i in range(4)]
    for i, s in enumerate(seqs):
        s.slot = i
    copied, full = [], 0  # entries changed per step; what rebuilding every row would write
    for _ in range(60):
        for s in seqs:
            r = int(torch.randint(0, 25, (1,), generator=gen))
            if r == 0:
                bm.free(s)  # (a new, empty list)
            elif r == 1:  # preempted into the other free slot... swap two sequences' slots
                t = seqs[int(torch.randint(0, 4, (1,), generator=gen))]
                s.slot, t.slot = t.slot, s.slot
            if r < 10:
                bm.grow(s, len(s.block_table) * 4 + int(torch.randint(1, 6, (1,), generator=gen)))
        batch = [s for s in seqs if s.block_table][::-1]
        if not batch:
            continue
        before = mirror.array.copy()
        got = mirror.rows(batch)
        width = max(len(s.block_table) for s in batch)
        want = [s.block_table + [0] * (width - len(s.block_table)) for s in batch]
        assert got.tolist() == want
        if before.shape == mirror.array.shape:
            copied.append(int((before != mirror.array).sum()))
            full += sum(len(s.block_table) for s in batch)
    assert mirror.array.shape[1] > 6  # widened
    assert sum(copied) < full / 3, (sum(copied), full)


def test_precomputed_input_embeddings_at_given_positions(tiny):
    """Image-style inputs: vectors replace the embedding rows of placeholder positions; the
    engine (chunked across them or not) matches the reference forward with the same vectors."""
    cfg, sd = tiny
    ids = prompts(1, 8)[0][:10] + [11] * 6 + [5, 6, 7]       # 6 placeholder tokens at 10..15
    vecs = {p: torch.randn(cfg.hidden_size) for p in range(10, 16)}
    expected = []  # the reference's greedy continuation, one full forward per token
    for _ in range(6):
        expected.append(int(reference_logits(cfg, sd, ids + expected, vecs)[-1].argmax()))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for budget in (64, 4):  # whole prompt in one step, or chunks that split the image span
        engine = make_engine(tiny, max_num_batched_tokens=budget)
        engine.add_request(ids, greedy, "img", input_embeds=vecs)
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.new_token_ids]
        assert out == expected
    plain = reference_logits(cfg, sd, ids)[-1]
    assert not torch.allclose(plain, reference_logits(cfg, sd, ids, vecs)[-1], atol=1e-3)
    with pytest.raises(ValueError, match="outside the prompt"):
        make_engine(tiny).add_request(ids, greedy, "x", input_embeds={99: vecs[10]})
    with pytest.raises(ValueError, match="shape"):
        make_engine(tiny).add_request(ids, greedy, "y", input_embeds={3: torch.zeros(5)})


def _multi_step_requests(reference: dict[str, list[int]] | None, ps):
    """Requests of odd lengths, greedy and seeded sampling; with the one-token-per-step outputs
    known, request 1 gets a stop token from the middle of its output (it must stop there,
    inside a multi-step)."""
    reqs = []
    for i, p in enumerate(ps):
        stop = []
        if reference is not None and i == 1:
            stop = [reference["r1"][5]]
        sampled = dict(temperature=0.9, top_p=0.95, seed=100 + i) if i in (2, 4) else \
            dict(temperature=0.0)
        params = SamplingParams(max_tokens=[5, 13, 9, 11][i % 4], ignore_eos=True,
                                stop_token_ids=stop, **sampled)
        reqs.append((f"r{i}", p, params))
    return reqs


def check_multi_step_decode(device: str, dtype=torch.float32, tiny=None, engine_kw=None):
    """decode_steps = 4 gives the ids of one token per step (greedy and seeded sampling), incl.
    a stop token inside a run, odd max_tokens, the context limit and staggered arrivals; every
    block and slot is freed."""
    ps = prompts(6, 11)
    kw = dict(device=device, dtype=dtype, **(engine_kw or {}))
    arrivals = [0, 0, 0, 2, 9, 9]
    first = run_all(make_engine(tiny, **kw), _multi_step_requests(None, ps), arrivals)
    ref = run_all(make_engine(tiny, **kw), _multi_step_requests(first, ps), arrivals)
    engine = make_engine(tiny, decode_steps=4, **kw)
    steps = 0
    orig = engine.runner.run_decode_steps

    def counted(batch, k, stop_ids=None):
        nonlocal steps
        steps += 1
        return orig(batch, k, stop_ids)

    engine.runner.run_decode_steps = counted
    got = run_all(engine, _multi_step_requests(first, ps), arrivals)
    assert got == ref
    assert steps > 0, "no multi-step decode ran"
    assert len(ref["r1"]) == first["r1"].index(first["r1"][5])  # stopped at its stop token
    stats = engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["num_slots_free"] == stats["num_slots_total"]
    # the context limit: a prompt 3 tokens short of max_model_len gets 3 tokens, then "length"
    engine = make_engine(tiny, decode_steps=4, max_model_len=64, num_kv_blocks=40, **kw)
    engine.add_request(list(range(3, 64 - 3 + 3)), SamplingParams(max_tokens=50,
                                                                   temperature=0.0), "edge")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert sum(len(o.new_token_ids) for o in outs) <= 3 and outs[-1].finish_reason in (
        "length", "stop")


def test_multi_step_greedy_decode_equals_single_steps(tiny):
    check_multi_step_decode("cpu", tiny=tiny)


def test_multi_step_while_requests_wait_for_a_slot(tiny):
    """With every slot taken, a waiting request does not stop multi-step decode (it could not
    join anyway); outputs equal one token per step."""
    ps = prompts(3, 5)
    reqs = [(f"w{i}", p, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(ps)]
    ref = run_all(make_engine(tiny, max_num_seqs=1), reqs)
    engine = make_engine(tiny, max_num_seqs=1, decode_steps=4)
    calls = []
    orig = engine.runner.run_decode_steps
    engine.runner.run_decode_steps = lambda b, k, s=None: calls.append(k) or orig(b, k, s)
    assert run_all(engine, reqs) == ref
    assert calls and max(calls) == 4


def test_priority_orders_admission_and_preemption(tiny):
    """One running sequence at a time: the waiting requests start lower priority first, then in
    arrival order; under KV pressure the least urgent (then newest) running sequence gives way,
    and the outputs equal the requests run alone."""
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine = make_engine(tiny, max_num_seqs=1)
    ps = prompts(4, 8)
    for rid, p, prio in (("a", ps[0], 0), ("b", ps[1], 5), ("c", ps[2], -1), ("d", ps[3], 0)):
        engine.add_request(p, greedy, rid, priority=prio)
    order: list[str] = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["c", "a", "d", "b"]

    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [("lo", ps[0], 3), ("hi", ps[1], 0), ("mid", ps[2], 1)]
    engine = make_engine(tiny, num_kv_blocks=10, max_model_len=128)  # 160 tokens for three
    preempted = []
    orig = engine.scheduler.preempt
    engine.scheduler.preempt = lambda s: preempted.append(s.request_id) or orig(s)
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
    for i, (rid, p, prio) in enumerate(reqs):
        engine.add_request(p, long, rid, priority=prio)
        if i == 0:  # "lo" runs first: the oldest, yet the first to give way
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert preempted and preempted[0] == "lo" and "hi" not in preempted
    for rid, p, _ in reqs:
        assert out[rid] == run_all(make_engine(tiny), [(rid, p, long)])[rid]


def test_no_gc_keeps_the_cycle_collector_off_inside_a_capture_only():
    """cuda_graph.no_gc (around every capture): collector off inside, back on after, even
    when the capture raises; left off if it was off."""
    import gc

    from volundr.cuda_graph import no_gc

    assert gc.isenabled()
    with no_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_gc():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
