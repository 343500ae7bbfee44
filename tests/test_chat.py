"""Chat template rendering (roles, tools, tool calls and results, thinking on/off) and parsing."""

from __future__ import annotations

import json

import pytest

from volundr.chat import (
    forced_tool_prefix,
    load_chat_template,
    parse_tool_calls,
    render_chat,
    split_reasoning,
)
from volundr.clients.openai_tool_choice import ForcedArguments
from volundr.converter.tiny import build_tiny
from volundr.converter.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    d = build_tiny(tmp_path_factory.mktemp("chat") / "tiny", preset="draft-tiny")
    return load_chat_template(d)


def test_roles_and_generation_prompt(template):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"}]
    out = render_chat(template, msgs)
    assert out == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                   "<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\nHello.<|im_end|>\n"
                   "<|im_start|>user\nBye<|im_end|>\n"
                   "<|im_start|>assistant\n")
    assert not render_chat(template, msgs, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n")


def test_enable_thinking(template):
    msgs = [{"role": "user", "content": "2+2?"}]
    on = render_chat(template, msgs)
    off = render_chat(template, msgs, enable_thinking=False)
    assert on == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    assert render_chat(template, msgs, enable_thinking=True) == on


def test_tools_tool_calls_and_results(template):
    msgs = [{"role": "system", "content": "Be helpful."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'}]
    out = render_chat(template, msgs, tools=[WEATHER])
    system = out.split("<|im_end|>\n")[0]
    assert system.startswith("<|im_start|>system\nBe helpful.\n\n# Tools")
    assert json.dumps(WEATHER, ensure_ascii=False) in system
    assert '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>' \
        in system
    assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}</tool_call><|im_end|>\n') in out
    assert "<|im_start|>tool\n<tool_response>\n{\"temp\": -3}\n</tool_response><|im_end|>\n" in out
    assert out.endswith("<|im_start|>assistant\n")
    # tools without a system message still get a system turn
    out2 = render_chat(template, msgs[1:2], tools=[WEATHER["function"]])
    assert out2.startswith("<|im_start|>system\n# Tools\n")


def test_tokenizes_specials_as_single_ids(template):
    tok = load_tokenizer()
    text = render_chat(template, [{"role": "user", "content": "hi"}], enable_thinking=False)
    ids = tok.encode(text).ids
    for s in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert tok.token_to_id(s) in ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_content_parts_and_reasoning(template):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok", "reasoning_content": "thinking..."}]
    out = render_chat(template, msgs, add_generation_prompt=False)
    assert "<|im_start|>user\na\nb<|im_end|>" in out
    assert "<|im_start|>assistant\n<think>\nthinking...\n</think>\n\nok<|im_end|>" in out
    # reasoning of turns before the last user message is dropped
    out = render_chat(template, msgs + [{"role": "user", "content": "more"}])
    assert "thinking" not in out


@pytest.mark.parametrize("msgs, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
    ([{"role": "user"}], r"messages\[0\] \(user\): content is required"),
    ([{"role": "user", "content": 5}], "string or a list of parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "image input is not supported"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "expected a part"),
    ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
     "only assistant messages"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "needs function.name"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}], "not valid JSON"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
     "system message must be the first"),
])
def test_bad_messages(template, msgs, match):
    with pytest.raises(ValueError, match=match):
        render_chat(template, msgs)


def test_bad_tools_and_template(template):
    with pytest.raises(ValueError, match="tools must be a list"):
        render_chat(template, [{"role": "user", "content": "x"}], tools={"name": "f"})
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        render_chat(template, [{"role": "user", "content": "x"}], tools=[{"type": "function"}])
    with pytest.raises(ValueError, match=r"tools\[0\]: function.parameters"):
        render_chat(template, [{"role": "user", "content": "x"}], tools=[
            {"type": "function", "function": {"name": "f", "parameters": "not a schema"}}])
    with pytest.raises(ValueError, match="does not compile"):
        render_chat("{% for %}", [{"role": "user", "content": "x"}])


def test_developer_role_is_a_system_message(template):
    as_system = render_chat(template, [{"role": "system", "content": "Be terse."},
                                       {"role": "user", "content": "Hi"}])
    assert render_chat(template, [{"role": "developer", "content": "Be terse."},
                                  {"role": "user", "content": "Hi"}]) == as_system


def test_load_chat_template_errors(tmp_path):
    with pytest.raises(ValueError, match="no chat template"):
        load_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert load_chat_template(tmp_path) == "{{ messages[0].content }}"


def test_parse_tool_calls():
    text = ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>\n<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                     {"name": "now", "arguments": {}}]
    # malformed and unterminated calls stay in the text
    bad = 'x <tool_call>{"name": oops}</tool_call> <tool_call>{"name": "f"'
    assert parse_tool_calls(bad) == (bad, [])
    assert parse_tool_calls("plain answer") == ("plain answer", [])


def test_split_reasoning():
    assert split_reasoning("<think>\nhmm\n</think>\n\nAnswer") == ("hmm", "Answer")
    assert split_reasoning("Answer") == (None, "Answer")
    assert split_reasoning("<think>unfinished") == (None, "<think>unfinished")


# ---- a forced tool_choice: the prompt pre-fills the call's opening --------------------------

NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "Weather in Oslo?"}]


def test_forced_tool_choice_prefills_the_call(template):
    base = render_chat(template, USER, tools=[WEATHER])
    for choice in (None, "none", "auto"):
        assert render_chat(template, USER, tools=[WEATHER], tool_choice=choice) == base
    assert render_chat(template, USER, tools=[WEATHER], tool_choice="required") == \
        base + "<tool_call>"
    named = render_chat(template, USER, tools=[WEATHER], tool_choice=NAMED)
    assert named == base + '<tool_call>{"name": "get_weather", "arguments":'
    # exactly how the template writes an assistant call (which has a space after the colon)
    call = render_chat(template, USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}], tools=[WEATHER])
    assert base + forced_tool_prefix(NAMED) + ' {"city": "Oslo"}}</tool_call>' in call
    # ... and tokenized as the template's call is: the prefix ends at a token boundary (the
    # space goes with the model's ` {"`)
    tok = load_tokenizer()
    whole = tok.encode(forced_tool_prefix(NAMED) + ' {"city": "Oslo"}}').ids
    prefix = tok.encode(forced_tool_prefix(NAMED)).ids
    assert whole[:len(prefix)] == prefix
    odd = {"type": "function", "function": {"name": 'we"ird'}}  # the name is a JSON string
    tools = [{"type": "function", "function": {"name": 'we"ird'}}]
    assert render_chat(template, USER, tools=tools, tool_choice=odd).endswith(
        '<tool_call>{"name": "we\\"ird", "arguments":')
    # thinking off: the template's closed empty block, then the call
    off = render_chat(template, USER, tools=[WEATHER], tool_choice="required",
                      enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>")
    # no generation prompt, nothing to pre-fill
    assert render_chat(template, USER, tools=[WEATHER], add_generation_prompt=False,
                       tool_choice="required") == render_chat(
        template, USER, tools=[WEATHER], add_generation_prompt=False)


def test_forced_tool_choice_closes_a_think_block_the_prompt_opens(template):
    opened = template.replace("{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
                              "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    "
                              "{%- if enable_thinking")
    base = render_chat(opened, USER, tools=[WEATHER])
    assert base.endswith("<|im_start|>assistant\n<think>\n")
    assert render_chat(opened, USER, tools=[WEATHER], tool_choice="required") == \
        base + "</think>\n\n<tool_call>"
    # a <think> in the conversation is not the generation prompt's
    user = [{"role": "user", "content": "What does <think> mean?"}]
    assert render_chat(template, user, tools=[WEATHER], tool_choice="required") == \
        render_chat(template, user, tools=[WEATHER]) + "<tool_call>"


@pytest.mark.parametrize("choice, tools, match", [
    ("required", None, "no tools"),
    ({"type": "function", "function": {"name": "nope"}}, [WEATHER], "not in tools"),
    ({"type": "function"}, [WEATHER], "tool_choice must be"),
    ("sometimes", [WEATHER], "tool_choice must be"),
])
def test_bad_tool_choice(template, choice, tools, match):
    with pytest.raises(ValueError, match=match):
        render_chat(template, USER, tools=tools, tool_choice=choice)


@pytest.mark.parametrize("text, args, closed", [
    (' {"city": "Oslo"}}</tool_call>', '{"city": "Oslo"}', True),
    (' {"city": "Oslo"}}', '{"city": "Oslo"}', False),  # stopped at <|im_end|>
    (' {"city": "Os', '{"city": "Os', False),  # max_tokens
    (' {city: Oslo}}</tool_call>', "{city: Oslo}", True),  # not JSON: as written
    (' {"a": [1, {"b": "}]\\"x"}]} }, "more": 1}</tool_call>junk', '{"a": [1, {"b": "}]\\"x"}]}',
     True),
    (' "a string"}</tool_call>', '"a string"', True),
    (" 42 }</tool_call>", "42", True),
    (" {\"x\": 1</tool_call>", '{"x": 1', True),  # closed without closing the value
    (" {\"x\": 1</tool_", '{"x": 1</tool_', False),  # a tag cut off is text
    ("  \n", "", False),
])
def test_forced_arguments_whole_and_streamed(text, args, closed):
    """The arguments after a named call's prefix; streamed, every cut gives only text that
    stays, and the pieces joined are the whole."""
    whole = ForcedArguments()
    whole.feed(text)
    assert (whole.arguments(final=True), whole.closed) == (args, closed)
    for step in range(1, len(text) + 1):
        a, sent = ForcedArguments(), ""
        for i in range(0, len(text), step):
            a.feed(text[i:i + step])
            now = a.arguments(final=False)
            assert now.startswith(sent), (step, now, sent)
            sent = now
        assert a.arguments(final=True) == args and a.closed == closed, step


def test_continue_final_message(template):
    """vLLM's continue_final_message: the prompt ends right after the final assistant
    message's content (the reply continues it); it needs add_generation_prompt false and a
    final assistant message with content."""
    msgs = [{"role": "user", "content": "Name a metal."},
            {"role": "assistant", "content": "The best metal is"}]
    out = render_chat(template, msgs, add_generation_prompt=False, continue_final_message=True)
    whole = render_chat(template, msgs, add_generation_prompt=False)
    assert out.endswith("The best metal is") and whole.startswith(out) and len(whole) > len(out)
    assert "<|im_start|>assistant\n" in out[-40:]
    with pytest.raises(ValueError, match="add_generation_prompt false"):
        render_chat(template, msgs, continue_final_message=True)
    with pytest.raises(ValueError, match="final assistant message"):
        render_chat(template, msgs[:1], add_generation_prompt=False,
                    continue_final_message=True)
