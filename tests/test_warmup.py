"""volundr.warmup on the CPU: the start-up steps run the compositions a server meets first (a
prompt alone, a burst beside a decode, a long prompt in chunks over a cached prefix) and leave
the engine as a fresh one: the same replies, every block and slot free."""

from __future__ import annotations

import pytest
from test_engine import make_engine, prompts, run_all, tiny  # noqa: F401 (the fixture)

from volundr.sampling_params import SamplingParams
from volundr.warmup import warm_up


def test_warm_up_runs_a_servers_first_steps_and_leaves_the_engine_fresh(tiny):  # noqa: F811
    kw = dict(max_num_seqs=6, max_num_batched_tokens=64, decode_steps=3)
    warm, fresh = make_engine(tiny, **kw), make_engine(tiny, **kw)
    report = warm_up(warm)
    steps = report.steps
    assert steps and report.seconds > 0 and "warm-up:" in report.summary()
    assert steps[0].prefill_seqs == 1 and steps[0].decode_seqs == 0  # a prompt alone
    # the burst: prompts beside its first request's decode (64 tokens a step: over several
    # steps here); later all six decode together
    assert any(s.decode_seqs >= 1 and s.prefill_seqs >= 2 for s in steps)
    assert any(s.decode_seqs == kw["max_num_seqs"] and not s.prefill_seqs for s in steps)
    # the long prompt (64 + 32 + 3 tokens) in two chunks beside the short one's decode
    chunks = [s for s in steps if s.decode_seqs == 1 and s.prefill_seqs == 1][:2]
    assert [s.prefill_tokens for s in chunks] == [63, 36]
    # what each sequence had computed before the step: the decode's context, then the prompt's
    # cached prefix (none for the first chunk, the first chunk's 63 tokens for the second)
    assert [c.cached[1] for c in chunks] == [0, 63] and all(c.cached[0] > 0 for c in chunks)
    # (the CPU runs PyTorch's ops: no Triton kernel to specialise)
    assert report.kernels == 0 and "Triton specialised 0 kernels" in report.summary()
    stats = warm.stats()
    assert stats == fresh.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert not warm.requests and not warm.has_unfinished()

    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    reqs = [(f"r{i}", p, greedy if i % 2 else seeded) for i, p in enumerate(prompts(5, 3))]
    assert run_all(warm, reqs, [0, 0, 1, 2, 2]) == run_all(fresh, reqs, [0, 0, 1, 2, 2])


def test_warm_up_refuses_a_busy_engine(tiny):  # noqa: F811
    e = make_engine(tiny)
    e.add_request([5, 6, 7], SamplingParams(max_tokens=2), "busy")
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(e)
