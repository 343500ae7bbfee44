"""Speculative decoding with the checkpoint's MTP head as the draft source
(volundr.speculative.speculate_mtp) on the tiny Volundr (random weights): greedy requests produce
exactly plain greedy's tokens, with its own (random: mostly wrong) guesses and with guesses
forced right (the MTP block still running, so its KV takes two rows a step); the draft a
sequence holds equals the MTP block's guess from a fresh forward over its whole history (the
MTP KV kept right across prefill chunks, checks and rejected guesses); the context limit, a
seeded request, preemption and multi-step decode leave the output alone; sampled requests run
too; a checkpoint without an MTP block is refused; on CUDA the checks' graphs feed it and the
block's own graphs guess as the eager block. The graphs' paths (their buffers, the one-replay
greedy step with its acceptance on the device) also run on the CPU, each "graph" rerunning its
captured step (`eager_graphs`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_speculative import CUDA, EOS, engine, greedy, prompts, run

from volundr.config import MTPConfig
from volundr.engine import EngineConfig, LLMEngine
from volundr.model_runner import ModelRunner
from volundr.sampling_params import SamplingParams
from volundr.scheduler import ScheduledSeq
from volundr.sequence import Sequence


@pytest.fixture(scope="module")
def models():
    from volundr.converter.presets import get_config, random_state_dict

    cfg = get_config("tiny", vocab_size=512, eos_token_id=EOS)
    return {"cfg": cfg, "sd": random_state_dict(cfg, "cpu", dtype=torch.float32, seed=3)}


def mtp_engine(models, device="cpu", k=1, **kw) -> LLMEngine:
    """test_speculative.engine's arguments, the MTP head as the draft source, k guesses a
    step (the block applied to its own output for the guesses after the first)."""
    return engine(models, "mtp", device, num_speculative_tokens=k, **kw)


def oracle(monkeypatch, full: dict[str, list[int]]) -> dict[str, int]:
    """ModelRunner.mtp runs as ever (its KV stored) but returns the right next guess: the
    token after the one its last row is followed by, from plain greedy's output `full`.
    Returns the block's own last guess per request (filled as it runs)."""
    real, own = ModelRunner.mtp, {}

    def mtp(self, batch, hidden, next_ids):
        got, h = real(self, batch, hidden, next_ids)
        out = []
        for item, g in zip(batch, got):
            own[item.seq.request_id] = g
            ids, n = full[item.seq.request_id], len(item.seq.token_ids) + 1
            out.append(ids[n] if n < len(ids) else g)
        return out, h

    monkeypatch.setattr(ModelRunner, "mtp", mtp)
    return own


def reference_drafts(models, ids: list[int], k: int = 1) -> list[int]:
    """The MTP block's k guesses of the tokens after ids[-1], from scratch: a fresh engine's
    forward over ids[:-1] (hidden states h_0 .. h_{n-2}), then the MTP block over those
    positions followed by ids[1:], its KV empty before: d_1 from its last row; then, one row a
    guess, the block at the next position over its own output there and the last guess."""
    e = engine(models)
    n = len(ids) - 1
    seq = Sequence("ref", ids[:-1], SamplingParams())
    seq.slot = e.slots.allocate()
    e.block_manager.grow(seq, n + k)
    item = ScheduledSeq(seq, n)
    with torch.inference_mode():
        hidden = e.runner.model(e.runner.prepare([item]))
    (d, *_), h = e.runner.mtp([item], hidden, ids[1:])
    out = [d]
    for j in range(1, k):
        seq.token_ids, seq.num_computed_tokens = ids + out[:-1], n + j - 1
        (d, *_), h = e.runner.mtp([ScheduledSeq(seq, 1)], h, [d])
        out.append(d)
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_greedy_output_is_unchanged(models, k):
    """Three requests (chunked prefills: prompts up to 40 tokens, 16 tokens a step), one with
    stop tokens from plain greedy's output, one ending by max_tokens; k guesses a step."""
    ps = prompts(3)
    plain, _, _ = run(engine(models), [(f"r{i}", p, greedy(24, ignore_eos=True))
                                       for i, p in enumerate(ps)])
    stop = plain["r1"][9]
    reqs = [("r0", ps[0], greedy(24, ignore_eos=True)),
            ("r1", ps[1], greedy(24, stop_token_ids=(stop,))), ("r2", ps[2], greedy(17))]
    want, want_reasons, _ = run(engine(models, max_num_batched_tokens=16), reqs)
    e = mtp_engine(models, k=k, max_num_batched_tokens=16)
    got, reasons, _ = run(e, reqs)
    assert got == want and reasons == want_reasons and reasons["r1"] == "stop"
    st = e.stats()
    assert st["spec_steps"] > 0 and st["num_slots_free"] == 4 and st["num_blocks_free"] == 80


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_right_guesses_cut_the_steps(models, monkeypatch, k):
    """Every guess right (the block's chain too): k + 1 tokens a step, a step after a prompt
    checking only its first guess."""
    ps = prompts(2, seed=4)
    reqs = [(f"r{i}", p, greedy(20, ignore_eos=True)) for i, p in enumerate(ps)]
    want, _, plain_steps = run(engine(models), reqs)
    oracle(monkeypatch, {r: p + want[r] for r, p, _ in reqs})
    e = mtp_engine(models, k=k)
    got, _, steps = run(e, reqs)
    st = e.stats()
    assert got == want
    assert st["spec_tokens"] >= (1 + 0.8 * k) * st["spec_seqs"], st
    assert steps < (0.6 if k == 1 else 0.45) * plain_steps, (st, steps, plain_steps)


@pytest.mark.parametrize("right,graphs,k", [(False, False, 1), (True, False, 1),
                                             (False, True, 1), (False, False, 3),
                                             (False, True, 2)])
def test_mtp_draft_equals_a_fresh_forward(models, monkeypatch, right, graphs, k):
    """Mid-generation, each running sequence's latest MTP guesses == reference_drafts over its
    tokens: with the block's own guesses (mostly rejected: one kept row a step) and with right
    ones (two rows a step), after prompts prefilled in chunks of 16 tokens; k guesses a step
    (the block on its own output: its rows past the kept tokens rewritten as they come); and
    through the graphs' paths (eager_graphs: the one-replay greedy step)."""
    ps = prompts(2, seed=6)
    reqs = [(f"r{i}", p, greedy(30, ignore_eos=True)) for i, p in enumerate(ps)]
    own = None
    if right:
        want, _, _ = run(engine(models), reqs)
        own = oracle(monkeypatch, {r: p + want[r] for r, p, _ in reqs})
    e = mtp_engine(models, k=k, max_num_batched_tokens=16)
    if graphs:
        eager_graphs(monkeypatch, e)
    for rid, p, params in reqs:
        e.add_request(p, params, rid)
    for _ in range(9):
        e.step()
    seqs = [s for s in e.requests.values() if s.mtp_drafts]
    assert len(seqs) == 2 and all(s.num_output_tokens > 4 for s in seqs)
    assert all(len(s.mtp_drafts) == k for s in seqs)  # (a speculative step's: k guesses)
    st = e.stats()
    if right:
        assert st["spec_tokens"] >= 1.8 * st["spec_seqs"], st
        monkeypatch.undo()  # (the reference: the block's own guess)
    for s in seqs:
        guesses = [own[s.request_id]] if right else s.mtp_drafts
        assert guesses == reference_drafts(models, s.token_ids, k), s.request_id


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_limits_preemption_and_multi_step_decode(models, k):
    """With the MTP head drafting: the context limit inside a step, a seeded sampled request
    beside greedy ones (outside speculation), a KV pool that preempts (the block's KV and draft
    recomputed with the prompt), and multi-step decode while the batch is too big to check
    (decode_steps 4, 3 sequences, checks of at most 2; no drafts kept), then checks: every
    output as without it; k guesses a step (the chain's rows too near the context limit)."""
    ps = [p[:10] for p in prompts(4, seed=8)]
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=11)
    for kw, reqs in (
            (dict(max_model_len=64),
             [("c", [5] * 58, greedy(40, ignore_eos=True)), ("a", ps[0], greedy(9))]),
            (dict(num_kv_blocks=8, max_model_len=128),
             [("a", ps[0], greedy(45, ignore_eos=True)), ("b", ps[1], sampled),
              ("d", ps[2], greedy(45, ignore_eos=True)),
              ("e", ps[3], greedy(45, ignore_eos=True))]),
            (dict(decode_steps=4),  # x ends early: then y and z speculate, no drafts at first
             [(r, p, greedy(n, ignore_eos=True)) for r, p, n in zip("xyz", ps, (6, 24, 24))])):
        want, want_reasons, _ = run(engine(models, **kw), reqs)
        e = mtp_engine(models, k=k, **kw)
        if "decode_steps" in kw:
            e.runner.max_check_seqs = 2  # (as captured checks cap it on a GPU)
        got, reasons, _ = run(e, reqs)
        assert got == want and reasons == want_reasons and e.stats()["spec_steps"] > 0
        if "e" in got:
            assert e.scheduler.num_preemptions > 0


def test_mtp_chain_stays_inside_the_context(models, monkeypatch):
    """Right guesses (4 tokens a step at k = 3) up to the context limit: the chain's rows reach
    2k positions past the computed ones, so sequences closer to the limit decode plainly; no
    block table grows past max_model_len (the captured graphs' width) and the output is plain
    greedy's."""
    reqs = [("c", [5] * 30, greedy(40, ignore_eos=True)), ("d", [7] * 20, greedy(60))]
    want, want_reasons, _ = run(engine(models, max_model_len=64), reqs)
    oracle(monkeypatch, {r: p + want[r] for r, p, _ in reqs})
    e = mtp_engine(models, k=3, max_model_len=64)
    widest, grow = [0], e.block_manager.grow

    def grown(seq, n):
        grow(seq, n)
        widest[0] = max(widest[0], len(seq.block_table))

    e.block_manager.grow = grown
    got, reasons, _ = run(e, reqs)
    assert got == want and reasons == want_reasons and reasons["c"] == "length"
    assert widest[0] == 64 // 16 and e.stats()["spec_tokens"] >= 3 * e.stats()["spec_seqs"]


def test_sequences_stop_speculating_when_it_does_not_pay(models, monkeypatch):
    """EngineConfig.spec_min_tokens: with the random head's own guesses (about one token a
    step) each sequence stops after SPEC_TRIAL_STEPS speculative steps and decodes plainly,
    its output unchanged; with guesses right (two tokens a step) or spec_min_tokens 0 none
    stops."""
    from volundr.step_plan import SPEC_TRIAL_STEPS

    ps = prompts(2, seed=12)
    reqs = [(f"r{i}", p, greedy(40, ignore_eos=True)) for i, p in enumerate(ps)]
    want, _, plain_steps = run(engine(models), reqs)
    for right, floor in ((False, 1.3), (False, 0.0), (True, 1.3)):
        if right:
            oracle(monkeypatch, {r: p + want[r] for r, p, _ in reqs})
        e = mtp_engine(models, spec_min_tokens=floor)
        got, _, steps = run(e, reqs)
        st = e.stats()
        assert got == want, (right, floor)
        stops = not right and floor > 0
        assert st["spec_stopped"] == (2 if stops else 0), (right, floor, st)
        if stops:  # 16 speculative steps each, then plain ones
            assert st["spec_seqs"] == 2 * SPEC_TRIAL_STEPS
            assert st["spec_tokens"] < floor * st["spec_seqs"]
        else:
            assert st["spec_seqs"] > 2 * SPEC_TRIAL_STEPS
    with pytest.raises(ValueError, match="spec_min_tokens"):
        EngineConfig(device="cpu", dtype=torch.float32, num_kv_blocks=256, spec_min_tokens=-1)


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_sampled_requests_run(models, k):
    """A sampled request beside a greedy one: the host's path (speculative sampling, then
    the block and its chain over the kept rows)."""
    e = mtp_engine(models, k=k)
    reqs = [("s0", prompts(1, seed=8)[0], SamplingParams(max_tokens=16, temperature=0.8,
                                                          ignore_eos=True)),
            ("g0", prompts(1, seed=9)[0], greedy(16, ignore_eos=True))]
    got, _, _ = run(e, reqs)
    assert len(got["s0"]) == 16 and len(got["g0"]) == 16 and e.stats()["spec_steps"] > 0


def test_device_acceptance_matches_the_host_lists():
    """check_layout.greedy_lengths == greedy_kept's lengths on random argmax rows and guesses
    (mostly right, so that every length occurs), padding sequences 0; counted_lengths == the
    engine's rule (LLMEngine._counted: up to the first stop id, at most the cap); kept_cu ==
    check_layout's cu for those lengths with the padding's gaps (CheckGraphs._padded_cu)."""
    from volundr.check_layout import check_layout, counted_lengths, greedy_lengths, kept_cu
    from volundr.speculative import greedy_kept

    gen = torch.Generator().manual_seed(2)
    for L in (2, 5):
        n, size = 7, 8
        a = torch.randint(0, 3, (size, L), generator=gen)
        toks = torch.where(torch.rand(size, L, generator=gen) < 0.7,
                           torch.cat([a[:, :1], a[:, :-1]], 1), a.roll(1, 1) + 1)
        q = torch.randint(1, L + 1, (size,), generator=gen)
        q[n:] = 0
        lens = greedy_lengths(a, toks, q)
        want = [len(greedy_kept(a[i].tolist(), toks[i, 1:q[i]].tolist())) for i in range(n)]
        assert lens.tolist() == want + [0] * (size - n), L
        caps = torch.randint(1, L + 2, (size,), generator=gen)
        stops = torch.randint(-1, 3, (size, 2), generator=gen)
        got = counted_lengths(a, lens, caps, stops).tolist()
        for i in range(size):
            toks, cap, st = a[i, :lens[i]].tolist(), int(caps[i]), stops[i].tolist()
            ref = next((j + 1 for j, t in enumerate(toks) if t in st or j + 1 >= cap), len(toks))
            assert got[i] == ref, (L, i)
        seqs = []
        for i in range(n):
            s = Sequence(f"s{i}", list(range(10)), SamplingParams())
            s.num_computed_tokens, s.slot, s.block_table = 10 - L, i, [i]
            seqs.append(ScheduledSeq(s, L))
        lay = check_layout(seqs, L, 16, 3, 0, lengths=lens[:n].tolist())
        pad = [x for i in range(n, size) for x in (i * L, (i + 1) * L)]
        assert kept_cu(lens, L).tolist() == lay["cu"] + pad, L


@CUDA
@pytest.mark.parametrize("k", [1, 2])
def test_cuda_mtp_greedy_output_is_unchanged(models, k):
    """On CUDA (bf16; decode, the checks and the MTP block in CUDA graphs, the checks' hidden
    states read from the graphs; greedy steps as one replay with the acceptance on the device,
    ModelRunner.check_greedy_mtp): plain greedy's tokens."""
    ps = prompts(2)
    reqs = [(f"r{i}", p, greedy(32, ignore_eos=True)) for i, p in enumerate(ps)]
    want, _, _ = run(engine(models, device="cuda"), reqs)
    e = mtp_engine(models, device="cuda", k=k)
    assert e.runner.checks is not None  # (the checks as graphs)
    fused, real = [], e.runner.check_greedy_mtp
    e.runner.check_greedy_mtp = lambda *a: fused.append(real(*a)) or fused[-1]
    got, _, _ = run(e, reqs)
    # bf16: the two-row check and the one-token decode may round a late near-tie apart
    assert all(got[r][:8] == want[r][:8] for r in want) and e.stats()["spec_steps"] > 0
    assert fused and all(f is not None for f in fused)


class _Replay:
    """A "graph" that re-runs its function (eager_graphs)."""

    def __init__(self, fn):
        self.replay = fn


def eager_graphs(monkeypatch, e: LLMEngine, max_n: int = 4) -> None:
    """The check, commit and MTP graphs on the CPU: CheckGraphs with every "capture" replaced
    by a function that reruns the captured step and copies its results into the tensors the
    capture returned, so that the graphs' buffer filling (`_fill`, `run_greedy_mtp`'s device
    acceptance and masks) runs as on CUDA, in float32."""
    from volundr.check_graphs import CheckGraphs

    def capture(self, n, b, bc):
        logits, stash, hidden = self._check(b)

        def check():
            out, new, h = self._check(b)
            if logits is not None:
                logits.copy_(out)
            hidden.copy_(h)
            for (_, old_in), (_, new_in) in zip(stash, new):
                for t, u in zip(old_in, new_in):
                    t.copy_(u)

        commit = None if self.mtp else _Replay(lambda: self._commit(stash, bc))
        self.graphs[n] = (_Replay(check), commit, logits, stash, hidden)

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)
    monkeypatch.setattr(CheckGraphs, "_capture", capture)
    r = e.runner
    args = (r.model, r.device, e.check_len, max_n, -(-r.max_model_len // r.block_size),
            r.max_model_len, True)
    r.checks = CheckGraphs(*args)
    r.mtp_graphs = CheckGraphs(*args, mtp=torch.float32)
    r.checks.warm_spec_ops(r.mtp_graphs, r.block_size)  # (as the runner does; harmless after)
    r.max_check_seqs = max_n


def three_requests(models, device: str, longest: int, stop_at: int):
    """Three greedy requests of `longest`, - 3, - 6 tokens (r0, r1, r2), r1 then ending at the
    stop token its plain greedy output makes at index stop_at. Returns (reqs, plain greedy's
    ids and finish reasons, each request's prompt + ids)."""
    ps = prompts(3, seed=9)
    reqs = [(f"r{i}", p, greedy(longest - 3 * i, ignore_eos=True)) for i, p in enumerate(ps)]
    want, _, _ = run(engine(models, device=device), reqs)
    reqs[1] = ("r1", ps[1], greedy(17, stop_token_ids=(want["r1"][stop_at],)))
    want, want_reasons, _ = run(engine(models, device=device), reqs)
    return reqs, want, want_reasons, {r: p + want[r] for r, p, _ in reqs}


def fused_and_host(models, device: str, right: bool, prepare=None, k: int = 1
                   ) -> tuple[list, dict, dict]:
    """Three greedy requests (one ending at a stop token of its plain greedy output, the others
    at max_tokens) run by an MTP engine twice: with the one-replay greedy step and with the
    host's check / commit / mtp calls (check_greedy_mtp off); with `right` each draft is set
    right before every step; k guesses a step. prepare(engine): its set-up (eager_graphs on the
    CPU). Returns per
    run (ids, finish reasons, steps, spec_tokens, spec_seqs, the drafts after every step, the
    one-replay calls' results, the MTP block's KV after every step), and plain greedy's ids
    and finish reasons."""
    reqs, want, want_reasons, full = three_requests(models, device, 20, 7)
    runs = []
    for fused in (True, False):
        e = mtp_engine(models, device=device, k=k)
        if prepare is not None:
            prepare(e)
        calls, real = [], e.runner.check_greedy_mtp

        def counted_call(*a, calls=calls, real=real):
            calls.append(real(*a))
            return calls[-1]

        e.runner.check_greedy_mtp = counted_call if fused else (lambda *a: None)
        drafts, caches, step = [], [], e.step
        attn = e.runner.model.mtp.layer.self_attn

        def stepped(step=step, e=e, drafts=drafts, caches=caches, attn=attn):
            for s in e.requests.values():
                n = len(s.token_ids)
                if right and s.mtp_drafts:
                    s.mtp_drafts = (full[s.request_id][n:] + s.mtp_drafts)[:len(s.mtp_drafts)]
            outs = step()
            drafts.append(sorted((s.request_id, s.mtp_drafts) for s in e.requests.values()))
            caches.append(torch.cat([attn.k_cache.flatten(), attn.v_cache.flatten()]).cpu())
            return outs

        e.step = stepped
        got, reasons, steps = run(e, reqs)
        st = e.stats()
        runs.append((got, reasons, steps, st["spec_tokens"], st["spec_seqs"], drafts, calls,
                     caches))
        assert st["num_slots_free"] == 4 and st["num_blocks_free"] == 80
    fused_run, host_run = runs
    assert fused_run[6] and all(c is not None for c in fused_run[6]) and not host_run[6]
    assert fused_run[:6] == host_run[:6] and fused_run[1]["r1"] == "stop"
    # the MTP block's KV after every step (its rows' slots, and through the chain's inputs
    # their context): equal bit for bit
    assert all(torch.equal(a, b) for a, b in zip(fused_run[7], host_run[7]))
    if right:  # tokens per sequence and step: most guesses kept
        assert fused_run[3] >= (1 + 0.5 * k) * fused_run[4], fused_run[2:5]
    return runs, want, want_reasons


@pytest.mark.parametrize("right,k", [(False, 1), (True, 1), (False, 2), (True, 2), (True, 3)])
def test_graph_paths_on_the_cpu(models, monkeypatch, right, k):
    """eager_graphs: the one-replay greedy step (device acceptance, counting, commit, MTP
    masks, the chain's rows) and the host's calls over the same "graphs" give each other's
    tokens, finish reasons and drafts every step (fused_and_host), and plain greedy's tokens
    and reasons."""
    runs, want, want_reasons = fused_and_host(models, "cpu", right,
                                              lambda e: eager_graphs(monkeypatch, e), k)
    assert runs[0][0] == want and runs[0][1] == want_reasons


@CUDA
@pytest.mark.parametrize("right,k", [(False, 1), (True, 1), (False, 2), (True, 2)])
def test_cuda_fused_greedy_step_equals_the_host_steps(models, right, k):
    """On CUDA the one-replay greedy step gives what the host's calls over the same graphs give
    (fused_and_host: bit-identical inputs to the same kernels): the same tokens, finish reasons,
    kept counts and drafts every step."""
    fused_and_host(models, "cuda", right, k=k)


@CUDA
def test_cuda_mtp_graph_guesses_as_the_eager_block(models):
    """The MTP block's CUDA graphs (ModelRunner.mtp_graphs: 1 or 2 rows per sequence, the
    rows' attention) guess what the eager block ranks first, on fresh random hidden states and
    next ids at positions inside three decoding sequences' histories (bf16: or within a
    near-tie of it); a thrown-away engine, so rewriting the block's KV there is harmless."""
    e = mtp_engine(models, device="cuda")
    r, g = e.runner, e.runner.mtp_graphs
    assert g is not None and g.graphs
    for i, p in enumerate(prompts(3, seed=8)):
        e.add_request(p, greedy(24, ignore_eos=True), f"r{i}")
    for _ in range(6):
        e.step()
    seqs = list(e.requests.values())
    assert len(seqs) == 3 and all(s.num_output_tokens > 2 for s in seqs)
    lens = [1, 2, 2]
    for s in seqs:
        s.num_computed_tokens -= 2  # positions already in the block tables
    batch = [ScheduledSeq(s, m) for s, m in zip(seqs, lens)]
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(sum(lens), models["cfg"].hidden_size, generator=gen).to(
        "cuda", torch.bfloat16)
    ids = torch.randint(3, 512, (sum(lens),), generator=gen)
    replays = []
    real = g.run_mtp
    g.run_mtp = lambda *a: replays.append(1) or real(*a)
    got, _ = r.mtp(batch, hidden, ids.tolist())
    assert replays == [1]
    with torch.inference_mode():
        logits = r.model.mtp_logits(hidden, ids, r.prepare(batch))
    last = torch.tensor(lens).cumsum(0) - 1
    for i, row in enumerate(logits[last.cuda()]):
        assert row[got[i]] >= row.max() - 0.02 * row.abs().max(), (i, got[i], row.argmax())


def test_mtp_needs_the_block(models):
    cfg = dataclasses.replace(models["cfg"], mtp=MTPConfig(num_layers=0))
    sd = {n: t for n, t in models["sd"].items() if not n.startswith("mtp.")}
    with pytest.raises(ValueError, match="no MTP block"):
        LLMEngine(cfg, sd, EngineConfig(device="cpu", dtype=torch.float32, max_num_seqs=2,
                                        max_model_len=256, num_kv_blocks=16), EOS, "mtp")
