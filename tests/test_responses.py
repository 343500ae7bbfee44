"""OpenAI's Responses API (POST /v1/responses, volundr.clients.openai_responses) through the
official SDK against the real stack (tritonserver + proxy, the tiny model): the same reply as
the chat request it translates to, its stream of typed events building the same Response (the
SDK's stream helper too), function calls and their outputs in a conversation, by
previous_response_id, stored responses, text.format, and clear 400s."""

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
    (dict(input="x", include=["message.output_text.logprobs"]), "include"),
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
