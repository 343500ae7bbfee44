"""OpenAI's Responses API (POST /v1/responses, volundr.clients.openai_responses) through the
official SDK against the real stack (tritonserver + proxy, the tiny model): the same reply as
the chat request it translates to, its stream of typed events building the same Response (the
SDK's stream helper too), function calls and their outputs in a conversation, by
previous_response_id, stored responses, text.format, logprobs (the message text's tokens only,
whole and streamed), and clear 400s."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.server
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 12}}}}


@pytest.fixture(scope="module")
def client(serving) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serving.proxy_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def eos(tiny_dir) -> int:
    e = json.loads((tiny_dir / "config.json").read_text())["eos_token_id"]
    return e[0] if isinstance(e, list) else e


def _reasoning(resp) -> str | None:
    items = [o for o in resp.output if o.type == "reasoning"]
    return items[0].content[0].text if items else None


def test_response_is_the_chat_reply(client):
    """instructions + input == a system + user chat request: the same text (greedy), the same
    token counts; a reply cut by max_output_tokens is "incomplete"."""
    kw = dict(model="volundr", temperature=0.0, extra_body={"ignore_eos": True})
    resp = client.responses.create(**kw, instructions="Be brief.", max_output_tokens=16,
                                   input="Tell me about Volundr the smith.")
    chat = client.chat.completions.create(**kw, max_tokens=16, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about Volundr the smith."}])
    msg = chat.choices[0].message
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.output_text == (msg.content or "")
    assert _reasoning(resp) == (msg.model_extra or {}).get("reasoning_content")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 16
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + 16
    assert client.responses.retrieve(resp.id).output_text == resp.output_text


def test_streamed_events_build_the_same_response(client, eos):
    """The stream's events in order (created, in_progress, items opened / deltas / closed,
    completed) with sequence numbers 0, 1, ...; their deltas == the final text == the reply
    not streamed; the SDK's stream helper assembles the same Response. A +100 bias on the
    end-of-sequence token after min_tokens ends the reply: "completed"."""
    kw = dict(model="volundr", temperature=0.0, max_output_tokens=32,
              input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
              extra_body={"min_tokens": 6, "logit_bias": {str(eos): 100},
                          "chat_template_kwargs": {"enable_thinking": False}})
    whole = client.responses.create(**kw)
    assert whole.status == "completed" and whole.usage.output_tokens == 6 + 1  # (the EOS)
    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed" and types[-2] == "response.output_item.done"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added and all(i.status == "in_progress" for i in added if i.type == "message")
    assert all(o.status == "completed" for o in final.output if o.type == "message")
    assert deltas == final.output_text == whole.output_text != ""
    assert final.usage.output_tokens == 7 and final.id == events[0].response.id
    with client.responses.stream(**kw) as stream:
        for _ in stream:
            pass
        helper = stream.get_final_response()
    assert helper.output_text == whole.output_text


def test_function_calls_in_a_conversation(client):
    """tool_choice required: a function_call item whose arguments match the tool's
    parameters; its output sent back as a function_call_output item (the whole conversation,
    or by previous_response_id) gives a reply; streamed, the call's argument deltas add up."""
    kw = dict(model="volundr", temperature=0.0, tools=[TOOL], max_output_tokens=64)
    first = client.responses.create(**kw, input="Weather in Oslo?", tool_choice="required")
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    assert first.status == "completed"
    out = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}
    whole = client.responses.create(**kw, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments}, out])
    chained = client.responses.create(**kw, input=[out], previous_response_id=first.id)
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == whole.usage.input_tokens > 0
    assert chained.output_text == whole.output_text
    events = list(client.responses.create(**kw, input="Weather in Oslo?",
                                          tool_choice="required", stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert done and deltas == done[0].arguments == calls[0].arguments
    assert events[-1].response.output[-1].type == "function_call"


def test_text_format_json_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name"],
              "properties": {"name": {"type": "string", "maxLength": 10}}}
    resp = client.responses.create(model="volundr", input="Name a smith.", temperature=0.0,
                                   max_output_tokens=48, text={"format": {
                                       "type": "json_schema", "name": "smith",
                                       "schema": schema, "strict": True}})
    assert resp.status == "completed"
    value = json.loads(resp.output_text)
    assert set(value) == {"name"} and isinstance(value["name"], str)


@pytest.mark.parametrize("kw,param", [
    (dict(input="x", tools=[{"type": "web_search"}]), "tools"),
    (dict(input="x", previous_response_id="resp_missing"), "previous_response_id"),
    (dict(input=[{"type": "file_search_call", "id": "x"}]), "input"),
    (dict(input=[{"role": "robot", "content": "x"}]), "input"),
    (dict(input="x", max_output_tokens=0), "max_output_tokens"),
    (dict(input="x", background=True), "background"),
    (dict(input="x", include="message.output_text.logprobs"), "include"),
    (dict(input="x", top_logprobs=21), "top_logprobs"),
    (dict(input="x", top_logprobs=-1), "top_logprobs"),
    (dict(input="x", top_logprobs=2.5), "top_logprobs"),
    (dict(input="x", top_logprobs="3"), "top_logprobs"),
    (dict(input="x", top_logprobs=True, include=["message.output_text.logprobs"]),
     "top_logprobs"),
    (dict(input="x", reasoning={"effort": "extreme"}), "reasoning"),
])
def test_bad_requests_are_400s(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="volundr", **kw)
    assert e.value.param == param
    assert client.responses.create(model="volundr", input="ok", max_output_tokens=2).output


def test_a_prompt_too_long_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="volundr", input="forge " * 3000)
    assert e.value.code == "context_length_exceeded"


def test_stored_responses(client):
    """store false: not retrievable; stored ones are, until deleted; an unknown model 404s."""
    kept = client.responses.create(model="volundr", input="a", max_output_tokens=2)
    gone = client.responses.create(model="volundr", input="a", max_output_tokens=2,
                                   store=False)
    assert client.responses.retrieve(kept.id).id == kept.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="a")


def test_a_client_leaving_mid_stream_frees_its_sequence(serving, client):
    """A Response stream whose client goes away (streamed or not) aborts its sequence: the
    engine is idle with every KV block free within seconds, not after its 1500 tokens."""
    import time

    import httpx
    from test_serving import engine_stats, wait_idle

    url = f"{serving.proxy_url}/v1/responses"
    body = {"model": "volundr", "input": "Tell me a long story.", "max_output_tokens": 1500,
            "ignore_eos": True}
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: response.") and line.endswith(".delta"):
                during = engine_stats(serving.grpc_url)
                break  # leaving the loop closes the response: the client is gone
    assert during["running"] == 1, during
    for gone in (lambda: None, lambda: httpx.post(url, json=body,
                                                  timeout=httpx.Timeout(60, read=1.0))):
        try:
            gone()
        except httpx.ReadTimeout:
            pass
        t0 = time.monotonic()
        after = wait_idle(serving.grpc_url)
        assert after["running"] == 0 and after["active_requests"] == 0, after
        assert after["num_blocks_free"] == after["num_blocks_total"], after
        assert time.monotonic() - t0 < 5
    assert client.responses.create(model="volundr", input="ok", max_output_tokens=2).output


def test_the_store_drops_the_oldest_beyond_its_bounds():
    from volundr.clients.openai_responses import ResponseStore

    store = ResponseStore(capacity=3, max_chars=2000)
    for i in range(5):
        store.put(f"r{i}", [{"role": "user", "content": "x" * 10}], {"id": f"r{i}"})
    assert list(store.items) == ["r2", "r3", "r4"] and store.get("r1") is None
    store.put("big", [{"role": "user", "content": "y" * 1500}], {"id": "big"})
    assert list(store.items) == ["r3", "r4", "big"]
    store.put("big2", [{"role": "user", "content": "y" * 1500}], {"id": "big2"})
    assert list(store.items) == ["big2"]  # 2000 characters in all at most
    assert store.chars == sum(v[3] for v in store.items.values()) <= 2000
    store.put("huge", [{"role": "user", "content": "z" * 3000}], {"id": "huge"})
    assert not store.items and store.chars == 0  # larger than the bound: not kept
    store.put("a", [], {"id": "a"})
    assert store.delete("a") and not store.delete("a") and store.chars == 0


def test_reasoning_effort_turns_thinking_on_and_off(client):
    """reasoning.effort none / minimal renders the prompt with thinking off, low to high with
    it on: the same prompt and reply as the chat request with that chat_template_kwargs."""
    kw = dict(model="volundr", temperature=0.0, extra_body={"ignore_eos": True})
    seen = set()
    for effort, thinking in (("minimal", False), ("high", True)):
        resp = client.responses.create(**kw, input="Hi", max_output_tokens=8,
                                       reasoning={"effort": effort})
        chat = client.chat.completions.create(
            model="volundr", temperature=0.0, max_tokens=8, messages=[
                {"role": "user", "content": "Hi"}],
            extra_body={"ignore_eos": True,
                        "chat_template_kwargs": {"enable_thinking": thinking}})
        assert resp.usage.input_tokens == chat.usage.prompt_tokens
        assert resp.output_text == (chat.choices[0].message.content or "")
        seen.add(resp.usage.input_tokens)
    assert len(seen) == 2  # (the template renders the two differently)


def test_a_conversation_by_previous_response_id_resumes_its_session(client):
    """From its second turn on, a conversation continued by previous_response_id is an engine
    session: the third turn's prompt up to the end of the second's comes from the state the
    second parked (cached_tokens), and its reply and prompt equal the same conversation sent
    whole (the earlier turns' output items as input), which reads it all."""
    kw = dict(model="volundr", temperature=0.0, max_output_tokens=4,
              extra_body={"ignore_eos": True})
    r1 = client.responses.create(**kw, input="Which tool reads the weather?")
    r2 = client.responses.create(**kw, input="And tomorrow?", previous_response_id=r1.id)
    assert r2.usage.input_tokens_details.cached_tokens == 0  # (the first turn parked nothing)
    r3 = client.responses.create(**kw, input="And after?", previous_response_id=r2.id)
    # (at least the second turn's prompt; its reply's tokens too where the template renders
    # them as generated)
    assert r2.usage.input_tokens <= r3.usage.input_tokens_details.cached_tokens \
        < r3.usage.input_tokens
    items = [{"role": "user", "content": "Which tool reads the weather?"},
             *[o.model_dump(exclude_none=True) for o in r1.output],
             {"role": "user", "content": "And tomorrow?"},
             *[o.model_dump(exclude_none=True) for o in r2.output],
             {"role": "user", "content": "And after?"}]
    whole = client.responses.create(**kw, input=items)
    assert whole.usage.input_tokens_details.cached_tokens == 0
    assert whole.usage.input_tokens == r3.usage.input_tokens
    assert whole.output_text == r3.output_text


LOGPROBS = ["message.output_text.logprobs"]


def _entries(lps) -> list[tuple]:
    """Logprob entries (the SDK's objects of any of its types) as (token, logprob, [(token,
    logprob), ...])."""
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs or []])
            for e in lps]


def _same(got, want) -> None:
    """The same entries: tokens, alternatives' tokens, and values up to 1e-4 (the same
    computation, in requests batched apart)."""
    got, want = _entries(got), _entries(want)
    assert [(t, [a for a, _ in top]) for t, _, top in got] == \
        [(t, [a for a, _ in top]) for t, _, top in want]
    for (_, lp, top), (_, lp2, top2) in zip(got, want):
        assert abs(lp - lp2) < 1e-4 and all(abs(x - y) < 1e-4
                                            for (_, x), (_, y) in zip(top, top2)), (got, want)


def _text_part(resp):
    (msg,) = [o for o in resp.output if o.type == "message"]
    return msg.content[0]


def test_logprobs_are_the_chat_replys(client):
    """include message.output_text.logprobs + top_logprobs 3: the output_text part carries the
    chat reply's logprobs for the same messages, token for token (text, bytes, logprob, the 3
    alternatives); the stored Response keeps them. include alone: the same tokens and values
    without alternatives; top_logprobs alone (as OpenAI answers it) or neither: none."""
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about Volundr the smith."}]
    kw = dict(model="volundr", temperature=0.0,
              extra_body={"ignore_eos": True,
                          "chat_template_kwargs": {"enable_thinking": False}})
    chat = client.chat.completions.create(**kw, max_tokens=12, messages=msgs, logprobs=True,
                                          top_logprobs=3)
    want = chat.choices[0].logprobs.content
    rkw = dict(**kw, instructions="Be brief.", max_output_tokens=12,
               input="Tell me about Volundr the smith.")
    resp = client.responses.create(**rkw, include=LOGPROBS, top_logprobs=3)
    part = _text_part(resp)
    assert part.text == chat.choices[0].message.content != ""
    assert len(part.logprobs) == 12 and resp.top_logprobs == 3
    _same(part.logprobs, want)
    assert [e.bytes for e in part.logprobs] == [e.bytes for e in want]
    assert [[t.bytes for t in e.top_logprobs] for e in part.logprobs] == \
        [[t.bytes for t in e.top_logprobs] for e in want]
    assert all(len(e.top_logprobs) == 3 for e in part.logprobs)
    assert b"".join(bytes(e.bytes) for e in part.logprobs).decode("utf-8", "replace") == \
        part.text
    assert _text_part(client.responses.retrieve(resp.id)).logprobs == part.logprobs
    bare = _text_part(client.responses.create(**rkw, include=LOGPROBS)).logprobs
    assert all(e.top_logprobs == [] for e in bare) and len(bare) == 12
    _same(bare, [e.model_copy(update={"top_logprobs": []}) for e in want])
    alone = client.responses.create(**rkw, top_logprobs=3)
    assert _text_part(alone).logprobs == [] and alone.top_logprobs == 3
    assert _text_part(alone).text == part.text
    assert _text_part(client.responses.create(**rkw)).logprobs == []


def test_streamed_logprobs(client):
    """Streamed: each response.output_text.delta carries its own tokens' logprobs (their
    bytes, from the final part's entries, make up its delta); all of them in order equal the
    Response's not streamed, response.output_text.done's, content_part.done's and the final
    Response's."""
    kw = dict(model="volundr", temperature=0.0, input="Tell me a story.",
              max_output_tokens=16, include=LOGPROBS, top_logprobs=2,
              extra_body={"ignore_eos": True,
                          "chat_template_kwargs": {"enable_thinking": False}})
    whole = _text_part(client.responses.create(**kw)).logprobs
    assert len(whole) == 16
    events = list(client.responses.create(**kw, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp for e in deltas for lp in e.logprobs]
    assert len(deltas) > 1 and all(e.logprobs for e in deltas)
    _same(streamed, whole)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    (part_done,) = [e for e in events if e.type == "response.content_part.done"]
    final = _text_part(events[-1].response)
    assert _entries(done.logprobs) == _entries(streamed) == _entries(part_done.part.logprobs)
    assert final.logprobs == part_done.part.logprobs and final.text == done.text
    at = 0
    for e in deltas:  # each delta's tokens are its text's
        mine = final.logprobs[at:at + len(e.logprobs)]
        at += len(e.logprobs)
        assert b"".join(bytes(x.bytes) for x in mine).decode("utf-8", "replace") == e.delta
    assert at == 16


def test_logprobs_leave_out_reasoning_tokens(client, tiny_dir):
    """reasoning.effort high with the reply's think block forced (+100 on `<think>`, a bias on
    `</think>` that lets some reasoning through first, found with the chat request) and its
    text a choice: the chat reply's logprobs cover every token, the think block's too; the
    Response's output_text only the text's, those after `</think>` less the whitespace ones
    (the text drops whitespace after `</think>`), whole and streamed."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    think, close = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    msgs = [{"role": "user", "content": "Name a metal."}]
    so = {"choice": ["iron ore", "steel bar"]}
    for bias in (5, 6, 4, 7, 3, 8):
        chat = client.chat.completions.create(
            model="volundr", temperature=0.0, max_tokens=40, messages=msgs, logprobs=True,
            top_logprobs=2, reasoning_effort="high",
            logit_bias={str(think): 100, str(close): bias},
            extra_body={"structured_outputs": so})
        m = chat.choices[0].message
        if (m.model_extra or {}).get("reasoning_content") and m.content:
            break
    else:
        pytest.fail("no bias on </think> gave a reply with both reasoning and text")
    every = chat.choices[0].logprobs.content
    tokens = [e.token for e in every]
    assert tokens[0] == "<think>" and tokens.count("</think>") == 1
    after = every[tokens.index("</think>") + 1:]
    while after and not after[0].token.strip():
        after = after[1:]
    assert 2 < tokens.index("</think>") and after
    kw = dict(model="volundr", temperature=0.0, input=msgs, max_output_tokens=40,
              include=LOGPROBS, top_logprobs=2, reasoning={"effort": "high"},
              extra_body={"structured_outputs": so,
                          "logit_bias": {str(think): 100, str(close): bias}})
    resp = client.responses.create(**kw)
    assert _reasoning(resp) == m.model_extra["reasoning_content"]
    part = _text_part(resp)
    assert part.text == m.content
    _same(part.logprobs, after)
    assert "".join(e.token for e in part.logprobs).lstrip() == m.content
    events = list(client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    _same(streamed, after)
    assert any(e.type == "response.reasoning_text.delta" for e in events)


def test_logprobs_of_a_required_call_cut_short(client):
    """tool_choice required pre-fills `<tool_call>`; a call cut by max_output_tokens does not
    parse, so the text is that prefix and the generated text: the logprobs are those of the
    generated tokens only (the prefix is the prompt's)."""
    resp = client.responses.create(model="volundr", temperature=0.0, tools=[TOOL],
                                   tool_choice="required", input="Weather in Oslo?",
                                   max_output_tokens=3, include=LOGPROBS)
    part = _text_part(resp)
    assert len(part.logprobs) == 3 and resp.status == "incomplete"
    joined = b"".join(bytes(e.bytes) for e in part.logprobs).decode("utf-8", "replace")
    assert part.text == "<tool_call>" + joined


def _entry(text: str, raw: bytes | None = None) -> dict:
    raw = text.encode() if raw is None else raw
    return {"token": raw.decode("utf-8", "replace"), "bytes": list(raw), "logprob": -1.0,
            "top_logprobs": []}


def test_text_logprobs_pass_over_what_the_text_leaves_out():
    """TextLogprobs on its own: over a think block, whitespace dropped after it, a character
    split across tokens, tool-call blocks (and the whitespace around them), a stop string's
    token past the text; pieces as streamed or the text whole; where the template opened the
    think block; a call between the reasoning and the text; tool_choice required's
    pre-filled `<tool_call>`; text that does not match (no more entries)."""
    from volundr.clients.openai_responses_events import TextLogprobs

    euro = "\u20ac".encode()
    toks = [_entry("<think>"), _entry("hm"), _entry("</think>"), _entry("\n\nA"),
            _entry("", euro[:1]), _entry("", euro[1:]), _entry(" b <tool_call>"),
            _entry('{"name": "f"}'), _entry("</tool_call>"), _entry("\n"), _entry(" c."),
            _entry(" STOP")]

    def names(es):
        return [e["token"] for e in es]

    def at(es):  # (which of toks)
        return [next(i for i, t in enumerate(toks) if t is e) for e in es]

    lp = TextLogprobs()
    lp.add({"content": toks[:6]})
    assert at(lp.take("A\u20ac")) == [3, 4, 5]
    lp.add({"content": toks[6:]})
    assert at(lp.take(" b ")) == [6]
    assert at(lp.take("c.")) == [10]
    whole = TextLogprobs()
    whole.add({"content": toks})
    assert at(whole.take("A\u20ac b c.")) == [3, 4, 5, 6, 10]
    opened = TextLogprobs()  # (the prompt opened <think>)
    opened.add({"content": [_entry("hm"), _entry("</think>"), _entry("\n"), _entry("ok")]})
    assert names(opened.take("ok")) == ["ok"]
    plain = TextLogprobs()  # no split: the think block is text
    plain.add({"content": toks[:3]})
    assert names(plain.take("<think>hm</think>")) == ["<think>", "hm", "</think>"]
    called = TextLogprobs()  # reasoning, then a call, then text
    called.add({"content": [_entry("<think>"), _entry("r"), _entry("</think>\n"),
                            _entry("<tool_call>"), _entry("{}</tool_call>"), _entry("\nok")]})
    assert names(called.take("ok")) == ["\nok"]
    required = TextLogprobs("<tool_call>")
    required.add({"content": [_entry('{"name": "f"}'), _entry("</tool_call>"), _entry(" ok")]})
    assert names(required.take("ok")) == [" ok"]
    lost = TextLogprobs()
    lost.add({"content": [_entry("abc")]})
    assert names(lost.take("xyz")) == [] and names(lost.take("abc")) == []
