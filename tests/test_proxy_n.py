"""`n` choices without a server: the proxy fans out n requests (Triton faked here) and merges
them: indices, usage (the prompt once, completions summed), per-choice seeds, the interleaved
stream reassembled per index, the n range, and errors / cancellation cancelling every choice."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import volundr.clients.openai_proxy as proxy
from volundr.clients.openai_fanout import FanOut, choice_seed
from volundr.clients.openai_proxy import ProxyConfig, create_app
from volundr.clients.openai_render import ChatRender
from volundr.clients.openai_schema import INT64_MAX, INT64_MIN, APIError, ChatRequest
from volundr.clients.triton import Delta, TritonRequestError
from volundr.serve.stack import free_port

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
MSGS = [{"role": "user", "content": "w?"}]
PROMPT_TOKENS = 11
# What choice i generates (a choice past these repeats them): reasoning then an answer, content
# then a tool call, text cut by max_tokens.
TEXTS = [("<think>\nCold or not?\n</think>\n\nIt is cold in Oslo.", "stop"),
         ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
          "</tool_call>", "stop"),
         ("Oslo lies at the head of a long fjord, and in winter", "length")]


def deltas(text: str, step: int, reason: str) -> list[Delta]:
    parts = [text[i:i + step] for i in range(0, len(text), step)]
    return [Delta(p, reason if i == len(parts) - 1 else "", PROMPT_TOKENS, i + 1,
                  i == len(parts) - 1) for i, p in enumerate(parts)]


class FakeTriton:
    """Choice i (its request id ends in -i) streams TEXTS[i] in pieces of 2 + i characters, one
    piece per event-loop turn (so the choices interleave); `fail` = {i: (k, message)}: choice i
    raises after k pieces. Records each request's inputs and the requests left early."""

    calls: list[tuple[str, dict]] = []
    left_early: list[str] = []
    fail: dict[int, tuple[int, str]] = {}

    def __init__(self, *a, **kw) -> None:
        pass

    @staticmethod
    def inputs(**fields):
        return fields

    async def stream(self, inputs, request_id=None):
        FakeTriton.calls.append((request_id, inputs))
        i = int(request_id.rsplit("-", 1)[1])
        text, reason = TEXTS[i % len(TEXTS)]
        ended = False
        try:
            for k, d in enumerate(deltas(text, 2 + i, reason)):
                await asyncio.sleep(0)
                if i in self.fail and k == self.fail[i][0]:
                    ended = True
                    raise TritonRequestError(self.fail[i][1])
                yield d
            ended = True
        finally:
            if not ended:
                FakeTriton.left_early.append(request_id)

    async def close(self) -> None:
        pass


@pytest.fixture
def post(monkeypatch):
    """post(path, body) -> the httpx response, through the proxy app with Triton faked."""
    monkeypatch.setattr(proxy, "VolundrTriton", FakeTriton)
    FakeTriton.calls, FakeTriton.left_early, FakeTriton.fail = [], [], {}

    def go(path: str, body: dict, cfg: ProxyConfig | None = None) -> httpx.Response:
        async def one():
            app = create_app(cfg or ProxyConfig())
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                return await c.post(path, json={"model": "volundr", **body})
        return asyncio.run(one())
    return go


def events(r: httpx.Response) -> list[dict]:
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def reassemble(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: the message, tool calls and finish_reason an OpenAI client builds from
    the chunks; checks each choice starts with its role chunk and ends with its finish one."""
    out: dict[int, dict] = {}
    for c in chunks:
        if not c["choices"]:
            continue
        [ch] = c["choices"]
        got = out.setdefault(ch["index"], {"reasoning_content": "", "content": "", "calls": {},
                                           "finish_reason": None, "chunks": 0})
        if got["chunks"] == 0:
            assert ch["delta"]["role"] == "assistant"
        assert got["finish_reason"] is None  # nothing after a choice's finish chunk
        got["chunks"] += 1
        got["finish_reason"] = ch["finish_reason"]
        d = ch["delta"]
        got["reasoning_content"] += d.get("reasoning_content") or ""
        got["content"] += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            call = got["calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc.get("function", {}).get("name") or ""
            call["arguments"] += tc.get("function", {}).get("arguments") or ""
    return out


def as_streamed(choice: dict) -> dict:
    """A choice in reassemble()'s terms: a non-streamed one, or a reassembled one (content
    stripped: a stream sends the whitespace before a tool call, which the whole answer drops,
    as with n=1)."""
    if "message" not in choice:
        return {**{k: v for k, v in choice.items() if k != "chunks"},
                "content": choice["content"].strip()}
    m = choice["message"]
    calls = {i: {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for i, c in enumerate(m.get("tool_calls") or [])}
    return {"reasoning_content": m.get("reasoning_content") or "",
            "content": (m.get("content") or "").strip(), "calls": calls,
            "finish_reason": choice["finish_reason"]}


def test_n_range_is_checked_before_triton():
    app = create_app(ProxyConfig(triton_grpc=f"127.0.0.1:{free_port()}"))

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            out = []
            for path, body in (("/v1/chat/completions", {"messages": MSGS}),
                               ("/v1/completions", {"prompt": "Once"})):
                for n in (0, -1, 17, 100, 16):
                    for stream in (False, True):
                        out.append((n, await c.post(path, json={
                            "model": "volundr", **body, "n": n, "stream": stream})))
            return out

    for n, r in asyncio.run(go()):
        if n == 16:  # passes the checks, reaches (the missing) Triton
            assert r.status_code == 503, r.text
            continue
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "n" and err["message"] == f"n must be between 1 and 16, got {n}"


def test_choice_seeds():
    assert [choice_seed(None, i) for i in range(3)] == [None] * 3
    assert [choice_seed(1234, i) for i in range(3)] == [1234, 1235, 1236]
    assert [choice_seed(-2, i) for i in range(3)] == [-2, -1, 0]
    # wraps around within INT64 (the tensor the seed travels in), still distinct
    assert [choice_seed(INT64_MAX - 1, i) for i in range(3)] == [INT64_MAX - 1, INT64_MAX,
                                                                 INT64_MIN]


@pytest.mark.parametrize("seed", [None, 1234])
def test_chat_n_whole_and_streamed(post, seed):
    body = {"messages": MSGS, "tools": TOOLS, "n": 3, "seed": seed, "max_tokens": 40}
    whole = post("/v1/chat/completions", body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    # each choice is rendered exactly as a single choice of its text is
    for i, choice in enumerate(whole["choices"]):
        text, reason = TEXTS[i]
        req = ChatRequest(model="volundr", messages=MSGS, tools=TOOLS)
        alone = ChatRender(req, "volundr").full(deltas(text, 4, reason))["choices"][0]
        assert as_streamed(choice) == as_streamed(alone)
    assert whole["choices"][0]["message"]["reasoning_content"] == "Cold or not?"
    assert whole["choices"][1]["finish_reason"] == "tool_calls"
    assert whole["choices"][2]["finish_reason"] == "length"
    n_out = [len(deltas(t, 2 + i, r)) for i, (t, r) in enumerate(TEXTS)]
    assert whole["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": sum(n_out),
                              "total_tokens": PROMPT_TOKENS + sum(n_out),
                              "prompt_tokens_details": {"cached_tokens": 0}}
    # n requests, distinct ids, choice i seeded with seed + i (or all random)
    ids = [rid for rid, _ in FakeTriton.calls]
    assert len(set(ids)) == 3 and all(rid.startswith("chatcmpl-") for rid in ids)
    seeds = {int(rid.rsplit("-", 1)[1]): f["seed"] for rid, f in FakeTriton.calls}
    assert seeds == {i: None if seed is None else 1234 + i for i in range(3)}

    r = post("/v1/chat/completions", {**body, "stream": True,
                                      "stream_options": {"include_usage": True}})
    chunks = events(r)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    order = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert order[:3] == [0, 1, 2]  # each choice's role chunk first
    assert order != sorted(order)  # interleaved as they came, not one choice after another
    got = reassemble(chunks)
    assert sorted(got) == [0, 1, 2]
    for i, choice in enumerate(whole["choices"]):
        assert as_streamed(got[i]) == as_streamed(choice), i
    # one usage chunk, the last, with the totals; none in the others' usage field
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_n_1_is_as_before(post):
    whole = post("/v1/chat/completions", {"messages": MSGS, "seed": 5})
    [choice] = whole.json()["choices"]
    assert choice["index"] == 0 and [f["seed"] for _, f in FakeTriton.calls] == [5]
    assert whole.json()["usage"]["completion_tokens"] == len(deltas(TEXTS[0][0], 2, "stop"))
    chunks = events(post("/v1/chat/completions", {"messages": MSGS, "stream": True}))
    assert {c["choices"][0]["index"] for c in chunks} == {0} and "usage" not in chunks[-1]


def test_named_tool_choice_per_choice(post):
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": named, "n": 2}
    whole = post("/v1/chat/completions", body).json()
    req = ChatRequest(model="volundr", messages=MSGS, tools=TOOLS, tool_choice=named)
    for i, choice in enumerate(whole["choices"]):
        assert choice["index"] == i and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        alone = ChatRender(req, "volundr").full(deltas(TEXTS[i][0], 5, "stop"))["choices"][0]
        assert as_streamed(choice) == as_streamed(alone)
    got = reassemble(events(post("/v1/chat/completions", {**body, "stream": True})))
    for i, choice in enumerate(whole["choices"]):
        assert as_streamed(got[i]) == as_streamed(choice)


def test_completions_n(post):
    body = {"prompt": "Once", "n": 2, "echo": True}
    whole = post("/v1/completions", body).json()
    assert [(c["index"], c["text"]) for c in whole["choices"]] == [
        (i, "Once" + TEXTS[i][0]) for i in range(2)]
    assert whole["usage"]["prompt_tokens"] == PROMPT_TOKENS
    chunks = events(post("/v1/completions", {**body, "stream": True,
                                             "stream_options": {"include_usage": True}}))
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == {i: c["text"] for i, c in enumerate(whole["choices"])}
    assert chunks[-1]["usage"] == whole["usage"]


def test_an_error_every_choice_shares_is_the_status(post):
    FakeTriton.fail = {i: (0, "prompt too long: the prompt has 9000 tokens") for i in range(3)}
    for stream in (False, True):
        r = post("/v1/chat/completions", {"messages": MSGS, "n": 3, "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert FakeTriton.left_early == []


def test_one_failing_choice_cancels_the_others(post):
    FakeTriton.fail = {1: (3, "engine error: boom")}
    r = post("/v1/chat/completions", {"messages": MSGS, "n": 3})
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    assert sorted(rid[-2:] for rid in FakeTriton.left_early) == ["-0", "-2"]
    FakeTriton.left_early = []
    r = post("/v1/chat/completions", {"messages": MSGS, "n": 3, "stream": True})
    assert r.status_code == 200  # the error came mid-stream: an error event, then [DONE]
    chunks = events(r)
    assert "boom" in chunks[-1]["error"]["message"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert {c["choices"][0]["index"] for c in chunks[:-1]} == {0, 1, 2}
    assert sorted(rid[-2:] for rid in FakeTriton.left_early) == ["-0", "-2"]


def test_cancelling_the_reader_cancels_every_choice():
    """A client gone: the task reading the choices is cancelled (or the fan-out closed), and
    every stream still running is left (VolundrTriton.stream then aborts its sequence)."""
    left: list[int] = []

    async def hangs(i: int):
        try:
            yield Delta(f"choice {i}", "", 3, 1, False)
            await asyncio.Event().wait()
        finally:
            left.append(i)

    async def go(close: bool):
        fan = FanOut([hangs(i) for i in range(4)])
        first = await fan.first()
        if close:
            await fan.aclose()
        else:
            task = asyncio.ensure_future(fan.collect())
            await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0)
        return sorted(i for i, _ in first)

    for close in (True, False):
        left.clear()
        assert asyncio.run(go(close)) == [0, 1, 2, 3]
        assert sorted(left) == [0, 1, 2, 3]


def test_a_disconnected_non_streamed_request_cancels_every_choice():
    left: list[int] = []

    async def hangs(i: int):
        try:
            yield Delta("x", "", 3, 1, False)
            await asyncio.Event().wait()
        finally:
            left.append(i)

    class Gone:
        async def is_disconnected(self) -> bool:
            return True

    async def go():
        fan = FanOut([hangs(i) for i in range(3)])
        with pytest.raises(APIError) as e:
            await proxy._collect(Gone(), fan, [], 3)
        return e.value.status

    assert asyncio.run(go()) == 499 and sorted(left) == [0, 1, 2]


def test_auto_session_ids(post, monkeypatch):
    """--auto-session: a chat turn without a session_id goes to Triton with one derived from
    its conversation's opening (the same for every later turn, another for another opening;
    choice 0 only); an explicit session_id wins; off by default, and not for completions."""
    auto = ProxyConfig(auto_session=True)
    sys_msg = {"role": "system", "content": "You forecast."}
    turn1 = [sys_msg, {"role": "user", "content": "Oslo?"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Cold."},
                     {"role": "user", "content": "And Rome?"}]
    other = [sys_msg, {"role": "user", "content": "Paris?"}]

    def sessions(body, cfg=auto):
        FakeTriton.calls = []
        assert post("/v1/chat/completions", body, cfg).status_code == 200
        return [f.get("session_id") for _, f in sorted(FakeTriton.calls)]

    [a] = sessions({"messages": turn1})
    assert a.startswith("auto-") and sessions({"messages": turn2}) == [a]
    assert sessions({"messages": other})[0] not in (a, None)
    assert sessions({"messages": turn1, "tools": TOOLS})[0] != a
    assert sessions({"messages": turn2, "n": 2}) == [a, None]
    assert sessions({"messages": turn2, "session_id": "mine"}) == ["mine"]
    assert sessions({"messages": turn2}, ProxyConfig()) == [None]
    FakeTriton.calls = []
    post("/v1/completions", {"prompt": "Oslo?"}, auto)
    assert [f.get("session_id") for _, f in FakeTriton.calls] == [None]
    seen = []
    monkeypatch.setattr(proxy, "create_app", lambda cfg: seen.append(cfg))
    monkeypatch.setattr("uvicorn.run", lambda *a, **kw: None)
    proxy.main(["--auto-session"])
    assert seen[0].auto_session is True
