"""Presence / frequency / repetition penalties and logit_bias (volundr.sampler) on the tiny
Volundr (random weights): the adjusted logits == a per-token loop; greedy decoding with them ==
an independent teacher-forced check (the reference model's logits after each prefix, penalized
by that prefix, biased); multi-step decode (later tokens made on the device), a drafter's and
the MTP head's speculative steps (guesses counted as generated row by row) give plain
decoding's tokens; seeded sampled requests the same alone and batched; a bias of 100 forces
its token, one of -100 bans it."""

from __future__ import annotations

import pytest
import torch
from reference_model import reference_logits
from test_speculative import EOS, engine, greedy, models, prompts, run  # noqa: F401 (a fixture)

from volundr.sampler import RowAdjuster
from volundr.sampling_params import SamplingParams
from volundr.sequence import Sequence


def naive_penalties(logits: torch.Tensor, output: list[int], prompt: list[int], presence: float,
                    frequency: float, repetition: float, bias: tuple = ()) -> torch.Tensor:
    """One row, token by token: the repetition penalty on every token of the prompt or the
    output, then each output token's presence + frequency * count, then the biases."""
    out = logits.clone()
    for t in set(output) | set(prompt if repetition != 1.0 else []):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= presence + frequency * output.count(t)
    for t, b in bias:
        out[t] += b
    return out


def _seq(i: int, prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    s = Sequence(f"r{i}", prompt, params)
    s.token_ids += output
    return s


def test_row_adjuster_matches_a_loop():
    """RowAdjuster == the per-token loop: a step's rows, a run of steps whose tokens join the
    counts on the device (multi-step decode), and a speculative check's rows (row j as if the
    guesses d_1 .. d_j had been generated, then the counted ones joining the counts), with
    min_tokens' stop ids masked while too few tokens are out, after the bias."""
    g = torch.Generator().manual_seed(7)
    V, M = 40, 8
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
              SamplingParams(),  # none: the row stays as it is
              SamplingParams(repetition_penalty=1.5),
              SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0,
                             repetition_penalty=0.8),
              SamplingParams(frequency_penalty=1.0),
              SamplingParams(presence_penalty=2.0, repetition_penalty=3.0,
                             logit_bias={3: -100.0, 17: 2.5}),
              SamplingParams(logit_bias={0: 100.0, 39: -0.5}),  # a bias alone
              SamplingParams(min_tokens=6, stop_token_ids=[5, 9], logit_bias={5: 100.0},
                             frequency_penalty=0.5)]
    outputs = [torch.randint(0, V, (n,), generator=g).tolist()
               for n in (9, 4, 0, 15, 3, 7, 5, 2)]
    outputs[4] = [5, 5, 5]  # repeats count
    prompts_ = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 3, 6, 0, 8, 2, 4, 3)]
    seqs = [_seq(i, pr, out, p) for i, (pr, out, p) in enumerate(zip(prompts_, outputs, params))]

    def want(row: torch.Tensor, i: int, hist: list[int]) -> torch.Tensor:
        p = params[i]
        out = naive_penalties(row, hist if p.penalized else [], prompts_[i], p.presence_penalty,
                              p.frequency_penalty, p.repetition_penalty, p.logit_bias)
        if len(hist) < p.min_tokens:
            out[list(p.stop_token_ids)] = float("-inf")
        return out

    adjust, hist = RowAdjuster.of(seqs), [list(o) for o in outputs]
    for j in range(4):  # a step, then the next ones of a run
        logits = torch.randn(M, V, generator=g) * 3
        got = adjust(logits, emitted=j)
        for i in range(M):
            torch.testing.assert_close(got[i], want(logits[i], i, hist[i]), msg=f"{j} {i}")
        chosen = torch.randint(0, V, (M,), generator=g)
        adjust.advance(chosen.unsqueeze(1))
        for i in range(M):
            hist[i].append(int(chosen[i]))

    L = 4
    adjust = RowAdjuster(seqs, L)
    emitted = torch.zeros(M, dtype=torch.long)
    hist = [list(o) for o in outputs]
    for step in range(2):  # two checks of a run: the first's counted rows join the counts
        ids = torch.randint(0, V, (M, L), generator=g)
        logits = torch.randn(M * L, V, generator=g) * 3
        got = adjust(logits, ids, emitted).view(M, L, V)
        for i in range(M):
            for j in range(L):
                torch.testing.assert_close(
                    got[i, j], want(logits[i * L + j], i, hist[i] + ids[i, 1:j + 1].tolist()),
                    msg=f"{step} {i} {j}")
        chosen = torch.randint(0, V, (M, L), generator=g)
        lens = torch.randint(1, L + 1, (M,), generator=g)
        adjust.advance(chosen, lens)
        emitted += lens
        for i in range(M):
            hist[i] += chosen[i, :lens[i]].tolist()
    assert RowAdjuster.of([_seq(0, [1], [2], SamplingParams(temperature=0.5))]) is None


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.1),
                                 dict(repetition_penalty=0.0),
                                 dict(presence_penalty=float("nan")),
                                 dict(logit_bias={5: 101.0}), dict(logit_bias={-1: 1.0}),
                                 dict(logit_bias={5: float("inf")}),
                                 dict(logit_bias=((5, 1.0), (5, 2.0)))])
def test_penalties_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


PEN = dict(presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.3)
BIAS = {7: 4.0, 100: -3.0}


def test_greedy_follows_the_penalized_reference_logits(models):  # noqa: F811 (the fixture)
    """Each greedy token is the argmax of the reference model's logits after the tokens before
    it, penalized by them (within fp32 noise of the maximum); without penalties the tokens
    differ (they act)."""
    cfg, sd = models["cfg"], models["sd"]
    prompt = prompts(1, seed=4)[0][:12]
    ids, _, _ = run(engine(models), [("p", prompt, greedy(16, ignore_eos=True, **PEN,
                                                          logit_bias=BIAS))])
    plain, _, _ = run(engine(models), [("p", prompt, greedy(16, ignore_eos=True))])
    out = ids["p"]
    assert len(out) == 16 and plain["p"] != out
    ref = reference_logits(cfg, sd, prompt + out)  # [T, V]: row t predicts token t + 1
    for t, tok in enumerate(out):
        row = naive_penalties(ref[len(prompt) + t - 1], out[:t], prompt, *PEN.values(),
                              tuple(BIAS.items()))
        assert row.max() - row[tok] < 1e-4, (t, tok, int(row.argmax()))


def test_logit_bias_forces_and_bans(models):  # noqa: F811
    """+100 on a token: greedy and sampled requests emit only it; -100 on plain greedy's
    tokens: none of them comes back; an id past the vocabulary: the request is refused."""
    prompt = prompts(1, seed=5)[0][:10]
    plain, _, _ = run(engine(models), [("p", prompt, greedy(8, ignore_eos=True))])
    reqs = [("f", prompt, greedy(6, ignore_eos=True, logit_bias={321: 100.0})),
            ("s", prompt, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True,
                                         logit_bias={321: 100.0})),
            ("b", prompt, greedy(8, ignore_eos=True,
                                 logit_bias={t: -100.0 for t in set(plain["p"])}))]
    got, _, _ = run(engine(models, "self"), reqs)
    assert got["f"] == got["s"] == [321] * 6
    assert len(got["b"]) == 8 and not set(got["b"]) & set(plain["p"])
    with pytest.raises(ValueError, match="logit_bias token ids"):
        engine(models).add_request(prompt, greedy(2, logit_bias={512: 1.0}), "x")


def test_device_steps_and_speculation_keep_the_penalized_tokens(models,  # noqa: F811
                                                                monkeypatch):
    """Greedy requests with penalties (one with stop tokens, one without any penalty) and a
    seeded sampled one: multi-step decode (4 tokens a step on the device), a drafter (the model
    itself: its guesses are kept, so each check row's history holds guesses; a noisy one: some
    dropped) and the MTP head (2 guesses a step; and with its graph paths on the CPU, where the
    rows are adjusted on the device: sampler.RowAdjuster) make plain decoding's tokens."""
    from test_speculative_mtp import eager_graphs

    ps = prompts(3, seed=6)
    reqs = [("a", ps[0], greedy(20, ignore_eos=True, **PEN)),
            ("b", ps[1], greedy(20, ignore_eos=True, frequency_penalty=-1.5,
                                logit_bias={9: 1.5})),
            ("c", ps[2], greedy(14, ignore_eos=True))]
    want, _, _ = run(engine(models), reqs)
    stop = want["a"][7]
    reqs[0] = ("a", ps[0], greedy(20, stop_token_ids=(stop,), **PEN))
    want, want_reasons, _ = run(engine(models), reqs)
    assert want_reasons["a"] == "stop"
    sampled = ("s", ps[1], SamplingParams(max_tokens=12, temperature=0.9, seed=5,
                                          ignore_eos=True, **PEN))
    alone, _, _ = run(engine(models), [sampled])
    for drafter, kw, graphs in ((None, dict(decode_steps=4), False), ("self", {}, False),
                                ("noisy", {}, False), ("mtp", dict(num_speculative_tokens=2),
                                                       False),
                                ("mtp", dict(num_speculative_tokens=2), True)):
        e = engine(models, drafter, **kw)
        if graphs:
            eager_graphs(monkeypatch, e)
        got, reasons, _ = run(e, reqs + [sampled] if not graphs else reqs)
        assert {r: got[r] for r in want} == want and reasons["a"] == "stop", drafter
        assert graphs or got["s"] == alone["s"], drafter
        if drafter is not None:
            assert e.stats()["spec_steps"] > 0


def test_min_tokens_in_every_path(models, monkeypatch):  # noqa: F811
    """min_tokens (vLLM's): with a +100 bias on an end-of-sequence id (greedy: it would come
    first), the stop ids are masked until min_tokens tokens are out, then the EOS ends the
    request ("stop", not emitted): the first tokens are the reference model's argmax without
    the stop ids; a stop_token_ids id is held back alike. Plain decode, multi-step decode (4
    tokens a step on the device), a drafter, the MTP head (2 guesses a step, with its graphs'
    paths on the CPU too) and a seeded sampled request beside them give the same."""
    from test_speculative_mtp import eager_graphs

    cfg, sd = models["cfg"], models["sd"]
    ps = prompts(2, seed=9)
    stop = 17
    reqs = [("e", ps[0], greedy(20, min_tokens=5, logit_bias={EOS[0]: 100})),
            ("t", ps[1], greedy(20, min_tokens=3, ignore_eos=True, stop_token_ids=(stop,),
                                logit_bias={stop: 100})),
            ("s", ps[1], SamplingParams(max_tokens=20, temperature=0.9, seed=3, min_tokens=4,
                                        logit_bias={EOS[1]: 100}))]
    want, reasons, _ = run(engine(models), reqs)
    assert reasons == {"e": "stop", "t": "stop", "s": "stop"}
    assert [len(want[r]) for r in "ets"] == [5, 3, 4]
    for rid, p, _ in reqs[:2]:  # greedy: the argmax with the stop ids masked
        banned = set(EOS) if rid == "e" else {stop}
        for t, tok in enumerate(want[rid]):
            row = reference_logits(cfg, sd, p + want[rid][:t])[-1].clone()
            row[list(banned)] = float("-inf")
            assert tok == row.argmax().item(), (rid, t)
    for drafter, kw, graphs in ((None, dict(decode_steps=4), False), ("self", {}, False),
                                ("mtp", dict(num_speculative_tokens=2), False),
                                ("mtp", dict(num_speculative_tokens=2), True)):
        e = engine(models, drafter, **kw)
        if graphs:
            eager_graphs(monkeypatch, e)
        got, got_reasons, _ = run(e, reqs)
        assert got == want and got_reasons == reasons, (drafter, graphs)
    with pytest.raises(ValueError, match="min_tokens"):
        greedy(4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens"):
        greedy(8, min_tokens=2, json_schema='{"type": "object"}')


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_penalties_and_bias_in_every_path(models):  # noqa: F811
    """On CUDA (bf16, CUDA graphs): penalized and biased greedy requests give the same tokens
    decoded plainly, 4 steps at a time on the device, and with the MTP head's checks."""
    ps = prompts(2, seed=6)
    reqs = [("a", ps[0], greedy(20, ignore_eos=True, **PEN, logit_bias=BIAS)),
            ("b", ps[1], greedy(20, ignore_eos=True, frequency_penalty=1.0))]
    want, _, _ = run(engine(models, device="cuda"), reqs)
    for drafter, kw in ((None, dict(decode_steps=4)), ("mtp", dict(num_speculative_tokens=2))):
        e = engine(models, drafter, device="cuda", **kw)
        got, _, _ = run(e, reqs)
        assert got == want, drafter


def test_triton_inputs_and_checkpoint_defaults(tmp_path):
    """volundr_llm's inputs (llm_inputs, what model.py runs per request): the penalties and
    logit_bias reach SamplingParams; generation_config.json's repetition_penalty is the default
    (with do_sample false too), a request's own value wins; bad values are clear errors."""
    import json

    import numpy as np

    from volundr.serve.llm_inputs import generation_defaults, parse_llm_request

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.1}))
    d = generation_defaults(tmp_path)
    assert d == {"temperature": 0.0, "repetition_penalty": 1.1}

    def get(**fields):
        arrays = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32)}
        for k, v in fields.items():
            arrays[k] = (np.array([v.encode()], dtype=object) if isinstance(v, str)
                         else np.array([v], dtype=np.float32))
        return arrays.get

    p = parse_llm_request(get(), 64, d).params
    assert p.repetition_penalty == pytest.approx(1.1) and p.greedy and not p.logit_bias
    p = parse_llm_request(get(presence_penalty=0.5, frequency_penalty=-1.0,
                              repetition_penalty=1.0, logit_bias='{"4": -100, "9": 2.5}'),
                          64, d).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.0)
    assert p.logit_bias == ((4, -100.0), (9, 2.5))
    for fields, needle in ((dict(frequency_penalty=3.0), "frequency_penalty must be in"),
                           (dict(logit_bias='{"4": 500}'), "logit_bias takes"),
                           (dict(logit_bias="[4]"), "logit_bias must be a JSON object")):
        with pytest.raises(ValueError, match=needle):
            parse_llm_request(get(**fields), 64, d)


@pytest.mark.parametrize("drafter", [None, "self", "mtp", "mtp-graphs"])
def test_logprobs_are_the_model_log_softmax(models, drafter, monkeypatch):  # noqa: F811
    """logprobs=k: each new token's log-probability under the model's raw logits (the
    independent reference's log-softmax after the tokens before it, penalties not applied)
    and the k most likely tokens', sorted; 0: the token's alone; the requests speculate (a
    drafter, the MTP head: each kept token's row of the check; its one-replay greedy steps,
    several a read back, through the graphs' paths on the CPU, eager_graphs) or, without
    one, take multi-step
    decode (4 tokens a step, the values read back with them), and give the tokens they give
    without logprobs."""
    from test_speculative_mtp import eager_graphs

    cfg, sd = models["cfg"], models["sd"]
    prompt = prompts(1, seed=3)[0][:9]
    e = engine(models, drafter and drafter[:3] if drafter == "mtp-graphs" else drafter,
               decode_steps=4)
    fused = []
    if drafter == "mtp-graphs":
        eager_graphs(monkeypatch, e)
        real = e.runner.check_greedy_mtp
        e.runner.check_greedy_mtp = lambda *a: fused.append(real(*a)) or fused[-1]
    pen = {} if drafter == "mtp-graphs" else PEN  # (the one replay: greedy and plain)
    reqs = [("k", prompt, greedy(12, ignore_eos=True, logprobs=3, **pen)),
            ("z", prompt, SamplingParams(max_tokens=5, temperature=0.9, seed=4, logprobs=0,
                                         ignore_eos=True))]
    lps: dict[str, list] = {r: [] for r, *_ in reqs}
    for rid, p, sp in reqs:
        e.add_request(p, sp, rid)
    ids = {r: [] for r, *_ in reqs}
    most = 0  # tokens a request got from one step
    while e.has_unfinished():
        for o in e.step():
            ids[o.request_id] += o.new_token_ids
            assert o.new_logprobs is not None and len(o.new_logprobs) == len(o.new_token_ids)
            lps[o.request_id] += o.new_logprobs
            most = max(most, len(o.new_token_ids))
    st = e.stats()  # (the self-drafter's guesses are kept at times; the random head's not)
    if drafter is None:
        assert most == 4 and not st["spec_seqs"]  # multi-step decode
    elif drafter == "mtp-graphs":  # (the greedy request's steps alone: the one replay, and
        # runs of steps with their rows' logprobs recorded on the device)
        assert st["spec_seqs"] and any(f is not None and len(f) > 1 for f in fused)
    else:
        assert st["spec_tokens"] > st["spec_seqs"] > 0 if drafter == "self" else st["spec_seqs"]
    plain, _, _ = run(engine(models), [(r, p, SamplingParams(**{
        **{f: getattr(sp, f) for f in sp.__dataclass_fields__}, "logprobs": None}))
        for r, p, sp in reqs])
    assert ids == plain
    for rid, p, sp in reqs:
        ref = torch.log_softmax(reference_logits(cfg, sd, p + ids[rid]).double(), -1)
        for t, (tok, (lp, top)) in enumerate(zip(ids[rid], lps[rid])):
            row = ref[len(p) + t - 1]
            assert abs(lp - row[tok].item()) < 1e-4, (rid, t)
            assert len(top) == sp.logprobs
            want = row.topk(sp.logprobs)
            assert [i for i, _ in top] == want.indices.tolist()
            assert all(abs(a - b) < 1e-4 for (_, a), b in zip(top, want.values.tolist()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logprobs_and_min_tokens_in_every_path(models):  # noqa: F811
    """On CUDA (bf16, CUDA graphs): greedy logprobs from plain decode, multi-step decode (4
    tokens a step, the values left on the device) and the MTP head's one-replay greedy step
    (the check graph's logits rows) are each the float reference's log-softmax within bf16's
    error, their first top entry the token itself; min_tokens holds the stop ids back the same
    in every path."""
    cfg, sd = models["cfg"], models["sd"]
    p = prompts(1, seed=3)[0][:9]
    lp_reqs = [("k", p, greedy(12, ignore_eos=True, logprobs=3))]
    mt_reqs = [("e", p, greedy(20, min_tokens=5, logit_bias={EOS[0]: 100}))]
    want_mt, reasons, _ = run(engine(models, device="cuda"), mt_reqs)
    assert reasons == {"e": "stop"} and len(want_mt["e"]) == 5
    for drafter, kw in ((None, {}), (None, dict(decode_steps=4)),
                        ("mtp", dict(num_speculative_tokens=2))):
        e = engine(models, drafter, device="cuda", **kw)
        fused, real = [], e.runner.check_greedy_mtp
        e.runner.check_greedy_mtp = (
            lambda *a, fused=fused, real=real: fused.append(real(*a)) or fused[-1])
        e.add_request(p, lp_reqs[0][2], "k")
        ids, lps, most = [], [], 0
        while e.has_unfinished():
            for o in e.step():
                assert o.new_logprobs is not None and len(o.new_logprobs) == len(o.new_token_ids)
                ids += o.new_token_ids
                lps += o.new_logprobs
                most = max(most, len(o.new_token_ids))
        assert len(ids) == 12
        if kw.get("decode_steps"):
            assert most == 4
        if drafter:
            assert fused and all(f is not None for f in fused), "the one replay was not taken"
        ref = torch.log_softmax(reference_logits(cfg, sd, p + ids).double(), -1)
        for t, (tok, (lp, top)) in enumerate(zip(ids, lps)):
            assert abs(lp - ref[len(p) + t - 1][tok].item()) < 0.1, (drafter, kw, t)
            assert len(top) == 3 and top[0][0] == tok and abs(top[0][1] - lp) < 1e-6
            assert top[0][1] >= top[1][1] >= top[2][1]
        got, got_reasons, _ = run(engine(models, drafter, device="cuda", **kw), mt_reqs)
        assert got == want_mt and got_reasons == reasons, (drafter, kw)
