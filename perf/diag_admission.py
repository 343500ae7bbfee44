"""Engine step times while a burst of requests arrives (what bench_serving's N-stream waves do:
the first request of a burst admitted alone, the rest a step later, beside its decode).

    python3 perf/diag_admission.py --out $OUT/admission.json     # device (H100 / H200)
    .venv/bin/python perf/diag_admission.py --preset tiny --device cpu --out /tmp/adm.json

Builds bench_decode's engine (the 48gb serving profile's settings: 16 sequences, 8192 tokens a
step, decode_steps 8, a 46 GiB budget) and runs waves of `first` + `rest` requests, each
engine.step() synchronised and timed with what it ran (prefill tokens, decoding sequences) and
the Triton kernels it specialised (compiled, or loaded from the disk cache) on the way, through
triton.knobs.runtime.jit_cache_hook: a slow step that names kernels is paying their JIT, one
that repeats a composition and is fast the second time paid a one-time cost.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_decode import build, sync

from volundr.sampling_params import SamplingParams

COMPILED: list[str] = []


def _hook(*, fn=None, compile=None, **_) -> bool:
    consts = {k: v for k, v in (compile or {}).get("constants", {}).items()
              if isinstance(v, (int, bool))}
    COMPILED.append(f"{getattr(fn, 'name', '?')} {consts}")
    return False  # (compile as usual)


def install_hook() -> bool:
    try:
        import triton

        triton.knobs.runtime.jit_cache_hook = _hook
        return True
    except (ImportError, AttributeError):
        return False


def wave(e, first: int, rest: int, prompt_len: int, tokens: int, g: torch.Generator,
         tag: str) -> list[dict]:
    """`first` requests, one step, then `rest` more; every step until all are done."""
    p = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    def add(n: int, name: str) -> None:
        for i in range(n):
            ids = torch.randint(16, e.cfg.vocab_size, (prompt_len,), generator=g).tolist()
            e.add_request(ids, p, f"{tag}-{name}{i}")

    add(first, "a")
    steps: list[dict] = []
    while e.has_unfinished():
        if len(steps) == 1:
            add(rest, "b")
        running = [s for s in e.requests.values() if s.num_computed_tokens > 0]
        waiting = len(e.requests) - len(running)
        COMPILED.clear()
        sync()
        t = time.perf_counter()
        outs = e.step()
        sync()
        steps.append({"ms": round((time.perf_counter() - t) * 1e3, 2), "running": len(running),
                      "waiting": waiting, "tokens_out": sum(len(o.new_token_ids) for o in outs),
                      "compiled": list(COMPILED)})
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="volundr-32b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu-gib", type=float, default=46.0)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--waves", default="1+15,1+15,2+14,16+0,1+15,3+13,1+15,5+3",
                    help="first+rest per wave, in order")
    ap.add_argument("--slow-ms", type=float, default=100.0)
    ap.add_argument("--warm-up", action="store_true",
                    help="volundr.warmup's steps first (as a server runs them before ready)")
    args = ap.parse_args()
    hooked = install_hook()
    cuda = args.device == "cuda"
    e = build("mixed", cuda, 16, args.preset, args.device, args.gpu_gib if cuda else None, 8,
              batched_tokens=8192)
    g = torch.Generator().manual_seed(0)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "hook": hooked,
           "args": vars(args), "waves": []}
    if args.warm_up:
        from volundr.warmup import warm_up

        COMPILED.clear()
        t = time.perf_counter()
        report = warm_up(e)
        sync()
        res["warm_up"] = {"s": round(time.perf_counter() - t, 3), "compiled": list(COMPILED),
                          "steps": [vars(s) for s in report.steps]}
        print(f"{report.summary()}; {len(COMPILED)} kernels specialised", flush=True)
    for i, w in enumerate(args.waves.split(",")):
        first, rest = map(int, w.split("+"))
        steps = wave(e, first, rest, args.prompt_len, args.tokens, g, f"w{i}")
        res["waves"].append({"first": first, "rest": rest, "steps": steps})
        slow = [(j, s) for j, s in enumerate(steps) if s["ms"] > args.slow_ms]
        print(f"wave {i} {first}+{rest}: {len(steps)} steps, "
              f"{sum(s['ms'] for s in steps):.0f} ms, slow: "
              + "; ".join(f"#{j} {s['ms']:.0f} ms (run {s['running']}, wait {s['waiting']}, "
                          f"{len(s['compiled'])} JIT)" for j, s in slow), flush=True)
        for _, s in slow:
            for c in s["compiled"][:12]:
                print(f"    {c}"[:220])
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
