"""A server's first kinds of engine steps, run on made-up prompts before it takes requests.

Triton compiles a kernel variant the first time it meets a new specialisation: integer
arguments that are 1 or divisible by 16, and constexprs chosen from a step's shape (rows of a
prefill, sequences of a conv step, the GEMM tile for M > 128). CUDA-graph capture compiles the
decode step's kernels at start-up, but not the prefill's: a fresh server's first burst of
requests met steps that compiled 1-17 kernels of one layer each (perf/diag_specializations.py,
session 37), stalling every running stream for seconds (perf/RESULTS.md, runs 154/156). This
runs those compositions first, so the compiles (and the disk cache's loads) happen before the
server reports ready (H100 runs 157/158: bursts' first tokens within 0.59 s instead of stalls of
3.3-4.9 s; 53 s and 43 kernels with an empty Triton cache). Row counts that would make a variant
per count are bounded elsewhere (kernels/quant/engine.eager_rows pads eager 3-15-row matmuls to
the decode graphs' sizes). Bookkeeping only: it adds requests and steps the engine like any
caller.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field

from volundr.sampling_params import SamplingParams
from volundr.serve.clocks import JitClock

# prompt lengths of a burst: one token, a multiple of 16, odd ones (Triton specialises integer
# arguments on divisibility by 16 and on == 1)
BURST_LENGTHS = (77, 1, 128, 33, 16, 100, 5, 64)


@dataclass
class WarmStep:
    prefill: list[int]  # the prompt tokens (or chunk) the step ran of each prefilling sequence
    decode_seqs: int  # sequences that made a token from a computed prompt
    seconds: float
    # tokens each sequence had computed before the step: the decodes', then the prefills'
    cached: list[int] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(self.prefill)

    @property
    def prefill_seqs(self) -> int:
        return len(self.prefill)


@dataclass
class WarmUp:
    steps: list[WarmStep] = field(default_factory=list)
    kernels: int = 0  # Triton specialisations made during it (compiled or loaded from disk)
    kernel_s: float = 0.0  # their seconds

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def summary(self) -> str:
        if not self.steps:
            return "warm-up: no steps"
        slow = max(self.steps, key=lambda s: s.seconds)
        return (f"warm-up: {len(self.steps)} steps in {self.seconds:.1f} s (slowest "
                f"{slow.seconds:.2f} s: {slow.prefill_seqs} prompts of {slow.prefill_tokens} "
                f"tokens beside {slow.decode_seqs} decodes); Triton specialised {self.kernels} "
                f"kernels in {self.kernel_s:.1f} s of it")


def _step(engine, report: WarmUp) -> None:
    before = {rid: (s.num_computed_tokens, s.num_prompt_tokens)
              for rid, s in engine.requests.items()}
    t = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - t
    prefill, decodes, cached, cached_prefill = [], 0, [], []
    for rid, (done, prompt) in before.items():
        seq = engine.requests.get(rid)
        now = seq.num_computed_tokens if seq is not None else prompt
        if done >= prompt:
            decodes += 1
            cached.append(done)
        elif now > done:
            prefill.append(min(now, prompt) - done)
            cached_prefill.append(done)
    report.steps.append(WarmStep(prefill, decodes, seconds, cached + cached_prefill))


def warm_up(engine, seed: int = 0) -> WarmUp:
    """Runs, on an idle engine (LLMEngine), greedy requests of random tokens: prompts alone;
    prompts beside decodes in steps of 2, 4, 8, ... max_num_seqs sequences; one prompt, then
    max_num_seqs - 1 more of assorted lengths beside its decode (a burst);
    a prompt longer than a step's token budget beside a decode (chunked prefill over a cached
    prefix). Each makes enough tokens for multi-step decode (and speculation) to run. The engine
    is left as it was: every block and slot free, its speculative counters at zero."""
    if engine.has_unfinished() or engine.requests:
        raise RuntimeError("warm_up needs an idle engine")
    ecfg = engine.ecfg
    rng = random.Random(seed)
    out = min(2 * ecfg.decode_steps + 2, 64)
    cap = ecfg.max_model_len - out - 1  # a prompt's longest
    if cap < 1:
        return WarmUp()
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    report = WarmUp()
    clock = JitClock()
    clock.install()
    try:
        _run(engine, report, rng, params, cap)
    finally:
        clock.uninstall()
    report.kernels, report.kernel_s = clock.count, clock.total
    engine.spec_steps = engine.spec_seqs = engine.spec_tokens = engine.spec_stopped = 0
    return report


def _run(engine, report: WarmUp, rng: random.Random, params: SamplingParams, cap: int) -> None:
    ecfg = engine.ecfg
    names = itertools.count()

    def add(length: int) -> None:
        ids = [rng.randrange(16, engine.cfg.vocab_size) for _ in range(max(1, min(length, cap)))]
        engine.add_request(ids, params, f"warm-up-{next(names)}")

    def finish() -> None:
        while engine.has_unfinished():
            _step(engine, report)

    lengths = itertools.cycle(BURST_LENGTHS)
    # a prompt alone: a multiple of 16, odd rows in (16, 64] (quant_matmul's split count follows
    # M's 64-row tiles), and short ones whose matmuls run as 8, 4 and 2 rows (eager_rows: with
    # one sequence, as on the 16gb profile, no graph of those sizes compiled them)
    for length in (128, 29, 7, 3, 2):
        add(length)
        finish()
    # prompts beside decodes in steps of 2, 4, 8, ... sequences (kernels size blocks by the
    # step's sequences rounded up to a power of two: one variant each)
    add(next(lengths))
    _step(engine, report)
    n = 1
    while n < ecfg.max_num_seqs:
        k = min(n, ecfg.max_num_seqs - n)
        for _ in range(k):
            add(next(lengths))
        _step(engine, report)
        n += k
    finish()
    add(BURST_LENGTHS[0])  # a burst: its first request admitted alone, the rest a step later
    _step(engine, report)
    for _ in range(1, ecfg.max_num_seqs):
        add(next(lengths))
    finish()
    if ecfg.max_num_batched_tokens < cap:  # a long prompt: chunks, the later over a prefix
        add(16)
        _step(engine, report)
        add(ecfg.max_num_batched_tokens + ecfg.max_num_batched_tokens // 2 + 3)
        finish()
