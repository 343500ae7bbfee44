"""Chat prompts: render a checkpoint's Jinja chat template, and parse tool calls back out.

`render_chat` works like Hugging Face's `apply_chat_template` (sandboxed Jinja, `tojson`,
`raise_exception`, trim_blocks/lstrip_blocks) after validating OpenAI-style messages: each a dict
with role system|user|assistant|tool (OpenAI's developer is taken as system) and string content
(or a list of text parts, joined with newlines). Bad input raises ValueError with a message fit
for a 400 response.

A `tool_choice` that forces a call ("required", or {"type": "function", "function": {"name":
...}}) is a prefill, not constrained decoding: `render_chat` appends the opening of an assistant
tool call (`forced_tool_prefix`) to the prompt, and the reply is read as if it began with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


def load_chat_template(model_dir: str | Path) -> str:
    """The chat template of a checkpoint: tokenizer_config.json's `chat_template` (a string, or
    a list of {name, template} where "default" is taken), else chat_template.jinja."""
    d = Path(model_dir)
    cfg_path = d / "tokenizer_config.json"
    if cfg_path.exists():
        try:
            tpl = json.loads(cfg_path.read_text(encoding="utf-8")).get("chat_template")
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
        if isinstance(tpl, list):
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default")
        if isinstance(tpl, str) and tpl:
            return tpl
    jinja = d / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    raise ValueError(f"{d}: no chat template (tokenizer_config.json has no chat_template and "
                     "there is no chat_template.jinja)")


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from None


def _content(i: int, m: dict, allow_none: bool) -> str | None:
    c = m.get("content")
    if c is None:
        if allow_none:
            return None
        raise ValueError(f"messages[{i}] ({m['role']}): content is required")
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise ValueError(f"messages[{i}]: content must be a string or a list of parts, "
                         f"not {type(c).__name__}")
    texts = []
    for j, part in enumerate(c):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "image", "input_image"):
            raise ValueError(f"messages[{i}].content[{j}]: image input is not supported by this "
                             "model server yet; send text only")
        else:
            raise ValueError(f"messages[{i}].content[{j}]: expected a part "
                             "{\"type\": \"text\", \"text\": \"...\"}")
    return "\n".join(texts)


def _tool_call(i: int, j: int, call: Any) -> dict:
    """Normalise an OpenAI tool call ({type, id, function: {name, arguments: str}}) or a bare
    {name, arguments} to {"name", "arguments": dict}."""
    f = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise ValueError(f"messages[{i}].tool_calls[{j}]: needs function.name")
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"messages[{i}].tool_calls[{j}]: arguments are not valid JSON "
                             f"({e})") from None
    if not isinstance(args, dict):
        raise ValueError(f"messages[{i}].tool_calls[{j}]: arguments must be a JSON object")
    return {"name": f["name"], "arguments": args}


def validate_messages(messages: Any) -> list[dict]:
    """Checked, normalised copies of OpenAI-style chat messages (content as a string)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system message
            role = "system"
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {role!r}; expected one of "
                             f"{', '.join(ROLES)}")
        calls = m.get("tool_calls") or []
        if calls and role != "assistant":
            raise ValueError(f"messages[{i}]: only assistant messages may have tool_calls")
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}]: tool_calls must be a list")
        content = _content(i, m, allow_none=role == "assistant")
        n = {"role": role, "content": content if content is not None else ""}
        if calls:
            n["tool_calls"] = [_tool_call(i, j, c) for j, c in enumerate(calls)]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if isinstance(m.get(key), str):
                n[key] = m[key]
        out.append(n)
    return out


def validate_tools(tools: Any) -> list[dict] | None:
    """OpenAI function tools as {"type": "function", "function": {...}} (bare functions too)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of function definitions")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"parameters\": {...}}}")
        if isinstance(t, dict) and t.get("type", "function") != "function":
            raise ValueError(f"tools[{i}]: unsupported tool type {t.get('type')!r}")
        if not isinstance(f.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}]: function.parameters must be a JSON Schema object")
        out.append({"type": "function", "function": f})
    return out or None


def forced_tool_name(tool_choice: Any) -> str | None:
    """The function a named tool_choice ({"type": "function", "function": {"name": ...}})
    forces, else None."""
    f = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = f.get("name") if isinstance(f, dict) else None
    return name if isinstance(name, str) else None


def forced_tool_prefix(tool_choice: Any) -> str:
    """What a tool_choice that forces a call pre-fills after the generation prompt ("" for
    none / auto / absent). The Volundr chat format (VOLUNDR.md; the template's assistant turns)
    writes a call as `<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>`, nothing between
    the tag and the JSON: "required" pre-fills the tag, a named function the JSON up to its
    arguments value too. That ends at `"arguments":`, not at the template's space after it:
    the tokenizer merges the space into the next token (` {"`), so a prompt ending in a lone
    space token would be one the model never saw; the model writes ` {...}` itself."""
    if tool_choice == "required":
        return TOOL_CALL_OPEN
    name = forced_tool_name(tool_choice)
    if name is None:
        return ""
    return TOOL_CALL_OPEN + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":'


# llguidance's JSON options: the separators json.dumps (and the template's tojson) writes, no
# other whitespace (flexible whitespace lets a model pad a value with blank lines until
# max_tokens). A tool's arguments also ignore keywords llguidance does not implement (the tools'
# authors did not ask for a grammar: a schema keyword must not fail the request).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_JSON_OPTIONS = {**JSON_OPTIONS, "lenient": True}


def _json_rule(schema: dict, options: dict) -> str:
    """llguidance's Lark rule for a JSON value matching `schema` (its own x-guidance options
    over `options`)."""
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    return "%json " + json.dumps({**schema, "x-guidance": {**options, **own}}, ensure_ascii=False)


def _tag(t: str, specials: Collection[str] | None) -> str:
    """A tag in a grammar: its special token, or its text where the tokenizer has no such
    special token (specials None: all tags are special)."""
    return t if specials is None or t in specials else json.dumps(t)


def _think_rule(specials: Collection[str] | None) -> str:
    """The rule of a reply's reasoning block: `<think>`, any text, `</think>`."""
    return f"think: {_tag('<think>', specials)} /(?s:.*)/ {_tag('</think>', specials)}"


def json_grammar(schema: dict, think: bool = False,
                 specials: Collection[str] | None = None) -> str:
    """The grammar (llguidance's Lark) of a reply that is JSON matching `schema`; think: after
    an optional `<think>...</think>` and whitespace (a chat reply with thinking on: the
    reasoning first, then the value)."""
    if not think:
        return "start: " + _json_rule(schema, JSON_OPTIONS)
    return "\n".join([f"start: think? /[ \\t\\n]*/ {_json_rule(schema, JSON_OPTIONS)}",
                      _think_rule(specials)])


def think_first(grammar: str, specials: Collection[str] | None = None) -> str:
    """`grammar` (llguidance's Lark, or its JSON form {"grammars": [...]}) after an optional
    `<think>...</think>` and whitespace, as json_grammar(think=True) has a schema's value: a
    chat reply with thinking on, the reasoning first. The grammar becomes a nested one that the
    new start rule names (llguidance's `@name`), so its own rules stay as they are."""
    top = None
    if grammar.lstrip().startswith("{"):
        try:
            top = json.loads(grammar)
        except ValueError:
            pass
    if isinstance(top, dict) and isinstance(top.get("grammars"), list) and top["grammars"]:
        inner = [dict(g) for g in top["grammars"]]
    else:
        top, inner = {}, [{"lark_grammar": grammar}]
    name = inner[0].setdefault("name", "reply")
    head = "\n".join([f"start: think? /[ \\t\\n]*/ @{name}", _think_rule(specials)])
    return json.dumps({**top, "grammars": [{"lark_grammar": head}] + inner})


def tool_call_grammar(tools: list | None, tool_choice: Any,
                      specials: Collection[str] | None = None) -> str | None:
    """The grammar (llguidance's Lark) of a reply with tool calls, so the calls are well formed
    and their arguments match the functions' parameters (each function's parameters the root of
    their own %json rule, so their $refs resolve); None where no grammar applies.

    A named tool_choice (read after its prefill, forced_tool_prefix): its arguments value, the
    call's closing `}` and `</tool_call>` (the request then ends). "required" (after
    `<tool_call>`): one call or more of any of the tools, each `{"name": N, "arguments":
    A}</tool_call>`, the next after "\n<tool_call>" (as the template writes them). "auto" (or
    none given) when a function is `strict` (OpenAI's strict function calling): any text,
    after an optional `<think>...</think>`, then optionally such calls, each after
    `<tool_call>` (only where `<tool_call>` is a special token: text cannot spell a call).
    specials: the tokenizer's special tokens (None: the tags are all special); a tag that is
    not one is matched as text."""
    name = forced_tool_name(tool_choice)
    fns = {f["function"]["name"]: f["function"] for f in validate_tools(tools) or []}
    # (free text could spell a call out if the tags were text: strict needs them special)
    strict = (tool_choice in (None, "auto") and any(f.get("strict") is True for f in fns.values())
              and (specials is None or TOOL_CALL_OPEN in specials))
    if tool_choice != "required" and name is None and not strict:
        return None

    def tag(t: str) -> str:
        return _tag(t, specials)

    def arguments(fn: dict) -> str:
        return _json_rule(fn.get("parameters") or {"type": "object"}, TOOL_JSON_OPTIONS)

    if name is not None:
        return f'start: " "? {arguments(fns[name])} "}}" {tag(TOOL_CALL_CLOSE)}'
    calls = f'call ("\\n" {tag(TOOL_CALL_OPEN)} call)*'
    rules = [f"start: {calls}" if not strict else
             f"start: think? text ({tag(TOOL_CALL_OPEN)} {calls})?",
             "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
    if strict:
        rules += [_think_rule(specials), "text: /(?s:.*)/"]
    for i, (n, fn) in enumerate(fns.items()):
        head = json.dumps('{"name": ' + json.dumps(n, ensure_ascii=False) + ', "arguments": ',
                          ensure_ascii=False)
        rules.append(f'call_{i}: {head} {arguments(fn)} "}}" {tag(TOOL_CALL_CLOSE)}')
    return "\n".join(rules)


def validate_tool_choice(tool_choice: Any, tools: list | None) -> None:
    """ValueError unless tool_choice is absent, "none", "auto", "required" or names a function
    of `tools` (a forced call needs tools). The OpenAI proxy checks requests with it too,
    before they reach Triton (its tools not yet validated: entries without a function dict are
    skipped)."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    name = forced_tool_name(tool_choice)
    if tool_choice != "required" and (name is None or tool_choice.get("type") != "function"):
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": '
                         f'"function", "function": {{"name": ...}}}}, got {tool_choice!r}')
    names = [fn.get("name") for t in tools or []
             if isinstance(t, dict) and isinstance(fn := t.get("function", t), dict)]
    if not names:
        raise ValueError("tool_choice forces a tool call, so it needs tools: there are no tools")
    if name is not None and name not in names:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")


def _think_left_open(text: str) -> bool:
    return text.rfind("<think>") > text.rfind("</think>")


def render_chat(template: str, messages: list[dict], tools: list | None = None,
                add_generation_prompt: bool = True, tool_choice: Any = None,
                continue_final_message: bool = False, **kwargs: Any) -> str:
    """The prompt text for `messages` (extra template variables, e.g. enable_thinking=False,
    go through **kwargs). A `tool_choice` that forces a call appends its forced_tool_prefix
    after the generation prompt. continue_final_message (vLLM's; add_generation_prompt
    False): the prompt ends right after the final message's content, an assistant message
    the reply continues (a prefill: "The answer is")."""
    msgs = validate_messages(messages)
    tl = validate_tools(tools)
    validate_tool_choice(tool_choice, tl)
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        if msgs[-1]["role"] != "assistant" or not msgs[-1]["content"]:
            raise ValueError("continue_final_message needs a final assistant message with "
                             "content")
    from jinja2 import TemplateError

    def render(gen: bool) -> str:
        try:
            return _compile(template).render(messages=msgs, tools=tl, add_generation_prompt=gen,
                                             **kwargs)
        except TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None

    prompt = render(add_generation_prompt)
    if continue_final_message:  # cut after the content (the template may strip its ends)
        text = msgs[-1]["content"]
        at, text = next(((prompt.rfind(t), t) for t in (text, text.strip())
                         if t and prompt.rfind(t) >= 0), (-1, text))
        if at < 0:
            raise ValueError("continue_final_message: the chat template does not render the "
                             "final message's content")
        return prompt[:at + len(text)]
    prefix = forced_tool_prefix(tool_choice) if add_generation_prompt else ""
    if prefix:
        # A generation prompt that opens <think> (templates served with the proxy's
        # --reasoning-opened-in-prompt; Volundr's does not, its model opens one itself) is
        # closed first, as Volundr's enable_thinking=false closes an empty block: the forced
        # call is the answer, not part of the reasoning. Only the generation prompt is looked
        # at (the conversation may hold a "<think>"). Volundr's own prompt gets the call right
        # after `<|im_start|>assistant\n`: no reasoning before a forced call.
        base = render(False)
        gen = prompt[len(base):] if prompt.startswith(base) else prompt
        prompt += ("</think>\n\n" if _think_left_open(gen) else "") + prefix
    return prompt


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(text without the tool-call blocks, [{"name", "arguments": dict}, ...]).

    A block whose body is not a JSON object with a string "name" stays in the text unchanged,
    so nothing the model wrote is lost; so does an unterminated <tool_call>.
    """
    calls: list[dict] = []

    def take(m: re.Match) -> str:
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return m.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return m.group(0)
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return m.group(0)
        if not isinstance(args, dict):
            return m.group(0)
        calls.append({"name": obj["name"], "arguments": args})
        return ""

    rest = _TOOL_CALL.sub(take, text)
    return (rest.strip() if calls else rest), calls


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning inside a leading <think>...</think>, or None; the rest of the text)."""
    m = _THINK.match(text)
    if m is None:
        return None, text
    return m.group(1).strip("\n"), text[m.end():]
