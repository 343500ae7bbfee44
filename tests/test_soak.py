"""A mixed burst against the real stack (tritonserver + the proxy, the tiny drafter speculating),
through the official `openai` SDK: greedy, seeded, penalized, structured, tool-calling,
logprobs, n > 1, session, completions and Responses API requests at once, with clients that go
away mid-stream and bad requests among them. Every reply must be well formed and the same as
that request's reply when it ran alone; the bad ones are 400s; afterwards the engine is idle
with every KV block and state slot free, and serving goes on."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from test_serving import wait_idle

pytestmark = pytest.mark.server

CHAT = dict(model="volundr", max_tokens=24, temperature=0.0)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["metal", "blows"],
          "properties": {"metal": {"enum": ["iron", "steel"]},
                         "blows": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {
    "name": "quench", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["oil"],
        "properties": {"oil": {"type": "boolean"}}}}}]


def msgs(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request {i}: tell me of the forge at Wayland's."}]


# name -> (endpoint, arguments): each deterministic (greedy or seeded), so alone == in the burst
REQUESTS = {
    "greedy": ("chat", dict(CHAT, messages=msgs(0))),
    "greedy_long_prompt": ("chat", dict(CHAT, messages=msgs(1) * 6)),
    "streamed": ("chat_stream", dict(CHAT, messages=msgs(2))),
    "seeded": ("chat", dict(CHAT, messages=msgs(3), temperature=0.9, seed=5)),
    "penalized": ("chat", dict(CHAT, messages=msgs(4), presence_penalty=1.0,
                               frequency_penalty=0.5)),
    "json": ("chat", dict(CHAT, messages=msgs(5), max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "forge", "schema": SCHEMA}})),
    "tools": ("chat", dict(CHAT, messages=msgs(6), max_tokens=40, tools=TOOLS,
                           tool_choice="required")),
    "logprobs": ("chat", dict(CHAT, messages=msgs(7), logprobs=True, top_logprobs=2)),
    "n2": ("chat", dict(CHAT, messages=msgs(8), n=2, temperature=0.8, seed=9)),
    "completion_stop": ("completion", dict(model="volundr", prompt="The smith said", max_tokens=24,
                                           temperature=0.0, stop=["."])),
    "completion_logprobs": ("completion", dict(model="volundr", prompt="Iron and", max_tokens=12,
                                               temperature=0.0, logprobs=2)),
    "response_tools": ("response", dict(model="volundr", input=msgs(10), max_output_tokens=40,
                                        temperature=0.0, tool_choice="required", tools=[
                                            {"type": "function", **TOOLS[0]["function"]}])),
    "response_stream": ("response_stream", dict(model="volundr", input=msgs(11)[0]["content"],
                                                instructions="Be brief.", temperature=0.0,
                                                max_output_tokens=24)),
}


async def call(c: openai.AsyncOpenAI, kind: str, kw: dict, session: str | None = None) -> dict:
    """The reply's parts that must not depend on what else runs."""
    extra = {"extra_body": {"session_id": session}} if session else {}
    if kind == "completion":
        r = await c.completions.create(**kw, **extra)
        return {"choices": [(x.text, x.finish_reason, x.logprobs and x.logprobs.tokens)
                            for x in r.choices], "usage": r.usage.completion_tokens}
    if kind == "response":
        r = await c.responses.create(**kw, **extra)
        return {"output": [(o.type, getattr(o, "name", None), getattr(o, "arguments", None))
                           for o in r.output], "text": r.output_text, "status": r.status,
                "usage": r.usage.output_tokens}
    if kind == "response_stream":
        text, last = "", None
        async for e in await c.responses.create(**kw, stream=True, **extra):
            text += e.delta if e.type == "response.output_text.delta" else ""
            last = e
        return {"text": text, "final": last.response.output_text, "status": last.response.status}
    if kind == "chat_stream":
        text, finish, n = "", None, 0
        async for ch in await c.chat.completions.create(**kw, stream=True, **extra):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
                n += 1
        return {"choices": [(text, finish)], "chunks": n > 1}
    r = await c.chat.completions.create(**kw, **extra)
    out = []
    for x in r.choices:
        m = x.message
        calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
        lp = [t.token for t in x.logprobs.content] if x.logprobs else None
        out.append((m.content, calls, x.finish_reason, lp))
    return {"choices": out, "usage": r.usage.completion_tokens}


async def walk_away(c: openai.AsyncOpenAI, i: int) -> int:
    """A long stream whose client leaves after three chunks."""
    n = 0
    stream = await c.chat.completions.create(**dict(CHAT, messages=msgs(20 + i),
                                                    max_tokens=1500),
                                             stream=True, extra_body={"ignore_eos": True})
    async for _ in stream:
        n += 1
        if n == 3:
            break
    await stream.close()
    return n


async def bad(c: openai.AsyncOpenAI, kw: dict) -> int:
    try:
        await c.chat.completions.create(**kw)
    except openai.BadRequestError as e:
        return e.status_code
    return 200


def test_mixed_burst(serving):
    async def go():
        c = openai.AsyncOpenAI(base_url=f"{serving.proxy_url}/v1", api_key="none",
                               max_retries=0, timeout=300)
        alone = {}
        for name, (kind, kw) in REQUESTS.items():
            alone[name] = await call(c, kind, kw, "soak-alone" if name == "greedy" else None)
        names = list(REQUESTS)
        burst = await asyncio.gather(
            *(call(c, *REQUESTS[n], "soak-burst" if n == "greedy" else None) for n in names),
            *(walk_away(c, i) for i in range(2)),
            bad(c, dict(CHAT, messages=msgs(30), temperature=5)),
            bad(c, dict(CHAT, messages=msgs(31), response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})),
            bad(c, dict(CHAT, messages=msgs(32), tools=TOOLS, tool_choice={
                "type": "function", "function": {"name": "not_a_tool"}})))
        await c.close()
        return alone, dict(zip(names, burst)), burst[len(names):]

    alone, together, rest = asyncio.run(go())
    assert rest == [3, 3, 400, 400, 400], rest
    for name in REQUESTS:
        assert together[name] == alone[name], name
    text, calls, finish, _ = alone["json"]["choices"][0]
    if finish == "stop":  # (random weights: a value may run past max_tokens)
        assert set(json.loads(text)) == {"metal", "blows"}
    _, calls, finish, _ = alone["tools"]["choices"][0]
    assert calls and all(n == "quench" and isinstance(json.loads(a)["oil"], bool)
                         for n, a in calls if finish == "tool_calls")
    assert len(alone["n2"]["choices"]) == 2 and alone["streamed"]["chunks"]
    assert alone["response_stream"]["text"] == alone["response_stream"]["final"]
    assert any(t == "function_call" and n == "quench" for t, n, _ in
               alone["response_tools"]["output"])
    assert alone["logprobs"]["choices"][0][3] and alone["completion_logprobs"]["choices"][0][2]
    s = wait_idle(serving.grpc_url, 60)
    assert s["running"] == 0 and s["active_requests"] == 0, s
    assert s["num_blocks_free"] == s["num_blocks_total"], s
    assert s["num_slots_free"] == s["num_slots_total"], s
    c = openai.OpenAI(base_url=f"{serving.proxy_url}/v1", api_key="none", max_retries=0)
    assert c.chat.completions.create(**CHAT, messages=msgs(40)).choices[0].message.content
