"""The proxy without a server: 503 when Triton is unreachable, and how tool calls in generated
text become OpenAI `tool_calls` (streamed and not)."""

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
    assert triton_error(RuntimeError("something else")).status == 500
