"""Multi-step speculation with the MTP head (StepPlan.spec_steps, CheckGraphs.run_greedy_mtp's
`steps`): a batch of greedy (or unseeded sampled) sequences takes up to decode_steps
speculative steps back to back on the device, each checking the last one's counted token and
the MTP head's guesses, one read back for all. The next check's rows made on the device
(check_layout.next_check) equal the host's check_layout of the advanced sequences; an engine
speculating several steps at a time gives plain greedy's tokens and finish reasons (a stop
token and max_tokens reached inside a run of steps; a sequence that stopped is padding
after), its sessions resume to the same next turn as one step at a time, and its KV blocks
all come back; sampled requests keep the model's distribution. On the CPU through
test_speculative_mtp's eager_graphs; on CUDA through the captured graphs."""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import test_speculative_mtp
import torch
from test_speculative import CUDA, engine, first_three, greedy, prompts, run, total_variation
from test_speculative_mtp import eager_graphs, mtp_engine, three_requests

from volundr.check_layout import check_layout, next_check
from volundr.model_runner import MAX_CHECK_SEQS
from volundr.sampling_params import SamplingParams
from volundr.scheduler import ScheduledSeq
from volundr.sequence import Sequence

models = test_speculative_mtp.models  # (the tiny model fixture)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_next_check_equals_the_host_layout(seed):
    """Random sequences after a check of L rows [t_0, d_1 .. d_k] with random argmax rows,
    counted lengths (0: a sequence already padding), caps and stop ids: next_check's q, caps,
    n-gram windows, slots and contexts == check_layout of each live sequence advanced by its
    counted tokens and checking [its last counted token, the new guesses]; the others padding;
    a sequence whose last counted token is a stop or whose cap runs out is no longer live."""
    g = torch.Generator().manual_seed(seed)
    n, k, M, bs, pad = 6, 3, 3, 4, 1
    L = k + 1
    seqs, ngrams, ctx, tables = [], [], [], []
    for i in range(n):
        hist = torch.randint(3, 50, (int(torch.randint(1, 12, (1,), generator=g)),),
                             generator=g).tolist()
        s = Sequence(f"s{i}", hist + torch.randint(3, 50, (k,), generator=g).tolist(),
                     SamplingParams())
        s.num_computed_tokens = len(hist) - 1  # t_0 = hist[-1], then k drafts
        s.block_table = torch.randperm(40, generator=g)[:12].tolist()
        s.slot = i
        lay = check_layout([ScheduledSeq(s, L)], L, bs, M, pad)
        seqs.append(s)
        ngrams.append(lay["ngrams"])
        ctx.append(lay["ctx"])
        tables.append(s.block_table)
    caps = torch.randint(1, 8, (n,), generator=g)
    lens = torch.minimum(torch.randint(0, L + 1, (n,), generator=g), caps)
    lens[0] = max(int(lens[0]), 1)
    a = torch.randint(3, 50, (n, L), generator=g)
    for i, s in enumerate(seqs):  # the counted rows but the last kept their guesses
        m, p0 = int(lens[i]), s.num_computed_tokens
        a[i, :max(m - 1, 0)] = torch.tensor(s.token_ids[p0 + 1:p0 + m], dtype=torch.long)
    stops = torch.full((n, 2), -1)
    stops[0, 0] = a[0, int(lens[0]) - 1]  # sequence 0 counted a stop
    guesses = torch.randint(3, 50, (n, k), generator=g)
    q, new_caps, win, slot_map, new_ctx = next_check(
        a, lens, guesses, caps, stops, torch.tensor(ngrams), torch.tensor(ctx, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32), bs, pad)
    for i, s in enumerate(seqs):
        m = int(lens[i])
        stopped = m > 0 and int(a[i, m - 1]) in stops[i].tolist()
        cap = 0 if stopped else int(caps[i]) - m
        assert int(new_caps[i]) == cap
        if m == 0 or cap <= 0:  # padding from now on
            assert int(q[i]) == 0 and (slot_map[i] == -1).all() and (new_ctx[i] == 1).all()
            assert (win[i] == pad).all()
            continue
        p0 = s.num_computed_tokens
        kept = a[i, :m].tolist()
        s.token_ids = s.token_ids[:p0 + 1] + kept + guesses[i].tolist()
        s.num_computed_tokens = p0 + m
        want = check_layout([ScheduledSeq(s, L)], L, bs, M, pad)
        assert int(q[i]) == L
        assert win[i].tolist() == want["ngrams"]
        assert slot_map[i].tolist() == want["slot_mapping"]
        assert new_ctx[i].tolist() == want["ctx"]


def steps_engine(models, device: str, decode_steps: int, monkeypatch, k: int, seqs: int = 4):
    e = mtp_engine(models, device=device, k=k, decode_steps=decode_steps, max_num_seqs=seqs,
                   num_kv_blocks=20 * seqs, max_num_batched_tokens=16 * seqs)
    if device == "cpu":
        eager_graphs(monkeypatch, e, seqs)
    calls, real = [], e.runner.check_greedy_mtp

    def counted_call(*a, calls=calls, real=real):
        calls.append((a[5] if len(a) > 5 else 1, real(*a)))  # (steps asked, the result)
        return calls[-1][1]

    e.runner.check_greedy_mtp = counted_call
    return e, calls


def check_steps(models, device: str, monkeypatch, k: int, right: bool) -> None:
    """Three greedy requests (r1 ends at a stop token of its plain greedy output, the others at
    max_tokens; r1 and r2 in sessions) on an MTP engine one speculative step at a time and up
    to 4 at a time: plain greedy's tokens and reasons from both, fewer engine steps with 4,
    some of its calls ran several steps; then the sessions' next turns (their states parked
    after steps past their ends) give the same tokens on both; every KV block and slot free
    after."""
    reqs, want, want_reasons, full = three_requests(models, device, 21, 8)
    results = []
    for n in (1, 4):
        e, calls = steps_engine(models, device, n, monkeypatch, k)
        add = e.add_request  # r1, r2 and their next turns t1, t2: two sessions
        e.add_request = lambda p, sp, rid, add=add: add(
            p, sp, rid, session_id=rid[1] if rid in ("r1", "r2", "t1", "t2") else None)
        if right:  # each draft right before every engine step (a run's first step keeps them)
            step = e.step

            def stepped(step=step, e=e):
                for s in e.requests.values():
                    if s.mtp_drafts and s.request_id in full:
                        m = len(s.token_ids)
                        s.mtp_drafts = (full[s.request_id][m:] + s.mtp_drafts)[:len(s.mtp_drafts)]
                return step()

            e.step = stepped
        got, reasons, steps = run(e, reqs)
        assert got == want and reasons == want_reasons, n
        assert calls and all(c is not None for _, c in calls)
        if n > 1:
            assert any(s > 1 and len(c) > 1 for s, c in calls)
        stop = reqs[1][2].stop_token_ids  # (r1's last token, never emitted)
        more, _, _ = run(e, [("t1", full["r1"] + list(stop) + [7, 8, 9], greedy(6)),
                             ("t2", full["r2"] + [7, 8, 9], greedy(6, ignore_eos=True))])
        st = e.stats()
        assert st["num_blocks_free"] == 80 and st["num_slots_free"] == 4
        assert st["sessions_resumed"] == 2  # (both next turns from the parked states)
        results.append((steps, more))
    (steps1, more1), (steps4, more4) = results
    assert more4 == more1 and steps4 < steps1


def test_speculative_steps_on_the_cpu(models, monkeypatch):
    check_steps(models, "cpu", monkeypatch, 2, right=True)
    check_steps(models, "cpu", monkeypatch, 1, right=False)


def force_guesses(e, c: int) -> None:
    """Every guess of e's MTP graphs is token c (the block still runs, its KV stored)."""
    for size, (g, gcm, guesses, stash, h) in list(e.runner.mtp_graphs.graphs.items()):
        def replay(g=g, guesses=guesses):
            g.replay()
            guesses.fill_(c)
        e.runner.mtp_graphs.graphs[size] = (SimpleNamespace(replay=replay), gcm, guesses, stash,
                                            h)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_seeded_steps_are_plain_seeded_sampling(models, monkeypatch, device):
    """Seeded sampled requests (temperature 0.8, top-k 3 / top-p 0.9) beside a greedy one, one
    speculative step a read back or up to 4, every guess the token most common in their
    outputs (kept at times): each request's tokens are plain seeded sampling's, token for
    token (each checked row drawn with the noise row of the token it would be, the
    generators left a row per emitted token)."""
    prompt = prompts(1, seed=12)[0][:8]
    reqs = [(f"s{i}", prompt, SamplingParams(max_tokens=14, temperature=0.8, seed=100 + i,
                                             ignore_eos=True, **({"top_k": 3} if i % 2 else
                                                                 {"top_p": 0.9})))
            for i in range(6)] + [("g", prompt, greedy(14, ignore_eos=True))]
    want, _, _ = run(engine(models, device=device), reqs)
    common = Counter(t for r in want.values() for t in r[1:]).most_common(1)[0][0]
    for n in (1, 4):
        e, calls = steps_engine(models, device, n, monkeypatch, 2, seqs=MAX_CHECK_SEQS)
        force_guesses(e, common)
        got, _, _ = run(e, reqs)
        st = e.stats()
        assert got == want, n
        assert calls and all(c is not None for _, c in calls)
        assert st["spec_tokens"] > st["spec_seqs"], st  # (guesses kept)
        if n > 1:
            assert any(s > 1 and len(c) > 1 for s, c in calls)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_sampled_steps_follow_the_model_distribution(models, monkeypatch, device):
    """Unseeded sampled requests (temperature 0.8, top-k 3) on the graphs' path, up to 4 steps
    at a time, k = 2: each row's token drawn on the device, a guess kept while it equals its
    row's draw; the empirical distribution of the first three tokens of 2000 requests matches
    the model's exact one (float32) as closely as sampling noise allows (0.04; bound 0.1; on
    CUDA the model runs in bf16). Keeping every guess makes triples the model cannot."""
    prompt, params, exact = first_three(models)
    e, calls = steps_engine(models, device, 4, monkeypatch, 2, seqs=MAX_CHECK_SEQS)
    # the tiny MTP head's own guesses are never drawn: every guess is the token most likely
    # third instead (any guess keeps the distribution; this one is kept often). The first
    # check after the prompt has no guess yet; so 4 tokens, the first three compared.
    mass: dict[int, float] = {}
    for t, p in exact.items():
        mass[t[2]] = mass.get(t[2], 0.0) + p
    force_guesses(e, max(mass, key=mass.get))
    params = dataclasses.replace(params, max_tokens=4)
    n = 2000
    ids, _, _ = run(e, [(f"s{i}", prompt, params) for i in range(n)])
    tv = total_variation({r: t[:3] for r, t in ids.items()}, exact)
    st = e.stats()
    assert calls and all(c is not None for _, c in calls) and any(len(c) > 1 for _, c in calls)
    assert st["spec_seqs"] >= n and st["spec_tokens"] - st["spec_seqs"] > n // 10, st  # kept
    assert tv < 0.1, tv


@CUDA
@pytest.mark.parametrize("k,right", [(2, True), (3, False)])
def test_cuda_speculative_steps(models, monkeypatch, k, right):
    check_steps(models, "cuda", monkeypatch, k, right)


def test_runs_of_steps_follow_the_engine_rules(models, monkeypatch):
    """How many steps a run asks for (StepPlan.spec_steps), decode_steps 8, k = 2: never a
    sequence's 16-step trial crossed inside a run (a request joining after the first run
    shifts the count off the multiples of 8), nor more steps than its tokens left; one step
    while a prompt runs beside; with 8 seeded sampled sequences at most SEEDED_ROWS / (8 x 3)
    = 2 steps (their noise rows drawn up front)."""
    from volundr.step_plan import SEEDED_ROWS, SPEC_TRIAL_STEPS

    e, calls = steps_engine(models, "cpu", 8, monkeypatch, 2, seqs=MAX_CHECK_SEQS)
    p = prompts(2, seed=5)
    e.add_request(p[0], greedy(60, ignore_eos=True), "a")
    seen, joined = 0, False
    while e.has_unfinished():
        before = {r: (s.spec_steps, s.params.max_tokens - s.num_output_tokens)
                  for r, s in e.requests.items()}
        prompt_beside = bool(e.scheduler.waiting)  # (admitted now: its prefill in the batch)
        e.step()
        for asked, _ in calls[seen:]:
            if prompt_beside:
                assert asked == 1
            for done, left in before.values():
                assert asked <= left
                assert done >= SPEC_TRIAL_STEPS or done + asked <= SPEC_TRIAL_STEPS
        seen = len(calls)
        if not joined and e.requests["a"].spec_steps:  # b arrives after a's first run
            e.add_request(p[1], greedy(10, ignore_eos=True), "b")
            joined = True
    asked = [a for a, _ in calls]
    assert max(asked) == 8 and 1 in asked and joined
    e, calls = steps_engine(models, "cpu", 8, monkeypatch, 2, seqs=MAX_CHECK_SEQS)
    reqs = [(f"s{i}", p[0], SamplingParams(max_tokens=30, temperature=0.8, seed=i,
                                           ignore_eos=True)) for i in range(MAX_CHECK_SEQS)]
    run(e, reqs)
    assert max(a for a, _ in calls) == SEEDED_ROWS // (MAX_CHECK_SEQS * 3)


def penalized_requests(seed: int) -> list:
    from test_penalties import PEN
    from test_speculative import EOS

    ps = prompts(4, seed=seed)
    return [("a", ps[0], greedy(18, ignore_eos=True, **PEN)),
            ("b", ps[1], greedy(18, ignore_eos=True, frequency_penalty=-1.5,
                                logit_bias={9: 1.5})),
            ("m", ps[2], greedy(18, min_tokens=4, logit_bias={EOS[0]: 100})),
            ("s", ps[3], SamplingParams(max_tokens=14, temperature=0.9, seed=5,
                                        ignore_eos=True, **PEN))]


def plain_run_margins(models, device: str, reqs, monkeypatch) -> tuple:
    """Plain decoding's (ids, reasons) and the least gap between the greedy requests' best and
    second-best adjusted logit at any step: on CUDA the logits are bf16 values (steps of 1/64
    near 3), and a check computes them in other kernels than a decode step, so a gap of one
    step may go either way."""
    from volundr.sampler import Sampler

    gaps, real = [], Sampler._choose

    def choose(self, logits, seqs):
        for i, sq in enumerate(seqs):
            if sq.params.greedy:
                top = logits[i].float().topk(2).values
                gaps.append(float(top[0] - top[1]))
        return real(self, logits, seqs)

    monkeypatch.setattr(Sampler, "_choose", choose)
    want, reasons, _ = run(engine(models, device=device), reqs)
    monkeypatch.setattr(Sampler, "_choose", real)
    return want, reasons, min(gaps)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_penalties_bias_and_min_tokens_in_runs_of_steps(models, monkeypatch, device):
    """Greedy requests with penalties, a negative frequency penalty + logit_bias, min_tokens
    held against a +100 bias on EOS, and a seeded sampled one with penalties, on the MTP head's
    graph steps (sampler.RowAdjuster), one step a read back or up to 4, the guesses right
    at each engine step (so each check row's history holds guesses; in a run the later steps'
    penalties count the tokens its earlier steps counted): plain decoding's tokens and finish
    reasons, guesses kept, runs of several steps. On CUDA prompts whose plain greedy tokens
    win by more than 0.04 at every step (plain_run_margins)."""
    for seed in range(6, 60):  # (on the CPU the first: fp32 logits, no near ties)
        reqs = penalized_requests(seed)
        want, want_reasons, gap = plain_run_margins(models, device, reqs, monkeypatch)
        if device == "cpu" or gap > 0.04:
            break
    assert device == "cpu" or gap > 0.04, gap
    assert want_reasons["m"] == "stop" and len(want["m"]) == 4
    full = {rid: p + want[rid] for rid, p, _ in reqs}
    for n in (1, 4):
        e, calls = steps_engine(models, device, n, monkeypatch, 2)
        step = e.step

        def stepped(step=step, e=e):  # each sequence's guesses: its next plain tokens
            for s in e.requests.values():
                if s.mtp_drafts:
                    m = len(s.token_ids)
                    s.mtp_drafts = (full[s.request_id][m:] + s.mtp_drafts)[:len(s.mtp_drafts)]
            return step()

        e.step = stepped
        got, reasons, _ = run(e, reqs)
        st = e.stats()
        assert got == want and reasons == want_reasons, n
        assert calls and all(c is not None for _, c in calls)
        # (guesses kept: most with one step a read back; in a run, the steps after its first
        # check the head's own guesses)
        assert st["spec_tokens"] > (2 if n == 1 else 1) * st["spec_seqs"], st
        if n > 1:
            assert any(s > 1 and len(c) > 1 for s, c in calls)
