"""Speculative decoding (volundr.speculative) on the tiny Volundr (random weights): with any
drafter, greedy requests produce exactly the tokens of plain greedy decoding — a drafter that
rarely guesses right (draft-tiny), one that always does (the model itself, fewer engine steps)
and one in between (the model's weights with noise) — across stop tokens, max_tokens, the
context limit, seeded sampled requests in the batch, preemption, slot reuse, prefills sharing
the step, sessions that park after speculative steps, and the engine's stats; seeded sampled
requests give plain seeded sampling's tokens exactly; unseeded sampled requests keep the
model's token distribution."""

from __future__ import annotations

import pytest
import torch

from volundr.converter.presets import get_config, random_state_dict
from volundr.engine import EngineConfig, LLMEngine
from volundr.model_runner import MAX_CHECK_LEN
from volundr.sampling_params import SamplingParams

EOS = (2, 0)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def models():
    cfg = get_config("tiny", vocab_size=512, eos_token_id=EOS)
    sd = random_state_dict(cfg, "cpu", dtype=torch.float32, seed=3)
    dcfg = get_config("draft-tiny", vocab_size=512, eos_token_id=EOS)
    g = torch.Generator().manual_seed(0)
    noisy = {n: t + 0.3 * t.std() * torch.randn(t.shape, generator=g) if t.dim() > 1 else t
             for n, t in sd.items()}
    return {"cfg": cfg, "sd": sd, "draft": (dcfg, random_state_dict(dcfg, "cpu",
                                                                    dtype=torch.float32, seed=5)),
            "self": (cfg, sd), "noisy": (cfg, noisy)}


def engine(models, drafter=None, device="cpu", **kw) -> LLMEngine:
    args = dict(device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16,
                max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=80,
                num_speculative_tokens=4, spec_min_tokens=0.0)  # (the mechanism: never stop)
    args.update(kw)
    dev = {n: t.to(device) for n, t in models["sd"].items()}
    draft = None
    if drafter == "mtp":  # the checkpoint's MTP head (tests/test_speculative_mtp.py)
        draft = "mtp"
    elif drafter is not None:
        dcfg, dsd = models[drafter]
        draft = (dcfg, {n: t.to(device) for n, t in dsd.items()})
    return LLMEngine(models["cfg"], dev, EngineConfig(**args), EOS, draft)


def run(e: LLMEngine, reqs) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """reqs [(id, prompt, params)] added together -> (ids, finish reasons, engine steps)."""
    ids = {rid: [] for rid, *_ in reqs}
    reasons = {}
    for rid, prompt, params in reqs:
        e.add_request(prompt, params, rid)
    steps = 0
    while e.has_unfinished():
        steps += 1
        for o in e.step():
            ids[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return ids, reasons, steps


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(L),), generator=g).tolist()
            for L in torch.randint(5, 40, (n,), generator=g)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.mark.parametrize("drafter", ["draft", "self", "noisy"])
def test_greedy_output_is_unchanged(models, drafter):
    """Three requests at once, one with stop tokens that occur in plain greedy's output."""
    ps = prompts(3)
    plain_ids, _, _ = run(engine(models), [(f"r{i}", p, greedy(24, ignore_eos=True))
                                           for i, p in enumerate(ps)])
    stop = plain_ids["r1"][9]  # a token greedy decoding makes at step 10 of request r1
    reqs = [("r0", ps[0], greedy(24, ignore_eos=True)),
            ("r1", ps[1], greedy(24, stop_token_ids=(stop,))), ("r2", ps[2], greedy(17))]
    want, want_reasons, plain_steps = run(engine(models), reqs)
    e = engine(models, drafter)
    got, reasons, steps = run(e, reqs)
    assert got == want and reasons == want_reasons
    assert reasons["r1"] == "stop" and stop not in got["r1"]
    st = e.stats()
    assert st["spec_steps"] > 0 and st["num_slots_free"] == 4 and st["num_blocks_free"] == 80
    if drafter == "self":  # every guess right: about k + 1 tokens per sequence and step
        assert st["spec_tokens"] >= 3 * st["spec_seqs"] and steps < plain_steps / 2
    if drafter == "noisy":  # some guesses right, some not: both roll-back paths ran
        assert st["spec_seqs"] < st["spec_tokens"] < 4 * st["spec_seqs"]
    if drafter == "draft":  # a random drafter: mostly the model's own token alone
        assert st["spec_tokens"] < 1.5 * st["spec_seqs"]


def test_limits_sampling_and_preemption(models):
    """The context limit mid-step, a seeded sampled request beside greedy ones (speculating
    too: its tokens depend on its seed alone), and a KV pool small enough to preempt: every
    output as without a drafter."""
    ps = [p[:10] for p in prompts(4, seed=8)]
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=11)
    for kw, reqs in (
            (dict(max_model_len=64),  # the 64-token context ends "c" inside a step
             [("c", [5] * 58, greedy(40, ignore_eos=True)), ("a", ps[0], greedy(9))]),
            (dict(num_kv_blocks=8, max_model_len=128),  # 4 x 55 tokens: > 8 blocks of 16
             [("a", ps[0], greedy(45, ignore_eos=True)), ("b", ps[1], sampled),
              ("d", ps[2], greedy(45, ignore_eos=True)),
              ("e", ps[3], greedy(45, ignore_eos=True))])):
        want, want_reasons, _ = run(engine(models, **kw), reqs)
        e = engine(models, "noisy", **kw)
        got, reasons, _ = run(e, reqs)
        assert reasons == want_reasons and e.stats()["spec_steps"] > 0
        assert got == want
        if "c" in got:
            assert reasons["c"] == "length" and len(got["c"]) == 64 - 58
        else:
            assert e.scheduler.num_preemptions > 0


def test_slot_reuse_late_arrivals_and_multi_step_decode(models):
    """Two slots for five requests (slots reused: the drafter's state starts from zero for each
    new sequence), requests arriving while others decode, multi-step decode (decode_steps 4)
    for the steps a seeded sampled request shares: every output as without a drafter."""
    ps = prompts(5, seed=9)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=2)
    first = [("a", ps[0], greedy(20, ignore_eos=True)), ("b", ps[1], sampled)]
    later = [(f"l{i}", p, greedy(15 + i, ignore_eos=True)) for i, p in enumerate(ps[2:])]

    def staggered(e: LLMEngine) -> dict[str, list[int]]:
        ids = {rid: [] for rid, *_ in first + later}
        for rid, p, sp in first:
            e.add_request(p, sp, rid)
        pending, steps = list(later), 0
        while e.has_unfinished() or pending:
            steps += 1
            if pending and steps % 3 == 0:  # one more request every third step
                rid, p, sp = pending.pop(0)
                e.add_request(p, sp, rid)
            for o in e.step():
                ids[o.request_id] += o.new_token_ids
        return ids

    kw = dict(max_num_seqs=2, decode_steps=4)
    want = staggered(engine(models, **kw))
    e = engine(models, "noisy", **kw)
    got = staggered(e)
    assert got == want and len(got["b"]) == 10
    st = e.stats()
    assert st["spec_steps"] > 0 and st["num_slots_free"] == 2 and st["num_blocks_free"] == 80


@pytest.mark.parametrize("drafter", ["self", "noisy", "mtp"])
def test_seeded_sampling_is_plain_seeded_sampling(models, drafter):
    """Seeded sampled requests (temperature 0.05 / 1.0, top-k, top-p) speculate and give the
    tokens plain decoding gives them, alone or beside each other and a greedy request; with
    the model as its own drafter the cold one keeps most guesses (its tokens are mostly the
    greedy guess), so the acceptance ran past the first row, and drops some."""
    ps = prompts(3, seed=13)
    reqs = [("s0", ps[0], SamplingParams(max_tokens=16, temperature=0.05, seed=21,
                                         ignore_eos=True)),
            ("s1", ps[1], SamplingParams(max_tokens=16, temperature=1.0, top_k=20, top_p=0.9,
                                         seed=22, ignore_eos=True)),
            ("g", ps[2], greedy(16, ignore_eos=True))]
    want, _, _ = run(engine(models), reqs)
    e = engine(models, drafter, **(dict(num_speculative_tokens=2) if drafter == "mtp" else {}))
    got, _, _ = run(e, reqs)
    assert got == want
    alone, _, _ = run(engine(models, drafter), reqs[1:2]) if drafter != "mtp" else (want, 0, 0)
    assert alone["s1"] == want["s1"]
    assert e.stats()["spec_seqs"] >= 3 * 4  # every request speculated, steps after steps
    if drafter == "self":  # the cold one alone: guesses kept, not all of them
        e = engine(models, drafter)
        run(e, reqs[:1])
        st = e.stats()
        assert 1.5 * st["spec_seqs"] < st["spec_tokens"] < 5 * st["spec_seqs"], st


def first_three(models) -> tuple[list[int], SamplingParams, dict[tuple[int, ...], float]]:
    """A prompt, sampling at temperature 0.8 with top-k 3 for three tokens, and the exact
    probability of each three tokens it can make (chained per-token probabilities from plain
    forwards)."""
    from volundr.sampler import apply_filters
    from volundr.scheduler import ScheduledSeq
    from volundr.sequence import Sequence

    prompt = prompts(1, seed=12)[0][:8]
    params = SamplingParams(max_tokens=3, temperature=0.8, top_k=3, ignore_eos=True)
    ref = engine(models)

    def probs_after(ids: list[int]) -> torch.Tensor:
        seq = Sequence("p", ids, params)
        seq.slot = 0
        ref.block_manager.grow(seq, len(ids))
        r = ref.runner
        with torch.inference_mode():
            b = r.prepare([ScheduledSeq(seq, len(ids))])
            r._init_states([ScheduledSeq(seq, len(ids))])
            logits = r.model.compute_logits(r.model(b))
        ref.block_manager.free(seq)
        one = torch.ones(1)
        return apply_filters(logits[-1:], 0.8 * one, torch.tensor([3]), one, 0 * one)[0]

    exact: dict[tuple[int, ...], float] = {}
    p0 = probs_after(prompt)
    for a in p0.nonzero().flatten().tolist():
        p1 = probs_after(prompt + [a])
        for b in p1.nonzero().flatten().tolist():
            p2 = probs_after(prompt + [a, b])
            for c in p2.nonzero().flatten().tolist():
                exact[(a, b, c)] = float(p0[a] * p1[b] * p2[c])
    return prompt, params, exact


def total_variation(ids: dict[str, list[int]], exact: dict[tuple[int, ...], float]) -> float:
    """Total variation between the requests' empirical distribution of their tokens and
    `exact` (1.0 when any request made tokens `exact` cannot)."""
    counts: dict[tuple[int, ...], int] = {}
    for t in ids.values():
        counts[tuple(t)] = counts.get(tuple(t), 0) + 1
    if not set(counts) <= set(exact):
        return 1.0
    n = len(ids)
    return 0.5 * sum(abs(counts.get(x, 0) / n - exact.get(x, 0.0)) for x in {*counts, *exact})


@pytest.mark.parametrize("drafter", ["self", "noisy"])
def test_sampled_tokens_follow_the_model_distribution(models, drafter):
    """Sampled requests (temperature 0.8, top-k 3, no seed) decode speculatively: the empirical
    distribution of their first three tokens over 2000 requests matches the model's exact one
    (chained per-token probabilities from plain forwards) as closely as sampling noise allows
    (0.04 here). Rules that keep every guess, or draw a replacement for a dropped guess from
    the whole distribution instead of the rest, land at 0.24+ with the model as its own
    drafter (its guesses are kept about half the time; the noisy drafter's rarely)."""
    prompt, params, exact = first_three(models)
    e = engine(models, drafter, max_num_seqs=32, max_num_batched_tokens=256, seed=1)
    n = 2000
    ids, _, _ = run(e, [(f"s{i}", prompt, params) for i in range(n)])
    tv = total_variation(ids, exact)
    st = e.stats()
    assert st["spec_seqs"] >= n and st["spec_seqs"] < st["spec_tokens"] < 2 * st["spec_seqs"]
    # sampling noise: E[TV] ~ 0.5 sum_x sqrt(2 p_x / (pi n)) <= 0.05 over 27 triples
    assert tv < 0.1, tv


def test_session_parked_after_speculative_steps(models):
    """A session's turn ends in a speculative step (stop token); its next turn resumes from
    the parked state and equals the same prompt from scratch."""
    p = prompts(1, seed=4)[0]
    plain, _, _ = run(engine(models), [("t", p, greedy(20, ignore_eos=True))])
    t = plain["t"]
    j = next(j for j in range(5, len(t)) if t[j] not in t[:j])  # a stop token first seen at j
    stop = t[j]
    e = engine(models, "noisy")
    e.add_request(p, greedy(20, stop_token_ids=(stop,)), "t1", session_id="s")
    turn1 = []
    while e.has_unfinished():
        for o in e.step():
            turn1 += o.new_token_ids
    assert turn1 == t[:j] and e.stats()["spec_steps"] > 0
    nxt = p + turn1 + [stop] + [7, 8, 9]
    e.add_request(nxt, greedy(10, ignore_eos=True), "t2", session_id="s")
    resumed = []
    while e.has_unfinished():
        for o in e.step():
            resumed += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == len(p) + j  # the stop token itself never ran through the model
    scratch, _, _ = run(engine(models), [("x", nxt, greedy(10, ignore_eos=True))])
    assert resumed == scratch["x"]


def test_session_parks_the_drafter_state(models):
    """The drafter's state is parked with the session and restored with the model's: the next
    turn's first catch-up runs the tokens after the drafter's parked count only, and with the
    model as its own drafter its guesses are kept as before (a wrong state would lose them)."""
    p = prompts(1, seed=6)[0]
    e = engine(models, "self")
    e.add_request(p, greedy(12, ignore_eos=True), "t1", session_id="s")
    out1 = []
    while e.has_unfinished():
        for o in e.step():
            out1 += o.new_token_ids
    parked = e.sessions._parked["s"]
    assert len(p) < parked.draft_tokens <= len(parked.tokens)
    caught = []  # tokens of each drafter forward outside its guesses (catch-up)
    for name in ("run", "check"):
        fn = getattr(e.drafter, name)

        def counted(batch, *a, fn=fn, **kw):
            caught.append(sum(it.num_new_tokens for it in batch))
            return fn(batch, *a, **kw)
        setattr(e.drafter, name, counted)
    before = e.stats()
    nxt = p + out1 + [7, 8, 9]
    e.add_request(nxt, greedy(12, ignore_eos=True), "t2", session_id="s")
    resumed = []
    while e.has_unfinished():
        for o in e.step():
            resumed += o.new_token_ids
    st = e.stats()
    assert caught[0] == len(nxt) - parked.draft_tokens  # (from scratch: len(nxt))
    seqs, toks = (st[k] - before[k] for k in ("spec_seqs", "spec_tokens"))
    assert toks >= 3 * seqs, (toks, seqs)
    scratch, _, _ = run(engine(models), [("x", nxt, greedy(12, ignore_eos=True))])
    assert resumed == scratch["x"] and st["sessions_resumed"] == before["sessions_resumed"] + 1


def test_drafter_checks(models):
    cfg = get_config("tiny", vocab_size=640, eos_token_id=EOS)
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(models["cfg"], models["sd"], EngineConfig(device="cpu", dtype=torch.float32,
                                                            num_kv_blocks=80, max_model_len=256),
                  EOS, (cfg, random_state_dict(cfg, "cpu", dtype=torch.float32)))
    with pytest.raises(ValueError, match="tensor parallelism"):  # (before any rank starts)
        LLMEngine(models["cfg"], models["sd"], EngineConfig(
            device="cpu", dtype=torch.float32, num_kv_blocks=80, max_model_len=256,
            tensor_parallel_size=2), EOS, models["draft"])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(device="cpu", dtype=torch.float32, num_kv_blocks=80, max_model_len=256,
                     num_speculative_tokens=0)


@CUDA
def test_cuda_greedy_output_is_unchanged(models):
    """On CUDA (bf16, decode in CUDA graphs, the drafter's too): the model's own weights as
    drafter; plain greedy's tokens, fewer steps."""
    ps = prompts(2)
    reqs = [(f"r{i}", p, greedy(32, ignore_eos=True)) for i, p in enumerate(ps)]
    want, _, plain_steps = run(engine(models, device="cuda"), reqs)
    e = engine(models, "self", device="cuda")
    got, _, steps = run(e, reqs)
    # bf16: the chunked check and one-token decode may round a late near-tie apart
    assert all(got[r][:8] == want[r][:8] for r in want) and steps < plain_steps


def test_drafter_in_the_memory_plan():
    """Under a GPU budget the drafter's weights and states, both models' state copies and its
    KV per token come out of the model's KV pool (LLM's sizing; pure arithmetic, no GPU)."""
    from volundr.llm import _default_kv_blocks
    from volundr.memory import plan_memory

    cfg, dcfg = get_config("volundr-32b-q"), get_config("volundr-draft")
    cuda = torch.device("cuda")  # (with a budget given, nothing is asked of the device)
    args = (16.0, 1, 2048, 262144, 16, 1, torch.float8_e4m3fn)
    alone = _default_kv_blocks(cfg, cuda, *args)
    with pytest.warns(UserWarning, match="the context is capped"):  # (under 262K tokens)
        both = _default_kv_blocks(cfg, cuda, *args, draft_cfg=dcfg)
    t = plan_memory(cfg, 16.0, 1, 2048, kv_dtype=torch.float8_e4m3fn)
    d = plan_memory(dcfg, None, 1, 1, kv_dtype=torch.float8_e4m3fn)
    fixed = d.weights_gpu_bytes + 2 * d.state_bytes_per_seq + MAX_CHECK_LEN * cfg.vocab_size * 4
    free = t.kv_gpu_tokens * t.kv_bytes_per_token - fixed  # what the pool had, less the drafter
    assert both == min(16384, free // (t.kv_bytes_per_token + d.kv_bytes_per_token) // 16)
    assert both < alone
    with pytest.raises(ValueError, match="drafter alone"):
        _default_kv_blocks(cfg, cuda, 0.5, *args[1:], draft_cfg=dcfg)


def _check_commit_case(e: LLMEngine, L: int, seed: int):
    """Three sequences after their prompts, then a check of q_i <= L more tokens each and a
    commit of m_i <= q_i of them; returns (check logits, states after the check, after the
    commit, and the same two from running the tokens plainly: logits of a full forward, states
    after a forward of the m_i tokens)."""
    from volundr.scheduler import ScheduledSeq
    from volundr.sequence import Sequence

    r, g = e.runner, torch.Generator().manual_seed(seed)
    ps = prompts(3, seed=seed)
    q = [L, 2, 1]
    m = [L - 1, 2, 1]
    seqs = []
    with torch.inference_mode():
        for i, p in enumerate(ps):
            s = Sequence(f"c{i}", p, greedy(8))
            s.slot = i
            e.block_manager.grow(s, len(p) + L)
            r.run([ScheduledSeq(s, len(p) - 1)])  # the prompt but its last token
            s.num_computed_tokens = len(p) - 1
            s.token_ids += torch.randint(3, 512, (q[i] - 1,), generator=g).tolist()
            seqs.append(s)
        slots = [s.slot for s in seqs]
        before = r.save_states(slots)
        logits = r.check([ScheduledSeq(s, n) for s, n in zip(seqs, q)], L)
        after_check = r.save_states(slots)
        r.commit(m)
        after_commit = r.save_states(slots)
        # plainly: the same tokens through an ordinary forward, from the states before
        r.load_states(slots, before)
        items = [ScheduledSeq(s, n) for s, n in zip(seqs, q)]
        want_logits = r.model.compute_logits(r.model(r.prepare(items)))
        r.load_states(slots, before)
        r.run([ScheduledSeq(s, n) for s, n in zip(seqs, m)])
        want_states = r.save_states(slots)
    rows = torch.cat([logits[i, :n] for i, n in enumerate(q)])
    return rows, want_logits, before, after_check, after_commit, want_states


def _assert_check_commit(case, atol: float):
    rows, want_logits, before, after_check, after_commit, want_states = case
    for a, b in zip(before, after_check):  # the check wrote no state
        assert torch.equal(a, b)
    torch.testing.assert_close(rows, want_logits, atol=atol, rtol=0)
    for a, b in zip(after_commit, want_states):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=0)


def test_check_reads_states_and_commit_takes_the_kept_tokens(models):
    """ModelRunner.check leaves every recurrent state as it was and gives each row the logits
    of an ordinary forward; commit(m) leaves the states of a forward of the first m tokens,
    for sequences of different lengths in one check (the rows' gaps)."""
    e = engine(models, "draft")
    _assert_check_commit(_check_commit_case(e, 5, seed=21), atol=1e-4)


@CUDA
def test_cuda_check_graphs_match_the_plain_forward(models):
    """The same through the captured check and commit graphs (bf16)."""
    e = engine(models, "draft", device="cuda")
    assert e.runner.checks is not None and e.drafter.checks is not None
    _assert_check_commit(_check_commit_case(e, 5, seed=22), atol=0.05)
