"""The OpenAI proxy with the official `openai` SDK and raw HTTP, against the real stack."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from tokenizers import Tokenizer

from volundr.clients.triton import VolundrTriton

pytestmark = pytest.mark.server
MESSAGES = [{"role": "user", "content": "Tell me about Volundr the smith."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def client(serving) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serving.proxy_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def aclient(serving) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{serving.proxy_url}/v1", api_key="none", max_retries=0)


def test_models_and_health(client, serving):
    models = client.models.list()
    assert [m.id for m in models.data] == ["volundr"]
    assert httpx.get(f"{serving.proxy_url}/health").json() == {"status": "ok"}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_streamed_equals_not_streamed_greedy(client):
    kw = dict(model="volundr", messages=MESSAGES, max_tokens=16, temperature=0.0,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 16 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 16
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_max_completion_tokens_and_seeded_sampling(client):
    kw = dict(model="volundr", messages=MESSAGES, max_completion_tokens=6, temperature=1.0,
              top_p=0.9, seed=1234, extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.usage.completion_tokens == 6
    assert a.choices[0].message.content == b.choices[0].message.content  # same seed


def test_penalties_reach_the_engine(client, serving, tiny_dir):
    """The SDK's presence / frequency penalties and repetition_penalty (extra_body) change
    greedy text, the same way every time, streamed or not; Triton's HTTP generate takes them
    as inputs of the ensemble too; logit_bias +100 on a token makes a completion of it alone."""
    from pathlib import Path

    kw = dict(model="volundr", messages=MESSAGES, max_tokens=24, temperature=0.0)
    plain = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    pen = dict(kw, presence_penalty=1.0, frequency_penalty=2.0,
               extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    a, b = (client.chat.completions.create(**pen) for _ in range(2))
    text = a.choices[0].message.content
    assert text != plain.choices[0].message.content and b.choices[0].message.content == text
    chunks = client.chat.completions.create(**pen, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    body = {"text_input": "The forge", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    url = f"{serving.http_url}/v2/models/volundr/generate"
    outs = [httpx.post(url, json={**body, **extra}, timeout=60).json()["text_output"]
            for extra in ({}, {"presence_penalty": -2.0, "frequency_penalty": -2.0})]
    assert outs[0] != outs[1]  # (negative: the tokens so far are favoured)
    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    forced = tok.encode(" forge", add_special_tokens=False).ids[0]
    c = client.completions.create(model="volundr", prompt="The", max_tokens=4,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert c.choices[0].text == tok.decode([forced] * 4) and c.usage.completion_tokens == 4


def test_logprobs(client):
    """Chat logprobs (+ top_logprobs), whole and streamed, and completions' logprobs: one entry
    per generated token whose texts join to the reply, each token among its own top
    alternatives when it is the greedy one, alternatives sorted; the streamed entries equal
    the whole response's; bad values are 400s."""
    kw = dict(model="volundr", messages=MESSAGES, max_tokens=12, temperature=0.0,
              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == 12 and "".join(e.token for e in content) == \
        whole.choices[0].message.content
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= 0
        assert abs(e.logprob - tops[0]) < 1e-4  # greedy: the most likely token
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == \
        [(e.token, round(e.logprob, 5)) for e in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content
    c = client.completions.create(model="volundr", prompt="The forge", max_tokens=6,
                                  temperature=0.0, logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 6
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for bad, param in ((dict(top_logprobs=21), "top_logprobs"),
                       (dict(logprobs=False, top_logprobs=2), "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{**kw, **bad})
        assert e.value.param == param
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="volundr", prompt="x", logprobs=6)


class Forge(pydantic.BaseModel):
    """The structured reply of test_response_format (a closed set, so the random tiny model
    finishes it)."""
    metal: Literal["iron", "steel", "bronze"]
    hot: bool
    blows: list[Literal[1, 2, 3]] = pydantic.Field(max_length=2)


def test_response_format(client, tiny_dir):
    """response_format json_schema (the SDK's parse() with a pydantic model, strict) and
    json_object: the reply is JSON matching the schema, whole and streamed, greedy and
    sampled, ended with "stop"; a schema that does not compile is a 400 naming
    response_format, and serving goes on."""
    kw = dict(model="volundr", messages=MESSAGES, max_tokens=80)
    for t in (0.0, 1.0):
        r = client.chat.completions.parse(**kw, temperature=t, response_format=Forge)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(r.choices[0].message.parsed, Forge)
    schema = {"name": "forge", "strict": True, "schema": {
        "type": "object", "additionalProperties": False, "required": ["metal", "hot", "blows"],
        "properties": {"metal": {"enum": ["iron", "steel", "bronze"]}, "hot": {"type": "boolean"},
                       "blows": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2}}}}
    fmt = {"type": "json_schema", "json_schema": schema}
    whole = client.chat.completions.create(**kw, temperature=0.0, response_format=fmt)
    Forge.model_validate_json(whole.choices[0].message.content)
    chunks = list(client.chat.completions.create(**kw, temperature=0.0, response_format=fmt,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    r = client.chat.completions.create(**{**kw, "max_tokens": 200}, temperature=0.7, seed=3,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # (random weights: an object may run long)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    c = client.completions.create(model="volundr", prompt="The forge", max_tokens=80,
                                  temperature=0.0, extra_body={"response_format": fmt})
    Forge.model_validate_json(c.choices[0].text)
    # thinking asked for: the reasoning first (the think tags forced by logit_bias here),
    # then the value as content
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    bias = {str(tok.token_to_id(t)): 100 for t in ("<think>", "</think>")}
    r = client.chat.completions.create(**kw, temperature=0.0, response_format=fmt,
                                       logit_bias=bias,
                                       extra_body={"chat_template_kwargs": {
                                           "enable_thinking": True}})
    assert r.choices[0].finish_reason == "stop"
    Forge.model_validate_json(r.choices[0].message.content)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, response_format=bad)
    assert e.value.param == "response_format" and "strin" in str(e.value)
    assert client.chat.completions.create(**kw).choices[0].message.content is not None


def test_completions_best_of(client):
    """best_of: best_of candidates (seeds seed .. seed + best_of - 1, as n choices get), the n
    with the highest cumulative logprob returned, best first, with or without logprobs
    asked; usage counts every candidate's tokens."""
    kw = dict(model="volundr", prompt="The forge", max_tokens=6, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    all3 = client.completions.create(**kw, n=3, logprobs=0)
    score = {c.index: sum(c.logprobs.token_logprobs) for c in all3.choices}
    ranked = sorted(score, key=lambda i: -score[i])
    text = {c.index: c.text for c in all3.choices}
    best = client.completions.create(**kw, best_of=3)
    assert [c.text for c in best.choices] == [text[ranked[0]]]
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 18
    two = client.completions.create(**kw, best_of=3, n=2, logprobs=1)
    assert [c.text for c in two.choices] == [text[i] for i in ranked[:2]]
    assert [c.index for c in two.choices] == [0, 1] and two.choices[1].logprobs.tokens


def test_async_client_streamed_and_not(aclient):
    async def go():
        kw = dict(model="volundr", messages=MESSAGES, max_tokens=8, temperature=0.0,
                  extra_body={"ignore_eos": True})
        whole = await aclient.chat.completions.create(**kw)
        stream = await aclient.chat.completions.create(**kw, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        # Several requests at once: continuous batching in one engine.
        many = await asyncio.gather(*[aclient.chat.completions.create(
            model="volundr", messages=[{"role": "user", "content": f"Question {i}"}],
            max_tokens=6, extra_body={"ignore_eos": True}) for i in range(4)])
        return whole, text, many

    whole, text, many = asyncio.run(go())
    assert text == whole.choices[0].message.content
    assert all(r.usage.completion_tokens == 6 for r in many)


def test_completions_streamed_and_not(client):
    kw = dict(model="volundr", prompt="Once upon a time", max_tokens=10, temperature=0.0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    echo = client.completions.create(**kw, echo=True)
    assert echo.choices[0].text == "Once upon a time" + whole.choices[0].text


def test_stop_strings(client):
    kw = dict(model="volundr", messages=MESSAGES, max_tokens=16, temperature=0.0,
              extra_body={"ignore_eos": True})
    text = client.chat.completions.create(**kw).choices[0].message.content
    stop = text[6:9]
    cut = client.chat.completions.create(**kw, stop=[stop, "never-appears"])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text[:text.index(stop)]


def test_tools_reach_the_template(client):
    tools = TOOLS
    kw = dict(model="volundr", messages=MESSAGES, max_tokens=4, temperature=0.0)
    plain = client.chat.completions.create(**kw)
    with_tools = client.chat.completions.create(**kw, tools=tools, tool_choice="auto")
    none = client.chat.completions.create(**kw, tools=tools, tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": "volundr"}).encode(), 400, "messages"),
    (json.dumps({"model": "volundr", "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": "nope", "messages": MESSAGES}).encode(), 404, "does not exist"),
    (json.dumps({"model": "volundr", "messages": MESSAGES, "max_tokens": -5}).encode(), 400,
     "max_tokens"),
    (json.dumps({"model": "volundr", "messages": MESSAGES, "temperature": -0.5}).encode(), 400,
     "temperature"),
    (json.dumps({"model": "volundr", "messages": MESSAGES, "temperature": float("inf")}).encode(),
     400, "temperature"),
    (json.dumps({"model": "volundr", "messages": MESSAGES, "temperature": 2.5}).encode(), 400,
     "temperature"),
    (json.dumps({"model": "volundr", "messages": [{"role": "user",
                                                   "content": "forge " * 3000}]}).encode(),
     400, "context"),
    (b'{"model": "volundr", "messages": [{"role": "user", "content": "\xff\xfe bad"}]}', 400,
     "UTF-8"),
    (b'{"model": "volundr", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "surrogate"),
    (json.dumps({"model": "volundr", "messages": MESSAGES, "n": 17}).encode(), 400,
     "n must be between 1 and 16"),
    (json.dumps({"model": "volundr", "messages": [{"role": "robot", "content": "x"}]}).encode(),
     400, "role"),
    # Values that do not fit Triton's INT32 / INT64 tensors: a 400, not a 500 or a wrapped value
    # (max_tokens 2**32 + 5 used to become 5).
    (json.dumps({"model": "volundr", "messages": MESSAGES, "seed": 10**20}).encode(), 400,
     "seed"),
    (json.dumps({"model": "volundr", "messages": MESSAGES, "max_tokens": 2**32 + 5}).encode(),
     400, "max_tokens"),
    (json.dumps({"model": "volundr", "messages": MESSAGES, "top_k": 3 * 10**9}).encode(), 400,
     "top_k"),
    (json.dumps({"model": "volundr", "messages": MESSAGES, "tool_choice": "bogus"}).encode(),
     400, "tool_choice"),
    (json.dumps({"model": "volundr", "messages": MESSAGES, "tools": TOOLS,
                 "tool_choice": {"type": "function", "function": {"name": "nope"}}}).encode(),
     400, "tool_choice"),
    (json.dumps({"model": "volundr", "messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "x"}}]}).encode(),
     400, "parameters"),
]


@pytest.mark.parametrize("body,status,needle", BAD, ids=[
    "malformed-json", "no-messages", "empty-messages", "unknown-model", "negative-max-tokens",
    "negative-temperature", "infinite-temperature", "temperature-above-2", "prompt-too-long",
    "invalid-utf8", "lone-surrogate", "n17", "role",
    "huge-seed", "max-tokens-past-int32", "huge-top-k", "bad-tool-choice",
    "tool-choice-unknown-function", "tool-parameters-not-an-object"])
def test_bad_input_is_a_clear_4xx_and_serving_goes_on(serving, client, body, status, needle):
    for stream in (False, True):
        if stream:
            try:
                body = json.dumps({**json.loads(body), "stream": True}).encode()
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
        r = httpx.post(f"{serving.proxy_url}/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}
    ok = client.chat.completions.create(model="volundr", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="n must be between 1 and 16") as e:
        client.chat.completions.create(model="volundr", messages=MESSAGES, n=0)
    assert e.value.param == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="volundr", prompt="forge " * 3000)
    assert e.value.code == "context_length_exceeded"


def test_openai_nulls_and_developer_role(serving, client):
    """Fields the OpenAI API marks nullable may be null; `developer` is a system message."""
    body = {"model": "volundr", "messages": MESSAGES, "max_tokens": 2, "n": None,
            "stream": None, "ignore_eos": None}
    r = httpx.post(f"{serving.proxy_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    r = httpx.post(f"{serving.proxy_url}/v1/completions", timeout=60, json={
        "model": "volundr", "prompt": "Once", "max_tokens": 2, "echo": None, "n": None})
    assert r.status_code == 200, r.text
    system = [{"role": "system", "content": "Be terse."}] + MESSAGES
    developer = [{"role": "developer", "content": "Be terse."}] + MESSAGES
    a, b = (client.chat.completions.create(model="volundr", messages=m, max_tokens=1)
            for m in (system, developer))
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_reasoning_effort_is_enable_thinking(client):
    """reasoning_effort none / minimal renders the prompt as enable_thinking false, low to high
    as true (the two prompts differ); another value is a 400 naming it."""
    def prompt_tokens(**kw) -> int:
        return client.chat.completions.create(model="volundr", messages=MESSAGES, max_tokens=1,
                                              **kw).usage.prompt_tokens

    for thinking, efforts in ((False, ("none", "minimal")), (True, ("low", "high"))):
        want = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
        assert all(prompt_tokens(reasoning_effort=e) == want for e in efforts), thinking
    assert prompt_tokens(reasoning_effort="none") != prompt_tokens(reasoning_effort="high")
    with pytest.raises(openai.BadRequestError) as e:
        prompt_tokens(reasoning_effort="extreme")
    assert e.value.param == "reasoning_effort"


def test_named_tool_choice_is_enforced(client):
    """A prefill: the call's opening ends the prompt, so the reply is always that call (the
    tiny model's arguments are noise, and may be invalid JSON)."""
    kw = dict(model="volundr", messages=MESSAGES, max_tokens=6, temperature=0.0, tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "get_weather"}},
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    auto = client.chat.completions.create(**{**kw, "tool_choice": "auto"})
    [call] = whole.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert whole.choices[0].message.content is None
    assert whole.choices[0].finish_reason in ("tool_calls", "length")
    # the prefix is prompt, not completion
    assert whole.usage.completion_tokens == 6
    assert whole.usage.prompt_tokens > auto.usage.prompt_tokens
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == 6
    # the SDK's own stream helper assembles the same call (its get_final_completion raises
    # on finish_reason "length", so the snapshot)
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.current_completion_snapshot
    [streamed] = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (
        "get_weather", call.function.arguments)


CLOSED_TOOLS = [{"type": "function", "function": {
    "name": "set_forge", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["heat", "bellows"],
        "properties": {"heat": {"enum": ["low", "high"]}, "bellows": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "quench", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["oil"],
        "properties": {"oil": {"type": "boolean"}}}}}]


def test_forced_tool_calls_follow_the_tools_schemas(client):
    """A forced call's reply is held to a grammar (volundr.chat.tool_call_grammar): a named
    function's arguments are JSON matching its parameters and the reply ends with the call
    (finish_reason tool_calls), whole and streamed, greedy and sampled; "required" gives
    well-formed calls of the tools, each with matching arguments."""
    kw = dict(model="volundr", messages=MESSAGES, max_tokens=60, tools=CLOSED_TOOLS)
    named = {"type": "function", "function": {"name": "set_forge"}}
    for t in (0.0, 1.0):
        r = client.chat.completions.create(**kw, temperature=t, tool_choice=named)
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert args["heat"] in ("low", "high") and isinstance(args["bellows"], bool)
        assert set(args) == {"heat", "bellows"}
    chunks = list(client.chat.completions.create(**kw, temperature=0.0, tool_choice=named,
                                                 stream=True))
    streamed = "".join(tc.function.arguments or "" for c in chunks if c.choices
                       for tc in c.choices[0].delta.tool_calls or [])
    whole = client.chat.completions.create(**kw, temperature=0.0, tool_choice=named)
    assert streamed == whole.choices[0].message.tool_calls[0].function.arguments
    for seed in range(3):
        r = client.chat.completions.create(**{**kw, "max_tokens": 120}, temperature=1.0,
                                           seed=seed, tool_choice="required")
        calls = r.choices[0].message.tool_calls
        assert calls, r.choices[0].message.content
        for c in calls:
            args = json.loads(c.function.arguments)
            if c.function.name == "set_forge":
                assert set(args) == {"heat", "bellows"} and args["heat"] in ("low", "high")
            else:
                assert c.function.name == "quench" and isinstance(args["oil"], bool)


def test_strict_tools_under_auto(client, tiny_dir):
    """OpenAI's strict function calling: with a `strict` tool under tool_choice auto the reply
    is free text or calls whose arguments match their function's parameters (the grammar
    starts them at the special <tool_call> token; a logit_bias on it makes the random tiny
    model call at once)."""
    open_id = Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).token_to_id("<tool_call>")
    tools = [{**t, "function": {**t["function"], "strict": True}} for t in CLOSED_TOOLS]
    r = client.chat.completions.create(model="volundr", messages=MESSAGES, max_tokens=80,
                                       temperature=0.0, tools=tools,
                                       logit_bias={str(open_id): 100})
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason in ("tool_calls", "length")
    for c in calls:
        args = json.loads(c.function.arguments)
        assert c.function.name in ("set_forge", "quench")
        assert set(args) == ({"heat", "bellows"} if c.function.name == "set_forge" else {"oil"})
    free = client.chat.completions.create(model="volundr", messages=MESSAGES, max_tokens=8,
                                          temperature=0.0, tools=tools,
                                          logit_bias={str(open_id): -100})
    assert free.choices[0].message.content and not free.choices[0].message.tool_calls


def test_structured_outputs_extension(client, tiny_dir):
    """vLLM's structured_outputs (extra_body): choice, regex, json and a Lark grammar; its
    older guided_choice; two at once or a bad grammar is a 400."""
    kw = dict(model="volundr", messages=MESSAGES, max_tokens=30, temperature=1.0)
    for seed in range(3):
        r = client.chat.completions.create(**kw, seed=seed, extra_body={
            "structured_outputs": {"choice": ["anvil", "hammer", "tongs"]}})
        assert r.choices[0].message.content in ("anvil", "hammer", "tongs")
        assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(**kw, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(**kw, extra_body={
        "structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", r.choices[0].message.content)
    r = client.chat.completions.create(**kw, extra_body={"structured_outputs": {"json": {
        "type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
        "additionalProperties": False}}})
    assert isinstance(json.loads(r.choices[0].message.content)["x"], bool)
    c = client.completions.create(model="volundr", prompt="Forge:", max_tokens=20,
                                  extra_body={"structured_outputs": {
                                      "grammar": 'start: "iron" | "steel" " " ("hot" | "cold")'}})
    assert c.choices[0].text in ("iron", "steel hot", "steel cold")
    # thinking asked for: the reasoning first (the think tags forced by logit_bias here), then
    # the form as content, for regex / choice / grammar as for json
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    bias = {str(tok.token_to_id(t)): 100 for t in ("<think>", "</think>")}
    for form, ok in (({"regex": "[0-9]{3}-[a-c]{2}"},
                      lambda t: re.fullmatch("[0-9]{3}-[a-c]{2}", t)),
                     ({"choice": ["anvil", "tongs"]}, lambda t: t in ("anvil", "tongs"))):
        r = client.chat.completions.create(**{**kw, "temperature": 0.0}, logit_bias=bias,
                                           extra_body={"structured_outputs": form,
                                                       "chat_template_kwargs": {
                                                           "enable_thinking": True}})
        m = r.choices[0].message  # (the think block itself: test_serving's grammar test)
        assert r.choices[0].finish_reason == "stop" and ok(m.content), m
    for bad in ({"structured_outputs": {"choice": ["a"], "regex": "b"}},
                {"structured_outputs": {"grammar": "start: ("}},
                {"structured_outputs": {"choice": []}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw, extra_body=bad)
        assert e.value.param == "structured_outputs", e.value


def test_required_tool_choice(client):
    for stream in (False, True):
        r = client.chat.completions.create(model="volundr", messages=MESSAGES, max_tokens=6,
                                           tools=TOOLS, tool_choice="required", stream=stream)
        if stream:
            r = list(r)
            assert r[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
        else:
            assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
            # a call, or (the tiny model writes no valid one) the text after the prefix
            assert r.choices[0].message.tool_calls or \
                r.choices[0].message.content.startswith("<tool_call>")


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/chat/completions", 405),
                                                ("POST", "/v1/embeddings", 404)])
def test_unknown_routes_are_openai_errors(serving, method, path, status):
    r = httpx.request(method, f"{serving.proxy_url}{path}", json={}, timeout=60)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- n choices: n requests for the same prompt, batched by the engine ----------------------

def test_chat_n_choices_seeded(client):
    kw = dict(model="volundr", messages=MESSAGES, n=3, max_tokens=6, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in a.choices)
    single = client.chat.completions.create(**{**kw, "n": 1})
    # the prompt counted once, the completions summed (6 tokens each)
    assert a.usage.prompt_tokens == single.usage.prompt_tokens
    assert a.usage.completion_tokens == 3 * single.usage.completion_tokens == 18
    assert a.usage.total_tokens == a.usage.prompt_tokens + 18
    texts = [c.message.content for c in a.choices]
    assert len(set(texts)) > 1  # choice i is seeded with seed + i: they differ
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in b.choices] == texts  # and the request is reproducible
    for i in range(3):  # choice i is what a single request with seed 7 + i gives
        one = client.chat.completions.create(**{**kw, "n": 1, "seed": 7 + i})
        assert one.choices[0].message.content == texts[i]
    greedy = client.chat.completions.create(**{**kw, "temperature": 0.0, "n": 2})
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_chat_n_streamed(client):
    kw = dict(model="volundr", messages=MESSAGES, n=2, max_tokens=8, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    texts, reasons = {0: "", 1: ""}, {}
    for c in chunks[:-1]:
        [ch] = c.choices
        texts[ch.index] += ch.delta.content or ""
        if ch.finish_reason:
            reasons[ch.index] = ch.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_n(client):
    kw = dict(model="volundr", prompt="Once upon a time", n=2, max_tokens=5, temperature=1.0,
              seed=3, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 10
    texts = {0: "", 1: ""}
    for c in client.completions.create(**kw, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == {c.index: c.text for c in whole.choices}


def _stats(url: str) -> dict:
    async def go():
        async with VolundrTriton(url) as t:
            return await t.stats()
    return asyncio.run(go())


def _idle(url: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = _stats(url)
        if (s["running"] == 0 and s["active_requests"] == 0
                and s["num_blocks_free"] == s["num_blocks_total"]) or \
                time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def test_n_choices_all_aborted_when_the_client_goes(serving, client):
    body = {"model": "volundr", "messages": MESSAGES, "n": 3, "max_tokens": 1500,
            "ignore_eos": True}
    url = f"{serving.proxy_url}/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        seen: set[int] = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) == 3:
                during = _stats(serving.grpc_url)  # still reading: the sequences run
                break  # leaving the loop closes the response: the client is gone
    assert during["running"] == 3, during
    t0 = time.monotonic()
    after = _idle(serving.grpc_url)
    assert after["running"] == 0 and after["active_requests"] == 0, after
    assert after["num_blocks_free"] == after["num_blocks_total"], after
    assert time.monotonic() - t0 < 5  # aborted, not run to their 1500 tokens (~13 s on CPU)
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        httpx.post(url, json=body, timeout=httpx.Timeout(60, read=1.0))
    t0 = time.monotonic()
    after = _idle(serving.grpc_url)
    assert after["running"] == 0 and after["active_requests"] == 0, after
    assert time.monotonic() - t0 < 5
    ok = client.chat.completions.create(model="volundr", messages=MESSAGES, max_tokens=2, n=2)
    assert len(ok.choices) == 2


def test_continue_final_message(client, tiny_dir):
    """vLLM's continue_final_message (with add_generation_prompt false): the reply continues
    the final assistant message: the same tokens as a completion of the prompt rendered up to
    that message's content; without add_generation_prompt false, or without a final assistant
    message, a 400."""
    from volundr.chat import load_chat_template, render_chat

    msgs = MESSAGES + [{"role": "assistant", "content": "Volundr was a smith who"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(model="volundr", messages=msgs, max_tokens=12,
                                       temperature=0.0, extra_body=extra)
    prompt = render_chat(load_chat_template(tiny_dir), msgs, add_generation_prompt=False,
                         continue_final_message=True)
    assert prompt.endswith("Volundr was a smith who")
    c = client.completions.create(model="volundr", prompt=prompt, max_tokens=12,
                                  temperature=0.0)
    assert r.choices[0].message.content == c.choices[0].text
    assert r.usage.prompt_tokens == c.usage.prompt_tokens
    for body, param in (({"continue_final_message": True}, "continue_final_message"),
                        ({"continue_final_message": True, "add_generation_prompt": False,
                          "messages": MESSAGES}, "messages")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="volundr", messages=msgs, max_tokens=4,
                                           extra_body=body)
        assert e.value.param == param


def test_stop_token_ids(client):
    """vLLM's stop_token_ids: a token among them ends the reply ("stop") and is not in its
    text (here the only token a +100 logit_bias lets the model choose); a negative id is a
    400."""
    kw = dict(model="volundr", messages=MESSAGES, max_tokens=8, temperature=0.0,
              logit_bias={"300": 100})
    free = client.chat.completions.create(**kw)
    assert free.choices[0].finish_reason == "length" and free.choices[0].message.content
    r = client.chat.completions.create(**kw, extra_body={"stop_token_ids": [7, 300]})
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.content
    c = client.completions.create(model="volundr", prompt="The forge", max_tokens=8,
                                  temperature=0.0, logit_bias={"300": 100},
                                  extra_body={"stop_token_ids": [300]})
    assert c.choices[0].finish_reason == "stop" and c.choices[0].text == ""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, extra_body={"stop_token_ids": [-1]})
    assert e.value.param == "stop_token_ids"


def test_min_tokens(client, tiny_dir):
    """vLLM's min_tokens: no end-of-sequence token before that many tokens (a +100 bias on
    one makes it the first choice otherwise), then it ends the reply ("stop"); min_tokens
    above max_tokens is a 400 naming it."""
    eos = json.loads((tiny_dir / "config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    kw = dict(model="volundr", max_tokens=16, temperature=0.0, logit_bias={str(eos): 100})
    at_once = client.completions.create(**kw, prompt="The forge")
    assert at_once.choices[0].finish_reason == "stop" and at_once.choices[0].text == ""
    r = client.completions.create(**kw, prompt="The forge", logprobs=0,
                                  extra_body={"min_tokens": 5})
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].logprobs.tokens) == 5
    c = client.chat.completions.create(**kw, messages=MESSAGES, extra_body={"min_tokens": 3})
    assert c.choices[0].finish_reason == "stop" and c.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="volundr", prompt="x", max_tokens=2,
                                  extra_body={"min_tokens": 3})
    assert e.value.param == "min_tokens"
