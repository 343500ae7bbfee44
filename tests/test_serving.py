"""The Triton side, against the real tritonserver started by `volundr-serve` (see conftest.py):
tritonclient gRPC streaming to the ensemble and to volundr_llm, Triton's HTTP generate
extension, perf_analyzer, cancellation and aborts visible in the engine stats."""

from __future__ import annotations

import ast
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer
from triton_helpers import grpc_stream, texts

from volundr.clients.triton import VolundrTriton, make_input
from volundr.serve.triton_env import perf_analyzer_env

pytestmark = pytest.mark.server
PROMPT = "The smith Volundr forged"


def engine_stats(url: str) -> dict:
    async def go():
        async with VolundrTriton(url) as t:
            return await t.stats()
    return asyncio.run(go())


def wait_idle(url: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine_stats(url)
        idle = s["running"] == 0 and s["active_requests"] == 0
        if (idle and s["num_blocks_free"] == s["num_blocks_total"]) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def test_engine_warmed_up_before_ready(serving):
    """--warmup 1 (conftest): volundr_llm ran volundr.warmup's steps in initialize, and the
    engine it then served from had every block and slot free and no speculative counts."""
    log = (serving.log_dir / "tritonserver.log").read_text(errors="replace")
    steps = re.search(r"volundr_llm: warm-up: (\d+) steps in", log)
    assert steps and int(steps.group(1)) >= 10, log[-3000:]
    stats = re.search(r"volundr_llm: .* on cpu, context .*stats (\{.*\})", log)
    stats = ast.literal_eval(stats.group(1))
    assert stats["num_blocks_free"] == stats["num_blocks_total"] > 0
    assert stats["num_slots_free"] == stats["num_slots_total"]
    assert stats["spec_steps"] == stats["spec_tokens"] == stats["running"] == 0


def test_grpc_stream_ensemble_text_and_messages(serving):
    base = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    streamed = grpc_stream(serving.grpc_url, "volundr",
                           VolundrTriton.inputs(text_input=PROMPT, stream=True, **base))
    whole = grpc_stream(serving.grpc_url, "volundr", VolundrTriton.inputs(text_input=PROMPT,
                                                                          **base))
    assert len(streamed) > 1 and len(whole) == 1
    assert "".join(texts(streamed)) == texts(whole)[0] != ""
    last = streamed[-1]
    assert last.as_numpy("finish_reason").reshape(-1)[0] == b"length"
    assert int(last.as_numpy("num_output_tokens").reshape(-1)[0]) == 10
    assert [r.as_numpy("finish_reason").reshape(-1)[0] for r in streamed[:-1]] == \
        [b""] * (len(streamed) - 1)
    msgs = json.dumps([{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Hi!"}])
    chat = grpc_stream(serving.grpc_url, "volundr",
                       VolundrTriton.inputs(messages=msgs, stream=True, **base))
    n_in = int(chat[-1].as_numpy("num_input_tokens").reshape(-1)[0])
    assert n_in > 10  # the chat template wrapped the messages


def test_grpc_stream_volundr_llm_direct(serving, tiny_dir):
    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    base = dict(input_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True)
    streamed = grpc_stream(serving.grpc_url, "volundr_llm",
                           VolundrTriton.inputs(stream=True, **base))
    whole = grpc_stream(serving.grpc_url, "volundr_llm", VolundrTriton.inputs(**base))
    out = [i for r in streamed for i in r.as_numpy("output_ids").reshape(-1).tolist()]
    assert out == whole[0].as_numpy("output_ids").reshape(-1).tolist() and len(out) == 8
    # The ensemble's text is the decode of these ids.
    ens = grpc_stream(serving.grpc_url, "volundr",
                      VolundrTriton.inputs(text_input=PROMPT, max_tokens=8, temperature=0.0,
                                           ignore_eos=True))
    assert texts(ens)[0] == tok.decode(out, skip_special_tokens=False)


def test_logprobs_outputs(serving, tiny_dir):
    """top_logprobs: volundr_llm's `logprobs` output holds [id, logprob, alternatives] per
    output id; the ensemble's, OpenAI's entries with each token's text; without it both are
    empty strings."""
    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    base = dict(max_tokens=5, temperature=0.0, ignore_eos=True)
    direct = grpc_stream(serving.grpc_url, "volundr_llm",
                         VolundrTriton.inputs(input_ids=ids, top_logprobs=2, **base))[0]
    out = direct.as_numpy("output_ids").reshape(-1).tolist()
    rows = json.loads(direct.as_numpy("logprobs").reshape(-1)[0])
    assert [r[0] for r in rows] == out and all(len(r[2]) == 2 and r[2][0][0] == r[0]
                                               for r in rows)  # greedy: the top one
    ens = grpc_stream(serving.grpc_url, "volundr",
                      VolundrTriton.inputs(text_input=PROMPT, top_logprobs=2, **base))[0]
    entries = json.loads(ens.as_numpy("logprobs").reshape(-1)[0])
    assert "".join(e["token"] for e in entries) == texts([ens])[0]
    assert [e["logprob"] for e in entries] == [r[1] for r in rows]
    none = grpc_stream(serving.grpc_url, "volundr", VolundrTriton.inputs(text_input=PROMPT,
                                                                         **base))[0]
    assert none.as_numpy("logprobs").reshape(-1)[0] == b""


def test_json_schema_input(serving):
    """json_schema: the ensemble's text, streamed, is JSON matching the schema; a request
    without it next to it stays free text."""
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "size"],
              "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}}}
    base = dict(text_input=PROMPT, max_tokens=40, temperature=0.0, stream=True)
    out = grpc_stream(serving.grpc_url, "volundr",
                      VolundrTriton.inputs(json_schema=json.dumps(schema), **base))
    value = json.loads("".join(texts(out)))
    assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool)
    assert value["size"] in ("s", "m", "l")
    assert out[-1].as_numpy("finish_reason").reshape(-1)[0] == b"stop"
    free = grpc_stream(serving.grpc_url, "volundr", VolundrTriton.inputs(**base))
    assert not "".join(texts(free)).startswith("{")


def test_grammar_input_after_a_think_block(serving, tiny_dir):
    """The ensemble's grammar with chat messages: the template's thinking on (its default),
    the reply may open with a think block (here forced by a +100 bias on both tags, greedy)
    and then holds to the grammar; with enable_thinking false the grammar holds from the
    first token."""
    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    bias = json.dumps({str(tok.token_to_id(t)): 100 for t in ("<think>", "</think>")})
    base = dict(messages=json.dumps([{"role": "user", "content": "A code?"}]),
                grammar="start: /[0-9]{3}-[a-c]{2}/", logit_bias=bias, max_tokens=30,
                temperature=0.0)
    on = texts(grpc_stream(serving.grpc_url, "volundr", VolundrTriton.inputs(**base)))[0]
    think, _, value = on.partition("</think>")
    assert think.startswith("<think>") and re.fullmatch(r"\s*[0-9]{3}-[a-c]{2}", value), on
    off = texts(grpc_stream(serving.grpc_url, "volundr", VolundrTriton.inputs(
        **base, chat_template_kwargs='{"enable_thinking": false}')))[0]
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", off), off


def test_http_generate_and_generate_stream(serving):
    body = {"text_input": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    url = f"{serving.http_url}/v2/models/volundr"
    whole = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    with httpx.stream("POST", f"{url}/generate_stream", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) > 1 and events[-1]["finish_reason"] == "length"
    assert "".join(e["text_output"] for e in events) == whole.json()["text_output"]


def test_perf_analyzer_streaming_grpc(serving, tmp_path):
    exe = Path(sys.executable).parent / "perf_analyzer"
    data = {"data": [{"text_input": ["Tell me about the forge."], "max_tokens": [8],
                      "temperature": [0.0], "ignore_eos": [True], "stream": [True]}]}
    (tmp_path / "input.json").write_text(json.dumps(data))
    cmd = [str(exe), "-m", "volundr", "-i", "grpc", "-u", serving.grpc_url, "--streaming",
           "--async", "--concurrency-range", "4", "--input-data", str(tmp_path / "input.json"),
           "--request-count", "24"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=perf_analyzer_env())
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"Concurrency: 4, throughput: ([\d.]+) infer/sec", p.stdout)
    assert m and float(m.group(1)) > 0, p.stdout


def test_bad_triton_inputs_are_errors_and_serving_goes_on(serving):
    cases = [
        (dict(text_input="x", messages='[{"role": "user", "content": "y"}]'), "exactly one"),
        (dict(messages="not json"), "not valid JSON"),
        (dict(messages='[{"role": "robot", "content": "y"}]'), "unknown role"),
        (dict(text_input="x", max_tokens=-2), "max_tokens"),
        (dict(text_input="x", temperature=-1.0), "temperature"),
        (dict(text_input="x", presence_penalty=2.5), "presence_penalty must be in"),
        (dict(text_input="x", repetition_penalty=0.0), "repetition_penalty must be in"),
        (dict(text_input="x", logit_bias='{"99999999": 1}'), "logit_bias token ids"),
        (dict(text_input="x", logit_bias="[1]"), "logit_bias must be a JSON object"),
        (dict(text_input="x", top_logprobs=21), "logprobs must be an integer"),
        (dict(text_input="x", json_schema="{oops"), "json_schema is not valid JSON"),
        (dict(text_input="x", json_schema='{"type": "strin"}'), "json_schema cannot be compiled"),
        (dict(text_input="word " * 3000, max_tokens=2), "prompt too long"),
        (dict(text_input="x", max_tokens=2, min_tokens=3), "min_tokens must be"),
        (dict(messages='[{"role": "user", "content": "y"}]', tools=json.dumps([{
            "type": "function", "function": {"name": "f", "parameters": {}}}]),
              chat_template_kwargs='{"tool_choice": "required", "add_generation_prompt": false}'),
         "forces a call needs add_generation_prompt"),
        (dict(messages='[{"role": "user", "content": "y"}]',
              chat_template_kwargs='{"continue_final_message": true, '
                                   '"add_generation_prompt": false}'),
         "final assistant message"),
    ]
    for fields, needle in cases:
        with pytest.raises(Exception, match=needle):
            grpc_stream(serving.grpc_url, "volundr", VolundrTriton.inputs(**fields))
    with pytest.raises(Exception, match="batch size 1"):
        inp = grpcclient.InferInput("input_ids", [2, 3], "INT32")
        inp.set_data_from_numpy(np.ones((2, 3), np.int32))
        grpc_stream(serving.grpc_url, "volundr_llm", [inp])
    ok = grpc_stream(serving.grpc_url, "volundr",
                     VolundrTriton.inputs(text_input="fine", max_tokens=2, ignore_eos=True))
    assert ok[-1].as_numpy("finish_reason").reshape(-1)[0] == b"length"


def test_cancelling_a_direct_volundr_llm_stream_frees_its_sequence(serving):
    inputs = [make_input("input_ids", [20, 21, 22, 23]), make_input("max_tokens", 1500),
              make_input("ignore_eos", True), make_input("stream", True)]
    got = grpc_stream(serving.grpc_url, "volundr_llm", inputs, cancel_after=3)
    assert len(got) == 3
    s = wait_idle(serving.grpc_url)
    assert s["running"] == 0 and s["num_blocks_free"] == s["num_blocks_total"], s
    assert s["num_slots_free"] == s["num_slots_total"], s


def test_client_disconnect_aborts_sequence_and_frees_blocks(serving):
    """A client of the OpenAI proxy goes away mid-stream: the proxy aborts the sequence (Triton
    2.51 does not pass the cancellation of an ensemble request on to the running step)."""
    body = {"model": "volundr", "messages": [{"role": "user", "content": "a long story"}],
            "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{serving.proxy_url}/v1/chat/completions", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        n, during = 0, None
        for line in r.iter_lines():
            n += line.startswith("data:")
            if n == 4:
                during = engine_stats(serving.grpc_url)  # still reading: the sequence runs
                break  # leaving the loop closes the response: the client is gone
        assert during["running"] == 1 and during["num_blocks_free"] < during["num_blocks_total"]
    t0 = time.monotonic()
    after = wait_idle(serving.grpc_url)
    assert after["running"] == 0 and after["active_requests"] == 0, after
    assert after["num_blocks_free"] == after["num_blocks_total"], after
    assert after["num_slots_free"] == after["num_slots_total"], after
    assert time.monotonic() - t0 < 10  # aborted, not run to its 1500 tokens


def prometheus(text: str, name: str, **labels: str) -> float | None:
    """The sum of a metric's samples whose labels include `labels` (None: no sample)."""
    total = None
    for line in text.splitlines():
        m = re.fullmatch(r"([^\s{]+)(?:\{(.*)\})?\s+(\S+)", line)
        if m is None or line.startswith("#") or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total = (total or 0.0) + float(m.group(3))
    return total


def test_engine_metrics_on_the_metrics_port(serving):
    """volundr_llm's engine metrics join Triton's at its metrics port: one request of 4 prompt
    tokens and 6 generated ones moves the token counters by exactly that, counts one
    "length" success and one observation of each latency histogram; the gauges are there."""
    url = f"http://127.0.0.1:{serving.metrics_port}/metrics"
    lab = dict(model="volundr_llm", version="1")
    names = ["volundr:prompt_tokens_total", "volundr:generation_tokens_total",
             "volundr:time_to_first_token_seconds_count",
             "volundr:time_per_output_token_seconds_count",
             "volundr:e2e_request_latency_seconds_count"]

    def read() -> tuple[str, list[float]]:
        text = httpx.get(url, timeout=10).text
        return text, [prometheus(text, n, **lab) or 0.0 for n in names]

    wait_idle(serving.grpc_url)  # (an earlier test's aborted request must not count here)
    text, before = read()
    ok0 = prometheus(text, "volundr:request_success_total", finish_reason="length", **lab) or 0
    got = grpc_stream(serving.grpc_url, "volundr_llm", VolundrTriton.inputs(
        input_ids=[20, 21, 22, 23], max_tokens=6, temperature=0.0, ignore_eos=True))
    assert got[-1].as_numpy("num_output_tokens").reshape(-1)[0] == 6
    deadline = time.monotonic() + 10
    while True:  # (the counters move on the engine's thread as the reply goes out)
        text, after = read()
        delta = [a - b for a, b in zip(after, before)]
        if delta == [4, 6, 1, 1, 1] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert delta == [4, 6, 1, 1, 1], dict(zip(names, delta))
    assert prometheus(text, "volundr:request_success_total", finish_reason="length",
                      **lab) == ok0 + 1
    for gauge in ("volundr:num_requests_running", "volundr:num_requests_waiting",
                  "volundr:num_requests_active"):
        assert prometheus(text, gauge, **lab) is not None, gauge
    assert 0.0 <= prometheus(text, "volundr:kv_cache_usage_perc", **lab) <= 1.0
    assert prometheus(text, "volundr:spec_tokens_total", **lab) is not None
    assert "nv_inference_request_success" in text  # (Triton's own beside them)
