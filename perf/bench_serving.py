"""Serving benchmark: the whole stack as users run it (tritonserver with the Python backend + the
OpenAI proxy, started as `volundr-serve` starts them), fixed prompt and output lengths.

    # device (H200), one call, carry [".gpu", ".serve-kit"] (the kit: bash perf/serving_kit.sh
    # here first; the image has no FastAPI, openai SDK or perf_analyzer):
    source .gpu/bootstrap.sh; source .serve-kit/env.sh
    python3 perf/bench_serving.py --random-preset volundr-32b --out $OUT/serving.json
    # CPU, the tiny checkpoint:
    .venv/bin/python perf/bench_serving.py --model .cache/tiny --out /tmp/serving.json \\
        --prompt-tokens 32 --output-tokens 16 --concurrency 4

Measured in one run, against one server: perf_analyzer (gRPC streaming to the `volundr`
ensemble) at concurrency 1 and N, and the OpenAI SDK (streaming /v1/chat/completions and
/v1/completions) with 1 and N streams: requests/s, output tokens/s, time to first token,
inter-token latency. Every request asks for ignore_eos, so each reply is exactly
--output-tokens long; the JSON records the counts seen (perf_analyzer's from its profile export,
the SDK's from `usage`). --random-preset writes a random volundr-mixed checkpoint first
(perf/random_checkpoint.py, in a child process: the GPU memory it used goes back before the
server starts). The JSON (--out) is rewritten after every step, so a run cut short keeps what it
measured; Ctrl-C / SIGTERM stop the servers. N is capped to the profile's in-flight limit (more
would be refused as busy): the default GPU profile, 16gb, admits 8 and runs one sequence at a
time, so its N-stream numbers are queueing; --profile 48gb (16 sequences) batches them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from serving_load import (
    find_perf_analyzer,
    metrics_delta,
    perf_analyzer,
    prompt_text,
    sdk_load,
    server_metrics,
    triton_check,
)

if TYPE_CHECKING:
    from volundr.serve.stack import ServingStack

HERE = Path(__file__).resolve().parent


def sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def gpu_name() -> str | None:
    names = sh("nvidia-smi", "--query-gpu=name", "--format=csv,noheader").splitlines()
    return names[0] if names else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="an existing checkpoint directory")
    src.add_argument("--random-preset", help="write (or reuse) a random volundr-mixed "
                     "checkpoint of this preset: volundr-32b, or tiny on the CPU")
    ap.add_argument("--checkpoint-dir", help="with --random-preset (default "
                    "/tmp/volundr-PRESET-random, reused when complete)")
    ap.add_argument("--shard-gib", type=float, default=4.0, help="random checkpoint shards")
    ap.add_argument("--profile", help="volundr-serve profile (default: 16gb with a GPU, else cpu)")
    ap.add_argument("--serve-args", default="", help='more volundr-serve flags, e.g. '
                    '"--drafter mtp --decode-steps 4" (see volundr-serve --help)')
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16,
                    help="N, capped to the profile's in-flight limit (more are refused)")
    ap.add_argument("--single-requests", type=int, default=8,
                    help="requests of each concurrency-1 measurement")
    ap.add_argument("--rounds", type=int, default=3,
                    help="requests per stream of each concurrency-N measurement")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--endpoints", default="chat,completions", help="OpenAI endpoints measured")
    ap.add_argument("--perf-analyzer", help="its binary (default: $PERF_ANALYZER, the venv's, "
                    "PATH)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    ap.add_argument("--measure-timeout", type=float, default=300.0,
                    help="seconds for each measurement")
    ap.add_argument("--log-dir", help="server logs (default: a temporary directory)")
    ap.add_argument("--out", required=True, help="the JSON")
    return ap.parse_args(argv)


def checkpoint(args: argparse.Namespace, res: dict) -> Path:
    if args.model:
        return Path(args.model).resolve()
    t = time.perf_counter()
    cmd = [sys.executable, str(HERE / "random_checkpoint.py"), args.random_preset,
           *([args.checkpoint_dir] if args.checkpoint_dir else []),
           "--shard-gib", str(args.shard_gib)]
    subprocess.run(cmd, check=True)
    from random_checkpoint import default_dir  # (torch: imported only now, CUDA never started)

    out = Path(args.checkpoint_dir or default_dir(args.random_preset)).resolve()
    res["checkpoint"].update(dir=str(out), prepare_s=time.perf_counter() - t,
                             random=json.loads((out / "random_checkpoint.json").read_text()))
    return out


def start_server(args: argparse.Namespace, model_dir: Path, res: dict) -> ServingStack:
    """The launcher's own flags, options and stack (volundr.serve.launcher / stack), on free
    ports; --serve-args come last and may override any of them."""
    from volundr.serve.launcher import build_options, check_dependencies
    from volundr.serve.launcher import parse_args as serve_args
    from volundr.serve.stack import ServingStack, free_port

    ports: list[int] = []
    while len(ports) < 4:
        p = free_port()
        ports += [p] if p not in ports else []
    argv = ["--model", str(model_dir), "--profile", args.profile, "--http-port", str(ports[0]),
            "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
            "--proxy-port", str(ports[3]), "--startup-timeout", str(args.startup_timeout),
            "--log-dir", args.log_dir] + shlex.split(args.serve_args)
    check_dependencies(proxy=True)
    opts = build_options(serve_args(argv))
    stack = ServingStack(opts)
    res["server"] = {"argv": argv, "profile": dataclasses.asdict(opts.profile),
                     "http_port": opts.http_port, "proxy_port": opts.proxy_port,
                     "served_model_name": opts.served_model_name}
    print(f"bench_serving: starting tritonserver + proxy ({opts.profile.name}, "
          f"{model_dir})...", flush=True)
    t = time.perf_counter()
    try:
        stack.start()
    finally:  # (start() stops what it started when it fails)
        res["server"]["pids"] = [p.pid for p in (stack.triton, stack.proxy) if p is not None]
    res["server"]["start_s"] = time.perf_counter() - t
    return stack


def measure(res: dict, key: str, name: str, fn: Callable[[], dict], out: Path,
            metrics_url: str | None = None) -> None:
    """One measurement into res[key][name]; an error is recorded and the run goes on. With
    metrics_url also what the server's metrics saw meanwhile (serving_load.metrics_delta)."""
    print(f"bench_serving: {key} {name}...", flush=True)
    t = time.perf_counter()
    before = server_metrics(metrics_url) if metrics_url else {}
    try:
        res[key][name] = fn()
        if metrics_url:
            res[key][name]["server_metrics"] = metrics_delta(before, server_metrics(metrics_url))
    except Exception as e:
        res[key][name] = {"error": repr(e)[:3000], "traceback": traceback.format_exc()[-3000:]}
        res["errors"].append(f"{key} {name}: {repr(e)[:300]}")
        print(f"bench_serving: {key} {name} failed: {e!r}"[:2000], file=sys.stderr, flush=True)
    res[key][name]["measure_s"] = time.perf_counter() - t
    save(res, out)


def save(res: dict, out: Path) -> None:
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(out)


def run(args: argparse.Namespace, res: dict, out: Path) -> None:
    stack = None
    work = Path(tempfile.mkdtemp(prefix="bench-serving-pa-"))  # perf_analyzer's files
    try:
        model_dir = checkpoint(args, res)
        stack = start_server(args, model_dir, res)
        save(res, out)
        n_out, temp = args.output_tokens, args.temperature
        text = prompt_text(model_dir, args.prompt_tokens)
        n = min(args.concurrency, res["server"]["profile"]["max_inflight"])
        res["concurrency"] = n
        # (concurrency, requests per stream): 1 and N
        levels = [(1, args.single_requests)] + ([(n, args.rounds)] if n > 1 else [])
        measure(res, "checks", "triton",
                lambda: triton_check(stack.grpc_url, text, n_out, temp), out)
        exe = find_perf_analyzer(args.perf_analyzer)

        def pa(name: str, c: int, rounds: int, files: Path) -> None:
            measure(res, "perf_analyzer", name, lambda: perf_analyzer(
                exe, stack.grpc_url, text, n_out, temp, c, c * rounds, files,
                args.measure_timeout), out, stack.metrics_url)

        for c, rounds in levels:
            pa(f"c{c}", c, rounds, work)
        name = res["server"]["served_model_name"]
        for ep in args.endpoints.split(","):
            for streams, rounds in levels:
                if stack.poll():
                    raise RuntimeError(f"{stack.poll()} exited")
                measure(res, "openai", f"{ep}_s{streams}", lambda ep=ep, s=streams, r=rounds:
                        sdk_load(stack.proxy_url, ep, name, text, n_out, temp, s, r,
                                 args.measure_timeout), out, stack.metrics_url)
        if n > 1:  # perf_analyzer's N level again, after everything: a first-burst cost shows
            pa(f"c{n}_again", n, args.rounds, work / "again")
    except KeyboardInterrupt:
        res["errors"].append("interrupted")
    except Exception as e:
        res["errors"].append(f"{e!r}"[:3000])
        traceback.print_exc()
    finally:
        # a second Ctrl-C / SIGTERM must not skip the stop (the servers run in their own
        # sessions and would outlive this process); stop() is bounded
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if stack is not None:
            t = time.perf_counter()
            stack.stop()
            res["server"]["stop_s"] = time.perf_counter() - t
        shutil.rmtree(work, ignore_errors=True)
        save(res, out)


def summary(res: dict) -> str:
    a = res["args"]
    srv = res.get("server", {})
    lines = [f"serving benchmark: {res['gpu'] or 'cpu'}, profile {a['profile']}, prompt "
             f"{a['prompt_tokens']} + output {a['output_tokens']} tokens, commit "
             f"{res['commit'][:10]}{' (dirty)' if res['dirty'] else ''}",
             f"  checkpoint {res['checkpoint'].get('prepare_s', 0):.1f} s, server start "
             f"{srv.get('start_s', 0):.1f} s, stop {srv.get('stop_s', 0):.1f} s"]

    def row(label: str, m: dict) -> str:
        if "error" in m:
            return f"  {label:26s} ERROR {m['error'][:90]}"
        ms = lambda k, q: m.get(k, {}).get(q, float("nan"))  # noqa: E731
        eng = m.get("server_metrics", {}).get("volundr_llm", {})
        return (f"  {label:26s} {m['requests_per_s']:7.2f} req/s {m['output_tok_per_s']:8.1f} "
                f"tok/s  TTFT p50 {ms('ttft_ms', 'p50'):7.1f} p90 {ms('ttft_ms', 'p90'):7.1f} ms"
                f"  ITL p50 {ms('itl_ms', 'p50'):6.2f} p90 {ms('itl_ms', 'p90'):6.2f} ms  "
                f"stream {ms('decode_tok_per_s_per_stream', 'p50'):6.1f} tok/s  "
                f"out {m['output_tokens_each']}"
                + (f"  engine TTFT mean {eng['engine_ttft_ms']:.1f} ms (client "
                   f"{ms('ttft_ms', 'mean'):.1f})" if "engine_ttft_ms" in eng else ""))

    for name, m in res["perf_analyzer"].items():
        lines.append(row(f"perf_analyzer {name}", m))
    for name, m in res["openai"].items():
        lines.append(row(f"openai {name}", m))
    if res.get("concurrency", a["concurrency"]) != a["concurrency"]:
        lines.append(f"  (concurrency {a['concurrency']} capped to {res['concurrency']}: the "
                     "profile's in-flight limit)")
    lines += [f"  error: {e[:200]}" for e in res["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = gpu_name()
    args.profile = args.profile or ("16gb" if gpu else "cpu")
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench-serving-logs-")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"commit": sh("git", "-C", str(HERE), "rev-parse", "HEAD"),
           "dirty": bool(sh("git", "-C", str(HERE), "status", "--porcelain", "-uno")),
           "gpu": gpu, "args": vars(args), "checkpoint": {"dir": args.model}, "server": {},
           "checks": {}, "perf_analyzer": {}, "openai": {}, "errors": []}

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    t = time.perf_counter()
    run(args, res, out)
    res["total_s"] = time.perf_counter() - t
    save(res, out)
    print(summary(res), flush=True)
    if res["errors"]:
        print(f"bench_serving: server logs in {args.log_dir}", file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
