"""Sessions (volundr.session): a finished request's state parked in host memory and resumed by
the session's next turn, on the tiny Volundr (random weights): the resumed turn equals the same
prompt run from scratch, runs only its new tokens, and the parked session holds no blocks or
slot; prompts that diverge, a stop inside a multi-step decode run, and the store's byte
cap."""

from __future__ import annotations

import pytest
import torch

from volundr.converter.presets import get_config, random_state_dict
from volundr.engine import EngineConfig, LLMEngine
from volundr.sampling_params import SamplingParams
from volundr.session import ParkedSession, Resume, SessionStore

EOS = (2, 0)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("tiny", vocab_size=512, eos_token_id=EOS)
    return cfg, random_state_dict(cfg, "cpu", dtype=torch.float32, seed=3)


def make_engine(tiny, device="cpu", **kw) -> LLMEngine:
    cfg, sd = tiny
    args = dict(device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16,
                max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=80)
    args.update(kw)
    return LLMEngine(cfg, {n: t.to(device) for n, t in sd.items()}, EngineConfig(**args), EOS)


class _Count:
    """Wraps runner.run: counts the prompt tokens each request ran through the model."""

    def __init__(self, engine: LLMEngine):
        self.run, self.tokens = engine.runner.run, {}
        engine.runner.run = self

    def __call__(self, batch):
        for item in batch:
            s = item.seq
            n = max(0, min(item.num_new_tokens, s.num_prompt_tokens - s.num_computed_tokens))
            self.tokens[s.request_id] = self.tokens.get(s.request_id, 0) + n
        return self.run(batch)


def run(engine: LLMEngine, reqs) -> dict[str, tuple[list[int], int]]:
    """reqs [(id, prompt, params, session)] added together; id -> (ids, num_cached_tokens)."""
    out = {rid: ([], 0) for rid, *_ in reqs}
    for rid, prompt, params, session in reqs:
        engine.add_request(prompt, params, rid, session_id=session)
    while engine.has_unfinished():
        for o in engine.step():
            ids, _ = out[o.request_id]
            out[o.request_id] = (ids + o.new_token_ids, o.num_cached_tokens)
    return out


def test_store_take_put_evict():
    forgotten: list[int] = []
    store = SessionStore(100, forgotten.append)
    tickets = iter(range(100))

    def parked(tokens, nbytes, **kw):
        return ParkedSession(tokens, next(tickets), nbytes, **kw)

    store.put("a", parked([1, 2, 3], 40))  # ticket 0
    store.put("b", parked([7], 40))  # 1
    assert store.take("a", [1, 2, 3]) is None  # nothing new to run: not resumable, dropped
    assert "a" not in store and store.num_mismatched == 1 and forgotten == [0]
    store.put("a", parked([1, 2, 3], 40))  # 2
    assert store.take("a", [1, 2, 4, 5]) is None and "a" not in store  # diverged: dropped
    store.put("a", parked([1, 2, 3], 40))  # 3
    got = store.take("a", [1, 2, 3, 9])
    assert got == Resume(3, 3, False) and "a" not in store
    assert forgotten == [0, 2]  # a taken state is the request's: not forgotten here
    assert store.num_resumed == 1 and store.nbytes == 40  # b stays
    store.put("c", parked([5], 40))  # 4
    store.put("d", parked([6], 40))  # 5; 120 > 100: the oldest (b) goes
    assert "b" not in store and "c" in store and "d" in store and forgotten[-1] == 1
    assert store.num_evicted == 1 and store.nbytes == 80
    store.put("e", parked([8], 101))  # 6: larger than the store, forgotten at once
    assert "e" not in store and store.nbytes == 80 and forgotten[-1] == 6
    store.put("c", parked([5, 6], 10))  # 7 replaces c's state (4)
    assert store.nbytes == 50 and len(store) == 2 and forgotten[-1] == 4
    assert store.drop("d") and forgotten[-1] == 5 and not store.drop("d")
    with pytest.raises(ValueError):
        SessionStore(-1)
    # the state at the end of the turn's prompt, for a prompt that diverges inside the reply
    store.put("p", parked(list(range(10)), 30, prompt_len=5))  # 8
    assert store.take("p", [0, 1, 2, 3, 4, 99, 98]) == Resume(8, 5, True)
    store.put("p", parked(list(range(10)), 30, prompt_len=5))  # 9
    assert store.take("p", [0, 1, 2, 3, 9]) is None and forgotten[-1] == 9
    store.put("p", parked(list(range(10)), 30, prompt_len=5))  # 10
    assert store.take("p", list(range(12))) == Resume(10, 10, False)  # the whole turn
    # input embedding digests must agree over the resumed positions
    store.put("q", parked([1, 2, 3], 30, embeds={1: "x"}))  # 11
    assert store.take("q", [1, 2, 3, 4], {1: "y"}) is None
    store.put("q", parked([1, 2, 3], 30, embeds={1: "x"}))  # 12
    assert store.take("q", [1, 2, 3, 4], {1: "x", 3: "z"}) == Resume(12, 3, False)


def _turns(engine: LLMEngine, first: list[int], extra: list[int]):
    """Turn 1 of session s, then turn 2 = turn 1's prompt + output + extra."""
    (ids1, cached1), = run(engine, [("t1", first, GREEDY, "s")]).values()
    st = engine.stats()
    assert cached1 == 0 and st["sessions_parked"] == 1
    # parked: no GPU blocks, no state slot held
    assert st["num_blocks_free"] == st["num_blocks_total"]
    assert st["num_slots_free"] == st["num_slots_total"]
    second = first + ids1 + extra
    return second, run(engine, [("t2", second, GREEDY, "s")])["t2"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_resumed_turn_equals_a_fresh_run_and_runs_only_new_tokens(tiny, device):
    first, extra = list(range(5, 45)), [11, 12, 13, 14, 15]
    engine = make_engine(tiny, device)
    count = _Count(engine)
    second, (ids2, cached2) = _turns(engine, first, extra)
    # the state covers turn 1's prompt and every output token but the last (never fed)
    assert cached2 == len(first) + GREEDY.max_tokens - 1
    assert count.tokens["t2"] == len(second) - cached2
    assert count.tokens["t1"] == len(first)
    fresh = run(make_engine(tiny, device), [("f", second, GREEDY, None)])["f"][0]
    assert ids2 == fresh and len(ids2) == GREEDY.max_tokens
    assert engine.stats()["sessions_resumed"] == 1
    assert engine.stats()["sessions_parked"] == 1  # turn 2 parked in its place
    # the runner holds exactly the parked copies: turn 1's went back into the slot
    assert len(engine.runner.parked) == 1 and not engine.runner.snaps


def test_resume_beside_other_requests_and_chunked(tiny):
    """A resumed prefill longer than a step's token budget, batched with a fresh request and a
    decoding one: every output equals its run alone."""
    first, extra = list(range(3, 90)), list(range(100, 190))  # 90 new tokens > 64 per step
    engine = make_engine(tiny)
    (ids1, _), = run(engine, [("t1", first, GREEDY, "s")]).values()
    second, other = first + ids1 + extra, list(range(200, 230))
    out = run(engine, [("t2", second, GREEDY, "s"), ("o", other, GREEDY, None)])
    assert out["t2"][1] == len(first) + GREEDY.max_tokens - 1
    alone = make_engine(tiny)
    assert out["t2"][0] == run(alone, [("a", second, GREEDY, None)])["a"][0]
    assert out["o"][0] == run(alone, [("b", other, GREEDY, None)])["b"][0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_reply_sent_back_changed_resumes_from_the_prompt_end(tiny, device):
    """Turn 2's history carries turn 1's prompt but not its reply token for token (a client
    drops the reasoning, or the text re-tokenizes differently): the state parked at the end of
    turn 1's prompt serves it."""
    first = list(range(5, 45))
    engine = make_engine(tiny, device)
    count = _Count(engine)
    (ids1, _), = run(engine, [("t1", first, GREEDY, "s")]).values()
    second = first + [7, 8, 9] + ids1[3:] + [11, 12]  # the reply's start differs
    ids2, cached = run(engine, [("t2", second, GREEDY, "s")])["t2"]
    assert cached == len(first) and count.tokens["t2"] == len(second) - len(first)
    assert ids2 == run(make_engine(tiny, device), [("f", second, GREEDY, None)])["f"][0]
    # turn 2 parked again; a turn 3 that keeps turn 2's reply resumes from its end
    third = second + ids2 + [13]
    ids3, cached = run(engine, [("t3", third, GREEDY, "s")])["t3"]
    assert cached == len(second) + GREEDY.max_tokens - 1
    assert ids3 == run(make_engine(tiny, device), [("g", third, GREEDY, None)])["g"][0]


def test_input_embeds_must_match_to_resume(tiny):
    """Image-style input embeddings (every patch shares one placeholder id): a turn resumes only
    if the embeddings at the parked positions are the same vectors."""
    cfg, _ = tiny
    first = list(range(5, 15)) + [11] * 6 + [5, 6, 7]  # placeholders at 10..15
    img = {p: torch.randn(cfg.hidden_size) for p in range(10, 16)}
    other = {p: torch.randn(cfg.hidden_size) for p in range(10, 16)}

    def turn(engine, ids, embeds, session):
        engine.add_request(ids, GREEDY, "r", input_embeds=embeds, session_id=session)
        out, cached = [], 0
        while engine.has_unfinished():
            for o in engine.step():
                out, cached = out + o.new_token_ids, o.num_cached_tokens
        return out, cached

    for embeds, want_cached in ((img, True), (other, False)):
        engine = make_engine(tiny)
        ids1, _ = turn(engine, first, img, "s")
        second = first + ids1 + [40, 41]
        ids2, cached = turn(engine, second, embeds, "s")
        assert (cached == len(first) + GREEDY.max_tokens - 1) if want_cached else cached == 0
        assert ids2 == turn(make_engine(tiny), second, embeds, None)[0]


def test_diverging_prompt_runs_from_scratch(tiny):
    engine = make_engine(tiny)
    run(engine, [("t1", list(range(5, 25)), GREEDY, "s")])
    other = list(range(6, 40))  # not an extension of turn 1
    ids, cached = run(engine, [("t2", other, GREEDY, "s")])["t2"]
    assert cached == 0 and engine.stats()["sessions_mismatched"] == 1
    assert ids == run(make_engine(tiny), [("f", other, GREEDY, None)])["f"][0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_multi_step_decode_parks_the_state_at_its_stop(tiny, device):
    """decode_steps 4: a request that samples its stop token inside a run of 4 steps: its later
    steps go to the scratch slot (ModelRunner.run_decode_steps' stop_ids), so its own slot holds
    the state of exactly the tokens before the stop, and the next turn resumes from it."""
    prompt = list(range(5, 30))
    ref = run(make_engine(tiny, device), [("r", prompt, GREEDY, None)])["r"][0]
    # steps: the prefill samples ref[0], then a run of 4 samples ref[1:5]: ref[2] stops it
    assert ref[2] not in ref[:2]
    engine = make_engine(tiny, device, decode_steps=4)
    mid = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                         stop_token_ids=(ref[2],))
    ids, _ = run(engine, [("a", prompt, mid, "mid")])["a"]
    assert ids == ref[:2] and "mid" in engine.sessions
    second = prompt + ref[:3] + [40, 41]  # the stop token comes back in the history
    ids, cached = run(engine, [("c", second, GREEDY, "mid")])["c"]
    assert cached == len(prompt) + 2
    fresh = run(make_engine(tiny, device), [("f", second, GREEDY, None)])["f"][0]
    assert ids == fresh
    # and a stop on a run's last step (max_tokens 5: ref[4]) parks as well
    end = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    run(engine, [("b", prompt, end, "end")])
    second = prompt + ref[:5] + [40, 41]
    ids, cached = run(engine, [("d", second, GREEDY, "end")])["d"]
    assert cached == len(prompt) + 4
    assert ids == run(make_engine(tiny, device), [("g", second, GREEDY, None)])["g"][0]


def test_store_cap_aborts_and_no_session(tiny):
    engine = make_engine(tiny, session_gib=1e-6)  # ~1 KiB: no tiny state fits
    run(engine, [("t1", list(range(5, 25)), GREEDY, "s")])
    assert len(engine.sessions) == 0
    engine = make_engine(tiny, session_gib=0)
    run(engine, [("t1", list(range(5, 25)), GREEDY, "s")])
    assert len(engine.sessions) == 0
    engine = make_engine(tiny)
    engine.add_request(list(range(5, 25)), GREEDY, "t1", session_id="s")
    engine.step()
    engine.abort("t1")  # an aborted request is not parked, its prompt's state let go
    run(engine, [("t2", list(range(5, 25)), GREEDY, None)])  # no session id: not parked
    assert len(engine.sessions) == 0 and not engine.runner.parked and not engine.runner.snaps
    # a request that took a parked state and is aborted before it ran lets it go too
    run(engine, [("t3", list(range(5, 25)), GREEDY, "s")])
    engine.add_request(list(range(5, 40)), GREEDY, "t4", session_id="s")
    assert len(engine.runner.parked) == 1 and len(engine.sessions) == 0  # t4 owns it
    engine.abort("t4")
    assert not engine.runner.parked and not engine.runner.snaps
    with pytest.raises(ValueError):
        make_engine(tiny, session_gib=-1)


def test_sessions_with_tensor_parallelism(tiny):
    """--tp 2 (gloo, two processes): every rank parks and restores its own shard; the resumed
    turns (whole turn, prompt's end) equal one device's fresh runs."""
    first, extra = list(range(5, 45)), [11, 12, 13]
    engine = make_engine(tiny, tensor_parallel_size=2)
    try:
        (ids1, _), = run(engine, [("t1", first, GREEDY, "s")]).values()
        second = first + ids1 + extra
        ids2, cached = run(engine, [("t2", second, GREEDY, "s")])["t2"]
        assert cached == len(first) + GREEDY.max_tokens - 1
        third = second + [7] + ids2[1:] + [9]  # turn 2's reply sent back changed
        ids3, cached = run(engine, [("t3", third, GREEDY, "s")])["t3"]
        assert cached == len(second)
    finally:
        engine.close()
    one = make_engine(tiny)
    assert ids2 == run(one, [("a", second, GREEDY, None)])["a"][0]
    assert ids3 == run(one, [("b", third, GREEDY, None)])["b"][0]


def test_volundr_llm_session_id_input_is_checked():
    """volundr_llm's session_id input (llm_inputs, what model.py runs on each request): one
    string of at most MAX_SESSION_ID_CHARS, else a clear 400-style error."""
    import numpy as np

    from volundr.serve.llm_inputs import parse_llm_request
    from volundr.session import MAX_SESSION_ID_CHARS

    def get_with(session):
        arrays = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32),
                  "session_id": np.array([s.encode() for s in session], dtype=object)}
        return arrays.get

    ok = "s" * MAX_SESSION_ID_CHARS
    assert parse_llm_request(get_with([ok]), 64).session_id == ok
    for bad in (["s" * (MAX_SESSION_ID_CHARS + 1)], ["a", "b"]):
        with pytest.raises(ValueError, match="session_id must be one string"):
            parse_llm_request(get_with(bad), 64)
