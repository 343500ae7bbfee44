"""The proxy without a server: 503 when Triton is unreachable, and how tool calls and reasoning
(`<think>...</think>`) in generated text become OpenAI `tool_calls` and `reasoning_content`
(streamed and not), forced tool calls (tool_choice "required" or named: a prefill) included."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from volundr.clients.openai_proxy import ProxyConfig, create_app
from volundr.clients.openai_render import ChatRender
from volundr.clients.openai_schema import ChatRequest
from volundr.clients.triton import Delta
from volundr.serve.stack import free_port

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_triton_unavailable_is_503():
    app = create_app(ProxyConfig(triton_grpc=f"127.0.0.1:{free_port()}"))

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            body = {"model": "volundr", "messages": [{"role": "user", "content": "hi"}]}
            return (await c.post("/v1/chat/completions", json=body),
                    await c.post("/v1/chat/completions", json={**body, "stream": True}),
                    await c.get("/health"))

    plain, streamed, health = asyncio.run(go())
    for r in (plain, streamed, health):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable"


def test_requests_checked_before_triton():
    """Checked in the proxy, before any call to Triton (none runs here)."""
    app = create_app(ProxyConfig(triton_grpc=f"127.0.0.1:{free_port()}"))
    msgs = [{"role": "user", "content": "hi"}]
    bad = [({"stream_options": {"include_usage": True}}, "stream_options"),
           ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
           ({"temperature": 3.0}, "temperature"),
           ({"presence_penalty": 2.5}, "presence_penalty"),
           ({"frequency_penalty": -3}, "frequency_penalty"),
           ({"repetition_penalty": 0}, "repetition_penalty"),
           ({"presence_penalty": "NaN"}, "presence_penalty"),
           ({"logit_bias": {"42": 500}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
           ({"logit_bias": {"-3": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
           ({"tool_choice": "required"}, "needs tools"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "needs json_schema.schema"),
           ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "needs json_schema.schema"),
           ({"response_format": {"type": "grammar"}}, "got 'grammar'"),
           ({"response_format": "json"}, "response_format"),
           ({"response_format": {"type": "json_object"}, "tool_choice": {
               "type": "function", "function": {"name": "f"}}, "tools": [
               {"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "cannot be combined"),
           ({"priority": "high"}, "priority"), ({"priority": 2**31}, "priority"),
           ({"session_id": ""}, "session_id"), ({"session_id": ["a"]}, "session_id"),
           ({"session_id": "s" * 257}, "1 to 256 characters")]

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            return [await c.post("/v1/chat/completions",
                                 json={"model": "volundr", "messages": msgs, **extra})
                    for extra, _ in bad]

    for r, (_, needle) in zip(asyncio.run(go()), bad):
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
    # the defaults pass the checks and reach (the missing) Triton: 503; penalties and JSON
    # response formats too
    bad = [({"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
             "repetition_penalty": 1.0, "stream": True, "stream_options": {},
             "response_format": {"type": "text"}}, ""),
           ({"presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 1.3,
             "logit_bias": {"42": -100, " 7": 3.5}}, ""),
           ({"response_format": {"type": "json_object"}}, ""),
           ({"response_format": {"type": "json_schema", "json_schema": {
               "name": "x", "strict": True, "schema": {"type": "object"}}}}, "")]
    assert [r.status_code for r in asyncio.run(go())] == [503] * 4


def test_completions_options_checked_before_triton():
    """Legacy completions' suffix is a 400, not ignored; best_of below n, above 16 or
    streamed (above n) too; their off / valid values pass (and reach the missing Triton:
    503)."""
    app = create_app(ProxyConfig(triton_grpc=f"127.0.0.1:{free_port()}"))
    cases = [({"suffix": "end"}, 400, "suffix"), ({"best_of": 2, "n": 3}, 400, "best_of"),
             ({"best_of": 17}, 400, "best_of"), ({"best_of": 3, "stream": True}, 400, "best_of"),
             ({"best_of": 3}, 503, ""), ({"best_of": 2, "n": 2, "stream": True}, 503, ""),
             ({"suffix": "", "best_of": 1}, 503, ""), ({"suffix": None, "best_of": None}, 503, "")]

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            return [await c.post("/v1/completions",
                                 json={"model": "volundr", "prompt": "hi", **extra})
                    for extra, _, _ in cases]

    for r, (_, status, needle) in zip(asyncio.run(go()), cases):
        assert r.status_code == status, r.text
        assert needle in r.json()["error"]["message"]
        if needle:
            assert r.json()["error"]["param"] == needle


def deltas(text: str, step: int = 3, reason: str = "stop") -> list[Delta]:
    parts = [text[i:i + step] for i in range(0, len(text), step)]
    return [Delta(p, reason if i == len(parts) - 1 else "", 10, i + 1, i == len(parts) - 1)
            for i, p in enumerate(parts)]


GENERATED = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
             '</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_parsed(stream):
    req = ChatRequest(model="volundr", messages=[{"role": "user", "content": "w?"}], tools=TOOLS,
                      stream=stream)
    r = ChatRender(req, "volundr")
    ds = deltas(GENERATED)
    if not stream:
        out = r.full(ds)["choices"][0]
        assert out["finish_reason"] == "tool_calls"
        assert out["message"]["content"] == "Let me check."
        call = out["message"]["tool_calls"][0]
    else:
        chunks = r.start() + [c for d in ds for c in r.delta(d)] + r.finish(ds[-1])
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert content == "Let me check. "  # streamed as it came, up to the <tool_call>
        assert all("<tool" not in (c["choices"][0]["delta"].get("content") or "")
                   for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        call = [c for c in chunks if "tool_calls" in c["choices"][0]["delta"]][0][
            "choices"][0]["delta"]["tool_calls"][0]
        assert call["index"] == 0
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("parallel", [None, True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel, stream):
    two = GENERATED + '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    req = ChatRequest(model="volundr", messages=[{"role": "user", "content": "w?"}], tools=TOOLS,
                      stream=stream, parallel_tool_calls=parallel)
    r = ChatRender(req, "volundr")
    ds = deltas(two)
    if stream:
        chunks = r.start() + [c for d in ds for c in r.delta(d)] + r.finish(ds[-1])
        calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    else:
        calls = r.full(ds)["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == (
        ["get_weather"] if parallel is False else ["get_weather", "get_time"])


def test_without_tools_the_text_is_kept():
    req = ChatRequest(model="volundr", messages=[{"role": "user", "content": "w?"}], stream=True)
    r = ChatRender(req, "volundr")
    ds = deltas(GENERATED, reason="length")
    chunks = r.start() + [c for d in ds for c in r.delta(d)] + r.finish(ds[-1])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == GENERATED
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_server_errors_map_to_openai_statuses():
    from volundr.clients.openai_proxy import triton_error

    busy = triton_error(RuntimeError("[StatusCode.INTERNAL] server busy: 8 requests in flight "
                                     "(limit 8); retry later"))
    assert (busy.status, busy.code) == (429, "server_busy")
    assert busy.message.startswith("server busy")
    long = triton_error(RuntimeError("prompt too long: the prompt has 9000 tokens"))
    assert (long.status, long.code) == (400, "context_length_exceeded")
    assert triton_error(RuntimeError("invalid request: bad seed")).status == 400
    role = triton_error(RuntimeError("invalid request: messages[1]: unknown role 'x'"))
    assert (role.status, role.param) == (400, "messages")
    assert triton_error(RuntimeError("invalid request: stop strings are too long")).param == "stop"
    assert triton_error(RuntimeError("invalid request: send exactly one of ...")).param is None
    assert triton_error(RuntimeError("something else")).status == 500


def test_unexpected_errors_are_openai_error_json(monkeypatch):
    import volundr.clients.openai_proxy as proxy

    def boom(req):
        raise OverflowError("Python int too large to convert to C long")

    monkeypatch.setattr(proxy, "_tensors", boom)
    app = create_app(ProxyConfig(triton_grpc=f"127.0.0.1:{free_port()}"))

    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            body = {"model": "volundr", "messages": [{"role": "user", "content": "hi"}]}
            return await c.post("/v1/chat/completions", json=body)

    r = asyncio.run(go())
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "OverflowError" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


# ---- reasoning: <think>...</think> -> reasoning_content -------------------------------------

THOUGHT = ("<think>\nThe user asks about Oslo.\n\nCheck the weather.\n</think>\n\n"
           "It is cold in Oslo.")
THOUGHT_TOOL = ('<think>\nMaybe <tool_call>{"name": "get_weather", "arguments": {"city": "Bergen"}}'
                '</tool_call>? No, Oslo.\n</think>\n\n<tool_call>{"name": "get_weather", '
                '"arguments": {"city": "Oslo"}}</tool_call>')
UNFINISHED = "<think>\nStill weighing Oslo against Bergen\n\n"


def chat_render(tools: bool = False, stream: bool = False, **kw) -> ChatRender:
    req = ChatRequest(model="volundr", messages=[{"role": "user", "content": "w?"}],
                      tools=TOOLS if tools else None, stream=stream)
    return ChatRender(req, "volundr", **kw)


def streamed(text: str, step: int, reason: str = "stop", tools: bool = False, **kw):
    """(reasoning, content, tool calls, finish_reason, chunks) of `text` streamed in deltas of
    `step` characters; checks the reasoning is sent as it comes, before any content."""
    r = chat_render(tools, stream=True, **kw)
    ds = deltas(text, step, reason)
    chunks = r.start() + [c for d in ds for c in r.delta(d)] + r.finish(ds[-1])
    got = [c["choices"][0]["delta"] for c in chunks]
    kinds = [k for d in got for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # reasoning first
    calls = [tc for d in got for tc in d.get("tool_calls", [])]
    return ("".join(d.get("reasoning_content", "") for d in got),
            "".join(d.get("content") or "" for d in got), calls,
            chunks[-1]["choices"][0]["finish_reason"], chunks)


def message(text: str, reason: str = "stop", tools: bool = False, **kw) -> tuple[dict, str]:
    out = chat_render(tools, **kw).full(deltas(text, 4, reason))["choices"][0]
    return out["message"], out["finish_reason"]


def test_reasoning_is_split_off():
    msg, reason = message(THOUGHT)
    assert msg == {"role": "assistant", "content": "It is cold in Oslo.",
                   "reasoning_content": "The user asks about Oslo.\n\nCheck the weather."}
    assert reason == "stop"
    for step in range(1, len(THOUGHT) + 1):  # every way the tags can be cut
        reasoning, content, calls, reason, chunks = streamed(THOUGHT, step)
        assert (reasoning, content, calls, reason) == (msg["reasoning_content"], msg["content"],
                                                       [], "stop"), step
        if step < 20:  # streamed while generated: several pieces, all before </think> arrived
            pieces = [c for c in chunks if c["choices"][0]["delta"].get("reasoning_content")]
            assert len(pieces) > 1, step
    # Whitespace before <think> belongs to neither part (as in volundr.chat.split_reasoning).
    for text in (" \n" + THOUGHT, "\n" + THOUGHT):
        assert message(text)[0] == msg
        assert streamed(text, 1)[:2] == (msg["reasoning_content"], msg["content"])


def test_reasoning_then_tool_call():
    msg, reason = message(THOUGHT_TOOL, tools=True)
    assert reason == "tool_calls" and msg["content"] is None
    bergen = '<tool_call>{"name": "get_weather", "arguments": {"city": "Bergen"}}</tool_call>'
    assert msg["reasoning_content"] == f"Maybe {bergen}? No, Oslo."  # not parsed as a call
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("get_weather", {"city": "Oslo"})]
    for step in range(1, len(THOUGHT_TOOL) + 1):
        reasoning, content, calls, reason, _ = streamed(THOUGHT_TOOL, step, tools=True)
        assert (reasoning, content, reason) == (msg["reasoning_content"], "", "tool_calls")
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls] == [(0, "get_weather", {"city": "Oslo"})], step


def test_unfinished_reasoning_is_all_reasoning():
    msg, reason = message(UNFINISHED, reason="length")
    assert msg == {"role": "assistant", "content": None,
                   "reasoning_content": "Still weighing Oslo against Bergen"}
    assert reason == "length"
    for step in range(1, len(UNFINISHED) + 1):
        assert streamed(UNFINISHED, step, reason="length")[:4] == (
            "Still weighing Oslo against Bergen", "", [], "length"), step
    cut = "<think>\nOslo\n</thi"  # max_tokens inside the tag: that was not a tag after all
    assert message(cut, reason="length")[0]["reasoning_content"] == "Oslo\n</thi"
    assert streamed(cut, 1, reason="length")[0] == "Oslo\n</thi"


@pytest.mark.parametrize("text", ["It is cold. <think>not at the start</think>",
                                  " \n <thinking> is no tag", "<thi", "  ", GENERATED])
def test_without_reasoning_everything_is_content(text):
    msg, _ = message(text)
    assert msg == {"role": "assistant", "content": text}  # exactly as without the split
    for step in range(1, len(text) + 1):
        assert streamed(text, step)[:3] == ("", text, []), step


def test_reasoning_split_can_be_turned_off():
    for text in (THOUGHT, UNFINISHED):
        assert message(text, reasoning=False)[0] == {"role": "assistant", "content": text}
        for step in range(1, len(text) + 1):
            assert streamed(text, step, reasoning=False)[:2] == ("", text), step
    msg, reason = message(THOUGHT_TOOL, tools=True, reasoning=False)
    assert msg["content"].startswith("<think>\nMaybe") and len(msg["tool_calls"]) == 2


def test_reasoning_opened_in_prompt():
    """A template that ends the prompt in <think>: the text starts inside the reasoning."""
    text = "The user asks about Oslo.\n</think>\n\nIt is cold in Oslo."
    want = {"role": "assistant", "content": "It is cold in Oslo.",
            "reasoning_content": "The user asks about Oslo."}
    for t in (text, "<think>\n" + text):  # a <think> the model writes anyway is dropped
        assert message(t, reasoning_opened=True)[0] == want
        for step in range(1, len(t) + 1):
            assert streamed(t, step, reasoning_opened=True)[:2] == (
                want["reasoning_content"], want["content"]), step
    assert message(text)[0] == {"role": "assistant", "content": text}  # default: not opened


@pytest.mark.parametrize("split", [True, False])
def test_proxy_config_reaches_the_chat_endpoint(monkeypatch, split):
    """ProxyConfig.reasoning_split, through HTTP, with Triton faked; and the CLI flag."""
    import volundr.clients.openai_proxy as proxy

    class FakeTriton:
        def __init__(self, *a, **kw) -> None:
            pass

        @staticmethod
        def inputs(**fields):
            return fields

        async def stream(self, inputs, request_id=None):
            for d in deltas(THOUGHT, 5):
                yield d

        async def close(self) -> None:
            pass

    monkeypatch.setattr(proxy, "VolundrTriton", FakeTriton)
    app = create_app(ProxyConfig(reasoning_split=split))

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            body = {"model": "volundr", "messages": [{"role": "user", "content": "hi"}]}
            return (await c.post("/v1/chat/completions", json=body),
                    await c.post("/v1/chat/completions", json={**body, "stream": True}))

    whole, sse = asyncio.run(go())
    msg = whole.json()["choices"][0]["message"]
    events = [json.loads(line[6:]) for line in sse.text.splitlines()
              if line.startswith("data: {")]
    got = [e["choices"][0]["delta"] for e in events]
    fields = ("".join(d.get("reasoning_content", "") for d in got),
              "".join(d.get("content") or "" for d in got))
    if split:
        assert msg["reasoning_content"] == "The user asks about Oslo.\n\nCheck the weather."
        assert msg["content"] == "It is cold in Oslo."
        assert fields == (msg["reasoning_content"], msg["content"])
    else:
        assert msg == {"role": "assistant", "content": THOUGHT}
        assert fields == ("", THOUGHT)

    seen = []
    monkeypatch.setattr(proxy, "create_app", lambda cfg: seen.append(cfg))
    monkeypatch.setattr("uvicorn.run", lambda *a, **kw: None)
    proxy.main([] if split else ["--no-reasoning-split"])
    assert seen[0].reasoning_split is split and seen[0].reasoning_opened is False


# ---- a forced tool_choice: the text continues the pre-filled call ---------------------------

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def forced(choice, text: str, step: int, reason: str = "stop", **kw):
    """(message, finish_reason) of the whole text, and what its stream says: (content, tool
    calls reassembled as OpenAI clients do, finish_reason, chunks)."""
    req = ChatRequest(model="volundr", messages=[{"role": "user", "content": "w?"}], tools=TOOLS,
                      tool_choice=choice, stream=True, stream_options={"include_usage": True})
    out = ChatRender(req, "volundr", **kw).full(deltas(text, 4, reason))["choices"][0]
    r, ds = ChatRender(req, "volundr", **kw), deltas(text, step, reason)
    chunks = r.start() + [c for d in ds for c in r.delta(d)] + r.finish(ds[-1])
    calls: dict[int, dict] = {}
    for c in chunks[:-1]:
        for tc in c["choices"][0]["delta"].get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc.get("function", {}).get("name", "")
            call["arguments"] += tc.get("function", {}).get("arguments", "")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ds)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    return out["message"], out["finish_reason"], (
        content, [calls[i] for i in sorted(calls)], chunks[-2]["choices"][0]["finish_reason"],
        chunks)


@pytest.mark.parametrize("text, reason, args, want_reason", [
    (' {"city": "Oslo"}}</tool_call>', "stop", '{"city": "Oslo"}', "tool_calls"),
    (' {"city": "Oslo"}}', "stop", '{"city": "Oslo"}', "tool_calls"),  # ended at <|im_end|>
    (' {"city": "Oslo"}}</tool_call>\nmore', "length", '{"city": "Oslo"}', "tool_calls"),
    (' {"city": "Os', "length", '{"city": "Os', "length"),  # max_tokens cut the call
    (" {city: Oslo}}</tool_call>", "stop", "{city: Oslo}", "tool_calls"),  # not JSON: as is
    ("<think>hm</think>", "stop", "<think>hm</think>", "tool_calls"),  # no reasoning part
])
def test_named_tool_choice(text, reason, args, want_reason):
    for step in (1, 2, 3, 7, len(text)):
        for opened in (False, True):
            msg, why, (content, calls, s_why, chunks) = forced(NAMED, text, step, reason,
                                                               reasoning_opened=opened)
            assert msg["content"] is None and "reasoning_content" not in msg
            [call] = msg["tool_calls"]
            assert call["type"] == "function" and call["id"].startswith("call_")
            assert (call["function"]["name"], call["function"]["arguments"], why) == (
                "get_weather", args, want_reason)
            # streamed: the call's header first (OpenAI's shape), then argument fragments
            first = chunks[1]["choices"][0]["delta"]["tool_calls"][0]
            assert first["function"] == {"name": "get_weather", "arguments": ""}
            assert first["index"] == 0 and first["type"] == "function" and "id" in first
            assert (content, calls, s_why) == ("", [{"name": "get_weather",
                                                     "arguments": args}], want_reason), step


REQUIRED = '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.mark.parametrize("text, reason, content, want_reason", [
    (REQUIRED, "stop", None, "tool_calls"),
    ("\n" + REQUIRED + "\nDone.", "stop", "Done.", "tool_calls"),
    ('{"name": "get_weather", "arguments": {"ci', "length", None, "length"),
    ("{oops}</tool_call>", "stop", None, "stop"),
])
def test_required_tool_choice(text, reason, content, want_reason):
    for step in (1, 3, len(text)):
        msg, why, (s_content, calls, s_why, _) = forced("required", text, step, reason)
        assert why == s_why == want_reason
        if want_reason == "tool_calls":
            assert msg["content"] == content
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in msg["tool_calls"]] == [("get_weather", {"city": "Oslo"})]
            assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
                ("get_weather", {"city": "Oslo"})]
            assert s_content == (content or "")
        else:  # nothing parses as a call: parse_tool_calls' text, the prefix included
            assert msg == {"role": "assistant", "content": "<tool_call>" + text}
            assert (s_content, calls) == ("<tool_call>" + text, [])


def test_forced_tool_choice_reaches_preprocessing():
    """A forced tool_choice travels in chat_template_kwargs (preprocessing pre-fills the call);
    the request's own tool_choice only."""
    from volundr.clients.openai_proxy import _tensors

    def kwargs(**kw):
        req = ChatRequest(model="volundr", messages=[{"role": "user", "content": "w?"}], **kw)
        raw = _tensors(req).get("chat_template_kwargs")
        return raw and json.loads(raw)

    assert kwargs(tools=TOOLS, tool_choice="required") == {"tool_choice": "required"}
    assert kwargs(tools=TOOLS, tool_choice=NAMED,
                  chat_template_kwargs={"enable_thinking": False}) == {
        "enable_thinking": False, "tool_choice": NAMED}
    for choice in (None, "auto", "none"):
        assert kwargs(tools=TOOLS, tool_choice=choice,
                      chat_template_kwargs={"tool_choice": "required"}) is None


def test_priority_and_session_reach_triton():
    """vLLM's `priority` and the `session_id` extension go to the ensemble's inputs (a session
    with choice 0 only); left out, neither is sent."""
    from volundr.clients.openai_proxy import _tensors

    req = ChatRequest(model="volundr", messages=[{"role": "user", "content": "w?"}],
                      priority=-3, session_id="task-7")
    assert _tensors(req)["priority"] == -3 and req.session_id() == "task-7"
    plain = ChatRequest(model="volundr", messages=[{"role": "user", "content": "w?"}])
    assert _tensors(plain)["priority"] is None and plain.session_id() is None


def test_response_format_as_the_json_schema_input():
    """response_format -> the engine's json_schema input (json_object: any object); a JSON
    reply renders the prompt with thinking off unless chat_template_kwargs says otherwise."""
    base = {"model": "volundr", "messages": [{"role": "user", "content": "hi"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [(None, None, None), ({"type": "text"}, None, None),
             ({"type": "json_object"}, {"type": "object"}, {"enable_thinking": False}),
             ({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, schema,
              {"enable_thinking": False})]
    for fmt, want, kwargs in cases:
        req = ChatRequest(**base, **({"response_format": fmt} if fmt else {}))
        req.check()
        got = req.json_schema()
        assert (json.loads(got) if got else None) == want
        assert req.template_kwargs() == kwargs
    req = ChatRequest(**base, response_format={"type": "json_object"},
                      chat_template_kwargs={"enable_thinking": True})
    assert req.template_kwargs() == {"enable_thinking": True}


def test_structured_outputs_as_inputs():
    """vLLM's structured_outputs / guided_* -> (json_schema, grammar): json as schema text,
    choice as a Lark alternation of JSON strings, regex as llguidance's grammar of it, grammar
    as given; at most one of them (response_format included); wrong shapes are 400s."""
    base = {"model": "volundr", "messages": [{"role": "user", "content": "hi"}]}

    def inputs(**extra):
        req = ChatRequest(**base, **extra)
        req.check()
        return req.structured_outputs()

    schema = {"type": "object"}
    assert inputs(structured_outputs={"json": schema}) == (json.dumps(schema), None)
    assert inputs(guided_json='{"type": "integer"}') == ('{"type": "integer"}', None)
    assert inputs(structured_outputs={"choice": ['a "b"', "c"]}) == \
        (None, 'start: "a \\"b\\"" | "c"')
    assert inputs(guided_grammar='start: "x"') == (None, 'start: "x"')
    _, regex = inputs(structured_outputs={"regex": "[0-9]+"})
    assert "[0-9]+" in regex
    assert inputs(structured_outputs={"json": None, "choice": ["a"]})[1] == 'start: "a"'
    assert ChatRequest(**base, guided_choice=["a"]).template_kwargs() == \
        {"enable_thinking": False}
    for extra in ({"structured_outputs": {"choice": ["a"], "regex": "b"}},
                  {"guided_choice": ["a"], "response_format": {"type": "json_object"}},
                  {"structured_outputs": {"choice": [1]}}, {"structured_outputs": "x"},
                  {"structured_outputs": {"yaml": "x"}}, {"guided_regex": ""}):
        with pytest.raises(Exception) as e:
            inputs(**extra)
        assert getattr(e.value, "status", None) == 400, extra
