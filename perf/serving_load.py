"""The load generators of bench_serving.py: perf_analyzer against the Triton ensemble and the
official OpenAI SDK against the proxy, both reduced to the same per-request records (send time,
the arrival times of the responses that carry tokens, token counts) and the same statistics."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from volundr.converter.tokenizer import CORPUS_PATH


@dataclass
class Req:
    start: float  # seconds (one clock per load generator)
    times: list[float]  # arrival of each response / chunk that carries tokens
    out_tokens: int
    in_tokens: int
    # tokens each response carried (perf_analyzer: from num_output_tokens); None: unknown (the
    # SDK's chunks: the gaps are shared out by the request's mean tokens per chunk)
    step_tokens: list[int] | None = None


def prompt_text(model_dir: Path, n: int) -> str:
    """Text of the corpus that the checkpoint's tokenizer encodes to exactly n tokens (as the
    preprocessing model does: no special tokens added)."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = set(tok.get_added_tokens_decoder())
    ids = [i for i in tok.encode(CORPUS_PATH.read_text("utf-8"), add_special_tokens=False).ids
           if i not in special]
    ids = ids * (n // len(ids) + 2)
    # decode + encode need not round trip at the cut: try the cuts next to n
    for k in sorted(range(max(1, n - 16), n + 17), key=lambda k: abs(k - n)):
        text = tok.decode(ids[:k])
        if len(tok.encode(text, add_special_tokens=False).ids) == n:
            return text
    raise RuntimeError(f"no corpus prefix encodes to exactly {n} tokens")


def pcts(values: list[float], scale: float = 1.0) -> dict:
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def summarize(reqs: list[Req], wall_s: float) -> dict:
    """Throughput over the wall time of the load; latencies per request; the inter-token
    latency per token (a response of k tokens after a gap g counts k tokens of g / k)."""
    itl: list[float] = []
    rates = []
    for r in reqs:
        gaps = np.diff(r.times).tolist()
        if r.step_tokens is not None:
            for g, k in zip(gaps, r.step_tokens[1:]):
                itl += [g / k] * k if k > 0 else []
        elif gaps and r.out_tokens > 1:
            per_gap = (r.out_tokens - 1) / len(gaps)
            itl += [g / per_gap for g in gaps]
        if len(r.times) > 1 and r.out_tokens > 1:
            rates.append((r.out_tokens - 1) / (r.times[-1] - r.times[0]))
    out = sum(r.out_tokens for r in reqs)
    return {
        "requests": len(reqs), "wall_s": wall_s, "requests_per_s": len(reqs) / wall_s,
        "output_tok_per_s": out / wall_s,
        "output_tokens_each": sorted({r.out_tokens for r in reqs}),
        "prompt_tokens_each": sorted({r.in_tokens for r in reqs}),
        "chunks_per_request": float(np.mean([len(r.times) for r in reqs])),
        "ttft_ms": pcts([r.times[0] - r.start for r in reqs if r.times], 1e3),
        "e2e_ms": pcts([r.times[-1] - r.start for r in reqs if r.times], 1e3),
        "itl_ms": pcts(itl, 1e3),
        # per request, after its first token: what one user sees streaming
        "decode_tok_per_s_per_stream": pcts(rates),
        # per request, in send order: [sent (s after the first), TTFT ms, end to end ms]
        "timeline": [[round(r.start - t0, 3), round((r.times[0] - r.start) * 1e3, 1),
                      round((r.times[-1] - r.start) * 1e3, 1)]
                     for t0 in [min(r.start for r in reqs)]
                     for r in sorted(reqs, key=lambda r: r.start) if r.times],
    }


# ---- the server's own metrics ----------------------------------------------------------------
TRITON_DURATIONS = ("request", "queue", "compute_input", "compute_infer", "compute_output")
ENGINE_HISTOGRAMS = {"time_to_first_token_seconds": "engine_ttft_ms",
                     "e2e_request_latency_seconds": "engine_e2e_ms"}


def server_metrics(url: str) -> dict[str, float]:
    """Triton's per-model counters (nv_inference_*) and the engine's histograms' sums and counts
    (volundr:*_sum / *_count) from the Prometheus text at `url`, keyed by the metric's name and
    labels as written there; {} when it cannot be read."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith("nv_inference_") or (
                name.startswith("volundr:") and name.endswith(("_sum", "_count"))):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the server saw between two `server_metrics`, per model: Triton's successful requests
    and its mean ms per request in each stage, as Triton reports them (for a decoupled model
    they need not span the generation); for the engine, the mean TTFT and end to end from each
    request's arrival at volundr_llm (the client's TTFT minus it: the time before, in the
    client, the proxy and the ensemble)."""
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    models: dict[str, dict] = {}
    for key, v in d.items():
        name, _, labels = key.partition("{")
        model = re.search(r'model="([^"]+)"', labels)
        if model is None:
            continue
        m = models.setdefault(model.group(1), {})
        m[name] = m.get(name, 0.0) + v
    out: dict[str, dict] = {}
    for model, m in models.items():
        n = m.get("nv_inference_request_success", 0.0)
        row = {"requests": n} if n else {}
        for stage in TRITON_DURATIONS:
            us = m.get(f"nv_inference_{stage}_duration_us")
            if n and us is not None:
                row[f"{stage}_ms"] = us / n / 1e3
        for hist, label in ENGINE_HISTOGRAMS.items():
            c, t = m.get(f"volundr:{hist}_count"), m.get(f"volundr:{hist}_sum")
            if c:
                row[label] = t / c * 1e3
        if row:
            out[model] = row
    return out


# ---- perf_analyzer ---------------------------------------------------------------------------
def find_perf_analyzer(explicit: str | None) -> str:
    """--perf-analyzer, $PERF_ANALYZER, tritonclient's next to this Python (the venv; how
    tests/test_serving.py runs it), or on PATH."""
    for cand in (explicit, os.environ.get("PERF_ANALYZER"),
                 str(Path(sys.executable).parent / "perf_analyzer"), shutil.which("perf_analyzer")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise FileNotFoundError("perf_analyzer not found (pip install 'tritonclient[all]==2.50.0', "
                            "set $PERF_ANALYZER or pass --perf-analyzer)")


def perf_analyzer(exe: str, grpc_url: str, text: str, out_tokens: int, temperature: float,
                  concurrency: int, requests: int, work: Path, timeout_s: float) -> dict:
    """perf_analyzer, gRPC streaming to the `volundr` ensemble (decoupled), a fixed request
    count at one concurrency. Its CSV gives requests/s and the latency percentiles it measures
    (for a decoupled model: to the first response); its profile export, every response's time
    and token count, from which the rest comes."""
    from volundr.serve.triton_env import perf_analyzer_env

    work.mkdir(parents=True, exist_ok=True)
    inp, csv_path, export = (work / f"c{concurrency}_{n}" for n in ("input.json", "report.csv",
                                                                      "export.json"))
    inp.write_text(json.dumps({"data": [{
        "text_input": [text], "max_tokens": [out_tokens], "temperature": [temperature],
        "ignore_eos": [True], "stream": [True]}]}))
    cmd = [exe, "-m", "volundr", "-i", "grpc", "-u", grpc_url, "--streaming", "--async",
           "--concurrency-range", str(concurrency), "--request-count", str(requests),
           "--input-data", str(inp), "-f", str(csv_path), "--profile-export-file", str(export)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                       env=perf_analyzer_env())
    if p.returncode != 0:
        raise RuntimeError(f"perf_analyzer exited with {p.returncode}:\n"
                           f"{(p.stdout + p.stderr)[-3000:]}")
    with open(csv_path, newline="") as f:
        row = next(csv.DictReader(f))
    reqs = []
    for r in json.loads(export.read_text())["experiments"][0]["requests"]:
        counts = [int(o.get("num_output_tokens", 0)) for o in r["response_outputs"]]
        steps = [b - a for a, b in zip([0] + counts, counts)]
        times = [t / 1e9 for t, k in zip(r["response_timestamps"], steps) if k > 0]
        reqs.append(Req(r["timestamp"] / 1e9, times, counts[-1] if counts else 0,
                        int(r["response_outputs"][0].get("num_input_tokens", 0))
                        if r["response_outputs"] else 0, [k for k in steps if k > 0]))
    wall = max(r.times[-1] for r in reqs if r.times) - min(r.start for r in reqs)
    res = {"concurrency": concurrency, **summarize(reqs, wall),
           # perf_analyzer's own numbers (its CSV): requests/s over its measurement window
           # (which runs past the last response: low for short runs) and request latency, send
           # to the final response (2.50 says it takes the first for a decoupled model; with
           # --streaming the times match the final one)
           "pa_infer_per_s": float(row["Inferences/Second"]),
           "pa_response_per_s": float(row.get("Response Throughput") or 0),
           "pa_latency_ms": {k.split()[0]: float(row[k]) / 1e3 for k in row
                             if k.endswith(" latency")},
           "pa_csv": row}
    res["pa_output_tok_per_s"] = res["pa_infer_per_s"] * out_tokens  # (fixed length: checked)
    return res


# ---- the OpenAI SDK through the proxy --------------------------------------------------------
def sdk_request(client, endpoint: str, model: str, text: str, out_tokens: int,
                temperature: float) -> Req:
    """One streamed request; a chunk counts when it carries text (the chat stream's first
    chunk holds only the role). ignore_eos: the reply runs to max_tokens."""
    kw = dict(model=model, max_tokens=out_tokens, temperature=temperature, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    t0 = time.perf_counter()
    if endpoint == "chat":
        stream = client.chat.completions.create(messages=[{"role": "user", "content": text}],
                                                **kw)
    else:
        stream = client.completions.create(prompt=text, **kw)
    times, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            d = getattr(c, "delta", None)
            has = (d.content or getattr(d, "reasoning_content", None)) if d else c.text
            if has:
                times.append(time.perf_counter())
    if usage is None:
        raise RuntimeError(f"{endpoint}: the stream ended without a usage chunk")
    return Req(t0, times, usage.completion_tokens, usage.prompt_tokens)


def sdk_load(base_url: str, endpoint: str, model: str, text: str, out_tokens: int,
             temperature: float, streams: int, rounds: int, timeout_s: float) -> dict:
    """`streams` threads, each sending `rounds` requests one after the other (a closed loop,
    as perf_analyzer's concurrency), after one unmeasured warm-up request."""
    from openai import OpenAI

    # no retries: a 429 (server busy) must show as an error, not as a slower request
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                    timeout=timeout_s)
    sdk_request(client, endpoint, model, text, out_tokens, temperature)
    pool = ThreadPoolExecutor(streams)
    t0 = time.perf_counter()
    try:
        futs = [pool.submit(lambda: [sdk_request(client, endpoint, model, text, out_tokens,
                                                 temperature) for _ in range(rounds)])
                for _ in range(streams)]
        reqs = [r for f in futs for r in f.result(timeout=timeout_s)]
    finally:  # (Ctrl-C: do not wait for the streams; stopping the servers ends them)
        pool.shutdown(wait=False, cancel_futures=True)
    return {"endpoint": endpoint, "streams": streams,
            **summarize(reqs, max(r.times[-1] for r in reqs if r.times) - t0)}


def triton_check(grpc_url: str, text: str, out_tokens: int, temperature: float) -> dict:
    """One request through the ensemble (tritonclient, as perf_analyzer sends it): the prompt's
    and the output's token counts, before any load (also a warm-up)."""
    from volundr.clients.triton import VolundrTriton

    async def go():
        async with VolundrTriton(grpc_url) as t:
            last, chunks = None, 0
            async for d in t.stream(t.inputs(text_input=text, max_tokens=out_tokens,
                                             temperature=temperature, ignore_eos=True,
                                             stream=True)):
                last, chunks = d, chunks + 1
            return {"prompt_tokens": last.num_input_tokens,
                    "output_tokens": last.num_output_tokens,
                    "finish_reason": last.finish_reason, "responses": chunks}

    return asyncio.run(go())
