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


def test_requests_checked_before_triton():
    """Checked in the proxy, before any call to Triton (none runs here)."""
    app = create_app(ProxyConfig(triton_grpc=f"127.0.0.1:{free_port()}"))
    msgs = [{"role": "user", "content": "hi"}]
    bad = [({"stream_options": {"include_usage": True}}, "stream_options"),
           ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
           ({"temperature": 3.0}, "temperature")]

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            return [await c.post("/v1/chat/completions",
                                 json={"model": "volundr", "messages": msgs, **extra})
                    for extra, _ in bad]

    for r, (_, needle) in zip(asyncio.run(go()), bad):
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]


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
