"""The engine thread of volundr_llm (EngineLoop) with the real tiny model, outside Triton."""

from __future__ import annotations

import queue
import threading

import pytest

from volundr.sampling_params import SamplingParams
from volundr.serve.detok import text_delta
from volundr.serve.triton_llm import Chunk, EngineLoop


class CollectingSink:
    """What volundr_llm's response sender does, recorded; `cancel_after` chunks it reports the
    request cancelled (as a client that went away)."""

    def __init__(self, cancel_after: int | None = None):
        self.chunks: list[Chunk] = []
        self.errors: list[str] = []
        self.done = threading.Event()
        self.cancel_after = cancel_after
        self.finals = 0

    def send(self, chunk: Chunk, final: bool) -> None:
        self.chunks.append(chunk)
        if final:
            self.finals += 1
            self.done.set()

    def error(self, message: str) -> None:
        self.errors.append(message)
        self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.chunks) >= self.cancel_after

    def text(self, tok) -> str:
        return "".join(text_delta(tok, c.prefix_ids, c.output_ids)[:len(text_delta(
            tok, c.prefix_ids, c.output_ids)) - c.trim_chars] for c in self.chunks)


PROMPT = "Hello there, how are you?"


@pytest.fixture(scope="module", params=[1, 4], ids=["decode_steps1", "decode_steps4"])
def llm(tiny_dir, request):
    """decode_steps 4: greedy decodes come out of the engine 4 tokens at a time (the GPU
    profiles' setting); streaming, stop strings, cancel and abort must not notice."""
    from volundr.llm import LLM

    return LLM(tiny_dir, device="cpu", max_num_seqs=4, max_num_batched_tokens=128,
               max_model_len=512, decode_steps=request.param)


@pytest.fixture(scope="module")
def offline(llm) -> list[int]:
    """Greedy ids of PROMPT from the offline API, before the loop owns the engine."""
    return llm.generate([PROMPT], greedy(12))[0]["token_ids"]


@pytest.fixture(scope="module")
def loop(llm, offline):
    lp = EngineLoop(llm).start()
    yield lp
    lp.shutdown()


def stats(lp: EngineLoop) -> dict:
    q: queue.Queue = queue.Queue()
    lp.stats(q.put)
    return q.get(timeout=30)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_streamed_equals_offline_generate(loop, offline):
    tok = loop.llm.tokenizer
    prompt = tok.encode(PROMPT, add_special_tokens=False).ids
    expected = offline
    a, b = CollectingSink(), CollectingSink()
    loop.submit("a", prompt, greedy(12), (), True, a)
    loop.submit("b", prompt, greedy(12), (), False, b)
    assert a.done.wait(60) and b.done.wait(60)
    assert [i for c in a.chunks for i in c.output_ids] == expected
    assert len(b.chunks) == 1 and b.chunks[0].output_ids == expected
    assert a.text(tok) == b.text(tok) == tok.decode(expected, skip_special_tokens=False)
    assert a.chunks[-1].finish_reason == "length" and a.finals == 1
    assert a.chunks[-1].num_output_tokens == 12 and a.chunks[-1].num_input_tokens == len(prompt)


def test_stop_string_ends_early_and_frees(loop):
    tok = loop.llm.tokenizer
    prompt = tok.encode("Once upon a time", add_special_tokens=False).ids
    full = CollectingSink()
    loop.submit("full", prompt, greedy(16), (), True, full)
    assert full.done.wait(60)
    text = full.text(tok)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    s = CollectingSink()
    loop.submit("stop", prompt, greedy(16), (stop,), True, s)
    assert s.done.wait(60)
    assert s.chunks[-1].finish_reason == "stop"
    assert s.text(tok) == text[:text.index(stop)]
    st = stats(loop)
    assert st["running"] == 0 and st["num_blocks_free"] == st["num_blocks_total"]


def test_cancel_aborts_and_frees(loop):
    tok = loop.llm.tokenizer
    prompt = tok.encode("Tell me a long story", add_special_tokens=False).ids
    s = CollectingSink(cancel_after=2)
    loop.submit("c", prompt, greedy(400), (), True, s)
    assert s.done.wait(60)
    assert s.chunks[-1].finish_reason == "abort" and s.finals == 1
    assert s.chunks[-1].num_output_tokens < 400
    st = stats(loop)
    assert st["running"] == 0 and st["active_requests"] == 0
    assert st["num_blocks_free"] == st["num_blocks_total"]
    assert st["num_slots_free"] == st["num_slots_total"]


def test_abort_by_triton_id_and_tombstone(loop):
    tok = loop.llm.tokenizer
    prompt = tok.encode("abc", add_special_tokens=False).ids
    s = CollectingSink()
    loop.submit("req-1", prompt, greedy(400), (), True, s)
    q: queue.Queue = queue.Queue()
    loop.abort("req-1", q.put)
    after = q.get(timeout=30)
    assert s.done.wait(30) and s.chunks[-1].finish_reason == "abort"
    assert after["aborted"] == 1 and after["running"] == 0
    # An abort that arrives before its request (client gone during preprocessing).
    loop.abort("req-2", q.put)
    assert q.get(timeout=30)["aborted"] == 0
    late = CollectingSink()
    loop.submit("req-2", prompt, greedy(400), (), True, late)
    assert late.done.wait(30) and late.chunks[-1].finish_reason == "abort"
    assert late.chunks[-1].num_output_tokens == 0


def test_bad_request_is_an_error_and_the_loop_keeps_serving(loop):
    s = CollectingSink()
    loop.submit("long", list(range(20, 600)), greedy(4), (), True, s)
    assert s.done.wait(30) and s.errors and s.errors[0].startswith("prompt too long")
    ok = CollectingSink()
    loop.submit("ok", [20, 21, 22], greedy(3), (), True, ok)
    assert ok.done.wait(60) and ok.chunks[-1].finish_reason == "length"


def test_grammars_compile_on_the_submitting_thread(llm, loop, monkeypatch):
    """A structured request's grammar is compiled by submit (Triton's execute thread), not by
    the engine's thread, which would stall every running stream meanwhile; one that does not
    compile is an error there and the loop keeps serving."""
    import json

    grammars = llm.engine.grammars
    threads: list[str] = []
    compile_ = grammars.matcher

    def matcher(params):
        threads.append(threading.current_thread().name)
        return compile_(params)

    monkeypatch.setattr(grammars, "matcher", matcher)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    s = CollectingSink()
    loop.submit("json", [20, 21, 22], SamplingParams(max_tokens=40, temperature=0.0,
                                                     json_schema=json.dumps(schema)),
                (), False, s)
    assert s.done.wait(60) and not s.errors
    assert threads == [threading.current_thread().name] and "volundr-engine" not in threads
    text = llm.tokenizer.decode([t for c in s.chunks for t in c.output_ids])
    if s.chunks[-1].finish_reason == "stop":  # (a random model may run out of tokens first)
        assert isinstance(json.loads(text)["n"], int)
    bad = CollectingSink()
    loop.submit("bad", [20, 21, 22], SamplingParams(max_tokens=4, grammar="start: ("), (),
                False, bad)
    assert bad.done.is_set() and bad.errors[0].startswith("invalid request: grammar cannot")
    ok = CollectingSink()
    loop.submit("ok2", [20, 21, 22], greedy(3), (), True, ok)
    assert ok.done.wait(60) and ok.chunks[-1].finish_reason == "length"


def test_backpressure_refuses_past_the_in_flight_limit(llm, loop):
    """A second loop on the same (idle) engine, limited to 2 requests in flight."""
    loop.shutdown()  # one thread owns the engine at a time
    lp = EngineLoop(llm, max_in_flight=2).start()
    try:
        prompt = llm.tokenizer.encode(PROMPT, add_special_tokens=False).ids
        sinks = [CollectingSink() for _ in range(3)]
        for i, s in enumerate(sinks):
            lp.submit(f"bp-{i}", prompt, greedy(40), (), True, s)
        for s in sinks:
            assert s.done.wait(120)
        assert sinks[2].errors and "server busy" in sinks[2].errors[0]
        assert not sinks[0].errors and not sinks[1].errors
        assert stats(lp)["num_slots_free"] == stats(lp)["num_slots_total"]
        later = CollectingSink()  # the limit frees up as requests finish
        lp.submit("bp-later", prompt, greedy(4), (), True, later)
        assert later.done.wait(60) and not later.errors
    finally:
        lp.shutdown()


def test_slow_steps_are_logged_with_what_they_ran(llm, loop, monkeypatch, caplog):
    """Every step counts as slow here (slow_step_s 0): the warning says how many requests began
    generating with their prompt tokens, and how long Python's cycle collector ran in the step
    (a collection forced inside one); the loop's collector clock leaves gc.callbacks with it."""
    import gc
    import logging
    import re

    loop.shutdown()
    lp = EngineLoop(llm, slow_step_s=0.0).start()
    step, forced = llm.step, []

    def collecting_step():
        if not forced:
            forced.append(gc.collect())
        return step()

    monkeypatch.setattr(llm, "step", collecting_step)
    try:
        prompt = llm.tokenizer.encode(PROMPT, add_special_tokens=False).ids
        with caplog.at_level(logging.WARNING, logger="volundr.serve"):
            sinks = [CollectingSink() for _ in range(2)]
            for i, s in enumerate(sinks):
                lp.submit(f"slow-{i}", prompt, greedy(6), (), True, s)
            for s in sinks:
                assert s.done.wait(60) and not s.errors
    finally:
        lp.shutdown()
    assert lp._gc not in gc.callbacks
    found = [re.search(r"took ([\d.]+) s: (\d+) requests began generating \((\d+) prompt "
                       r"tokens\), (\d+) others got tokens, (\d+) tokens out, .* collector ran "
                       r"([\d.]+) s", r.getMessage()) for r in caplog.records]
    found = [m for m in found if m]
    assert found, [r.getMessage() for r in caplog.records]
    began = sum(int(m[2]) for m in found)
    assert began == 2 and sum(int(m[3]) for m in found) == 2 * len(prompt)
    assert sum(int(m[5]) for m in found) == 12  # every token of both, 6 each
    assert float(found[0][6]) > 0 and all(float(m[1]) >= float(m[6]) for m in found)


JIT_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_kernels_compile import _install_fake_driver
_install_fake_driver()
from triton import knobs
from volundr.kernels.norm.engine import rms_norm
from volundr.serve.clocks import JitClock

theirs = []
knobs.runtime.jit_cache_hook = lambda **kw: theirs.append(kw["fn"].name) or False
clock = JitClock()
assert clock.install()
w = torch.ones(256, dtype=torch.bfloat16)
counts = []
for rows in (16, 32, 5, 16):  # 16 and 32 share a specialisation; 5 rows (not % 16) do not
    rms_norm(torch.randn(rows, 256, dtype=torch.bfloat16), w, 1e-6)
    counts.append(clock.count)
clock.uninstall()
rms_norm(torch.randn(7, 256, dtype=torch.bfloat16), w, 1e-6, torch.randn(7, 256).bfloat16())
print(json.dumps({"counts": counts, "names": clock.names, "total": clock.total,
                  "after": clock.count, "theirs": theirs,
                  "restored": knobs.runtime.jit_post_compile_hook is None}))
"""


def test_jit_clock_counts_triton_specialisations():
    """volundr.serve.clocks.JitClock counts the kernels Triton specialises while it is installed,
    with their compile seconds (Triton's real compiler for sm_90 under test_kernels_compile's
    stand-in driver, in a subprocess): a new row count that is not a multiple of 16 makes one
    more, a repeated one none; hooks installed before it still see every specialisation, and
    uninstall hands theirs back. The engine loop logs each step that specialised kernels."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    p = subprocess.run([sys.executable, "-c", JIT_SCRIPT, str(tests)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["counts"] == [1, 1, 2, 2], r
    assert r["names"] == ["_rms_norm_kernel"] * 2 and r["total"] > 0
    assert r["after"] == 2  # (the residual variant compiled after uninstall: not counted)
    assert r["theirs"] == ["_rms_norm_kernel"] * 3 and r["restored"]


def test_steps_that_specialise_triton_kernels_are_logged(llm, loop, monkeypatch, caplog):
    """A step during which Triton specialised kernels (here: the JIT hooks called from inside
    the step as Triton's JITFunction calls them) is logged with their count, seconds and
    names; steps that specialise none are not."""
    import logging

    from triton import knobs

    loop.shutdown()
    lp = EngineLoop(llm).start()
    step, calls = llm.step, []

    def compiling_step():
        calls.append(1)
        if len(calls) == 2:
            info = type("Info", (), {"name": "_made_up_kernel"})()
            assert knobs.runtime.jit_cache_hook(fn=info) is False
            knobs.runtime.jit_post_compile_hook(fn=info)
        return step()

    monkeypatch.setattr(llm, "step", compiling_step)
    try:
        prompt = llm.tokenizer.encode(PROMPT, add_special_tokens=False).ids
        with caplog.at_level(logging.WARNING, logger="volundr.serve"):
            sink = CollectingSink()
            lp.submit("jit-0", prompt, greedy(9), (), True, sink)
            assert sink.done.wait(60) and not sink.errors
    finally:
        lp.shutdown()
    msgs = [r.getMessage() for r in caplog.records if "specialise" in r.getMessage()]
    assert len(calls) > 2 and len(msgs) == 1, msgs
    assert "specialise 1 kernels" in msgs[0] and msgs[0].endswith(": _made_up_kernel")
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
