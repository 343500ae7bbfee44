"""Where a speculative decode step's time goes: host wall time of each phase, synchronised.

    python3 perf/diag_speculative.py --variant mixed@8+draft --out $OUT/spec_phases.json
    python3 perf/diag_speculative.py --variant mixed@8+mtp      # the MTP head's drafts
    python3 perf/diag_speculative.py --variant mixed@8+mtp+eager   # its block not in graphs
    python3 perf/diag_speculative.py --variant mixed@8+mtp+right   # its guesses all right
    python3 perf/diag_speculative.py --variant mixed@8+mtp+right+host  # the host's calls
    python3 perf/diag_speculative.py --variant mixed@8+mtp+right+k2    # two guesses a step
    python3 perf/diag_speculative.py --variant mixed@8+mtp --kernels $OUT/k.txt  # + kernels
    python3 perf/diag_speculative.py --variant mixed@8+mtp+accept+k2 --trace $OUT/gaps.txt
        (each step's wall time against its GPU busy time, host lead / tail, idle gaps)
        (under PDL a kernel's time includes its early start's wait: VOLUNDR_PDL=0 for times
        that add up; the launch counts hold either way)
    python3 perf/diag_speculative.py --variant mixed@8+mtp+accept+k2+sampled  # temperature 0.8
    python3 perf/diag_speculative.py --variant mixed@8+mtp+accept+k2 --replays
        (no profiler: each graph replay in a step between CUDA events, against the same graph
        replayed back to back, and the host's time in replay())

Builds bench_decode's engine for the variant, decodes one request, and wraps the phases of
`volundr.speculative.speculate` (drafter catch-up, save, guesses, the model's check, its commit,
the drafter's restore; the MTP block where it drafts) with CUDA-synchronised timers; prints and
writes the mean ms per step of each, the engine steps' mean, and the replay time of the check
graph alone (GPU only).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import time
from collections import defaultdict

import torch
from bench_decode import build, graph_ms, replay_ms, sync
from bench_decode import decode_rate as bench_rate
from step_gaps import trace_steps

import volundr.speculative as spec


def _timed(totals: dict, name: str, fn):
    def wrapper(*a, **kw):
        sync()
        t = time.perf_counter()
        out = fn(*a, **kw)
        sync()
        totals[name].append(time.perf_counter() - t)
        return out
    return wrapper


def right_guesses(e, tokens: int) -> None:
    """Decodes decode_rate's request of `tokens` once (its greedy ids kept), then sets each
    sequence's MTP draft to the right one before every step (the id after its last token):
    the block still runs, its guesses are replaced."""
    ids: list[int] = []
    step = e.step

    def collect():
        outs = step()
        ids.extend(t for o in outs for t in o.new_token_ids)
        return outs

    e.step = collect
    bench_rate(e, 1, 128, tokens)

    def right():
        for s in e.requests.values():
            i = len(s.token_ids) - s.num_prompt_tokens
            if s.mtp_drafts:
                s.mtp_drafts = (ids[i:] + s.mtp_drafts)[:len(s.mtp_drafts)]
        return step()

    e.step = right


def replay_gaps(e, run) -> dict:
    """Each CUDA graph replay during run() timed on the GPU between events recorded just before
    and after it (a launch the GPU waits for counts: the stream has drained the work before),
    and on the host (the replay() call); per graph (in order of first replay): replays, GPU ms
    and host ms means, and the same graph's back-to-back replay ms (launches overlapped)."""
    real, recs = torch.cuda.CUDAGraph.replay, []

    def timed(g):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        real(g)
        recs.append((g, a, b, time.perf_counter() - t0))
        b.record()

    torch.cuda.CUDAGraph.replay = timed
    try:
        run()
    finally:
        torch.cuda.CUDAGraph.replay = real
    torch.cuda.synchronize()
    per: dict = {}
    for g, a, b, host in recs:
        per.setdefault(g, []).append((a.elapsed_time(b), 1e3 * host))
    return {f"graph{i}": {"replays": len(v), "gpu_ms": sum(x for x, _ in v) / len(v),
                          "host_ms": sum(h for _, h in v) / len(v),
                          "back_to_back_ms": replay_ms(g, 20)}
            for i, (g, v) in enumerate(per.items())}


def graph_kernels(graphs: dict[str, torch.cuda.CUDAGraph], path: str, reps: int = 5) -> dict:
    """Kernel times (torch.profiler, CUDA activity) of `reps` replays of each named graph, in
    us per replay by bench_decode.CATEGORIES, and each graph's top kernels to `path`: where a
    check's time over a decode step's goes. The replays reuse the graphs' last inputs (a check
    graph reads states and writes KV only: run it after the timed decodes)."""
    from bench_decode import CATEGORIES
    from torch.profiler import ProfilerActivity, profile

    out = {}
    with open(path, "w") as f:
        for name, g in graphs.items():
            g.replay()
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    g.replay()
                sync()
            cats: dict[str, float] = defaultdict(float)
            rows = []
            for ev in prof.key_averages():
                us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
                if us <= 0:
                    continue
                cat = next((c for c, rx in CATEGORIES if re.search(rx, ev.key, re.I)), "other")
                cats[cat] += us / reps
                rows.append((us / reps, ev.count / reps, cat, ev.key))
            rows.sort(reverse=True)
            f.write(f"# {name}: us per replay, launches per replay, kernel\n")
            for us, n, cat, key in rows[:40]:
                f.write(f"{us:10.1f} {n:7.2f} {cat:13s} {key[:140]}\n")
            out[name] = {"us": {c: round(v, 1) for c, v in sorted(cats.items())},
                         "total_us": round(sum(cats.values()), 1),
                         "launches": round(sum(r[1] for r in rows), 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="mixed@8+draft")
    ap.add_argument("--preset", default="volundr-32b")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernels", default=None,
                    help="a text file for the profiled kernels of the decode graph and the "
                    "smallest check graph (GPU only)")
    ap.add_argument("--trace", default=None,
                    help="a text file for a profiled decode of 24 tokens, per engine step: wall "
                    "time, GPU busy time, host lead / tail and idle gaps (step_gaps.py)")
    ap.add_argument("--replays", action="store_true",
                    help="time each graph replay of 24 tokens between CUDA events (replay_gaps)")
    args = ap.parse_args()
    base, *sfx = args.variant.split("+")
    variant, _, steps = base.partition("@")
    # with +mtp: +eager = the MTP block without its graphs; +right = its guesses replaced by the
    # right ones (plain greedy's ids from an untimed first run): the upper bound; +host = the
    # greedy step as the host's check / commit / mtp calls, not one replay with the acceptance
    # on the device (ModelRunner.check_greedy_mtp). +mtpeager, +mtpright: +mtp+eager, +mtp+right
    # +accept: every guess accepted whatever it is (greedy acceptance replaced; the tokens are
    # not the model's): a perfect head's step times, free of bf16 near-ties that make a first
    # run's ids drift from a second's (+right then keeps fewer)
    flags = {f for x in sfx for f in ("eager", "right", "host", "accept")
             if x in (f, "mtp" + f)}
    mtp = any(x[:3] == "mtp" for x in sfx)
    draft = "self" if "draftself" in sfx else "mtp" if mtp else "random"
    k = next((int(s[1:]) for s in sfx if s[:1] == "k" and s[1:].isdigit()), None)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e = build(variant, True, 1, args.preset, dev, None, int(steps or 1), 4096, 1, "auto",
              draft=draft, spec_k=k)
    if "eager" in flags:
        e.runner.mtp_graphs = None
    if "host" in flags:
        e.runner.check_greedy_mtp = lambda *a: None
    decode_rate = functools.partial(bench_rate, temperature=0.8 if "sampled" in sfx else 0.0)
    decode_rate(e, 1, 128, 8)  # warm-up (the drafter's prefill at the timed prompt's length too)
    if "right" in flags:
        right_guesses(e, args.tokens)
    if "accept" in flags:  # (the graphs' acceptance on the device, and the host's)
        if e.runner.checks is not None:
            e.runner.checks.accept_all = True
        spec.greedy_kept = lambda a, guesses: a[:len(guesses) + 1]
    before = e.stats()
    clean = decode_rate(e, 1, 128, args.tokens)  # no timers (their syncs cost)
    gaps = trace_steps(e, lambda: decode_rate(e, 1, 128, 24), args.trace) if args.trace \
        else None
    if args.replays and dev == "cuda":
        replays = replay_gaps(e, lambda: decode_rate(e, 1, 128, 24))
    spec_stats = {k: v - before[k] for k, v in e.stats().items() if k.startswith("spec_")}
    totals: dict[str, list[float]] = defaultdict(list)
    t_runner, d_runner = e.runner, e.drafter
    for obj, names in ((t_runner, ("check", "commit", "mtp", "check_greedy_mtp")),
                       (d_runner, ("check", "commit", "run_decode_steps", "save_states",
                                   "load_states", "run"))):
        if obj is None:  # the MTP head drafts: no drafter
            continue
        who = "model" if obj is t_runner else "drafter"
        for n in names:
            setattr(obj, n, _timed(totals, f"{who}.{n}", getattr(obj, n)))
    spec.catch_up = _timed(totals, "catch_up", spec.catch_up)
    step = e.step
    e.step = _timed(totals, "engine.step", step)
    rate = decode_rate(e, 1, 128, args.tokens)
    res = {"variant": args.variant, "device": torch.cuda.get_device_name() if dev == "cuda"
           else "cpu", "tok_per_s": rate["tok_per_s"], "steps": rate["steps"],
           "ms_mean": {n: 1e3 * sum(v) / len(v) for n, v in totals.items()},
           "calls": {n: len(v) for n, v in totals.items()},
           "untimed": {"tok_per_s": clean["tok_per_s"], "ms_per_step": clean["ms_per_step"],
                       **spec_stats}}
    if gaps is not None:
        res["step_gaps"] = gaps
    if args.replays and dev == "cuda":
        res["replays"] = replays
    for name in ("checks", "mtp_graphs"):
        g = getattr(t_runner, name, None)
        if g is not None and g.graphs:
            res[f"{name}_graph_ms"] = replay_ms(g.graphs[min(g.graphs)][0], 20)
            if g.graphs[min(g.graphs)][1] is not None:  # the commit after it (of all rows:
                # its last cu; the states it advances are garbage after, as is this engine)
                res[f"{name}_commit_graph_ms"] = replay_ms(g.graphs[min(g.graphs)][1], 20)
    res["decode_graph_ms"] = graph_ms(e, 1, 20)
    if args.kernels and dev == "cuda":
        named = {"decode": t_runner.graphs.graphs[1]}
        for name in ("checks", "mtp_graphs"):
            g = getattr(t_runner, name, None)
            if g is not None and g.graphs:
                named[name] = g.graphs[min(g.graphs)][0]
        res["kernels"] = graph_kernels(named, args.kernels)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    e.close()


if __name__ == "__main__":
    main()
