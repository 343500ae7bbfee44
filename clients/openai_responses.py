"""OpenAI's Responses API (POST /v1/responses) on top of the chat path: a request's `input` items
and `instructions` become chat messages, its function tools, tool_choice, text.format and
reasoning.effort the chat fields they mean; the chat reply (or its stream of chunks) becomes
the Response's output items (reasoning, message, function_call) or its stream of typed events
(response.created ... response.completed). Responses are kept in memory (`store`, the default)
so that `previous_response_id` continues a conversation and GET /v1/responses/{id} returns one;
from its second turn on such a conversation is an engine session (its turns resume the state the
turn before parked instead of re-reading the history).
Logprobs: `include: ["message.output_text.logprobs"]` (with `top_logprobs` 0-20 alternatives a
token) gives each output_text part the logprobs of the message text's tokens, and each streamed
response.output_text.delta those of its own (reasoning and tool-call tokens are no part of it:
openai_responses_events.TextLogprobs).
Not supported (400): hosted tools (web / file search, computer use, MCP), background mode,
conversations and stored prompts.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from volundr.chat import forced_tool_prefix
from volundr.clients.openai_responses_events import ResponseEvents, TextLogprobs, new_id, sse
from volundr.clients.openai_schema import APIError

# Request fields passed to the chat request as they are (OpenAI's and this server's extensions)
PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "seed", "top_k",
          "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop",
          "logit_bias", "session_id", "priority", "chat_template_kwargs", "min_tokens",
          "stop_token_ids", "structured_outputs")
UNSUPPORTED = ("background", "conversation", "prompt")
# A chat field a 400 names -> the Responses field it came from
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
          "max_tokens": "max_output_tokens",
          "response_format": "text", "reasoning_effort": "reasoning"}
LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for them


def _text_of(parts, where: str) -> str:
    """The text of a content value: a string, or a list of text parts."""
    if isinstance(parts, str):
        return parts
    if isinstance(parts, list) and all(isinstance(p, dict) for p in parts):
        return "".join(str(p.get("text", "")) for p in parts)
    raise APIError(400, f"{where} must be a string or a list of text parts", param="input")


def _content(content, where: str):
    """A message item's content as chat content: a string, or its parts as chat's (whose
    validation joins the text parts and refuses images, volundr.chat.validate_messages)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts",
                       param="input")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            parts.append({"type": "text", "text": str(p.get("text") or p.get("refusal") or "")})
        elif kind == "input_image" and isinstance(p.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        else:
            raise APIError(400, f"{where}.content[{j}]: parts of type {kind!r} are not supported "
                           "(input_text, output_text, input_image with an image_url)",
                           param="input")
    return parts


def to_messages(inp) -> list[dict]:
    """`input` (a string or a list of items) as chat messages: message items by role
    (developer is chat's system), function_call items as the assistant message's tool_calls,
    function_call_output items as tool messages, a reasoning item as the next assistant
    message's reasoning_content."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    msgs: list[dict] = []
    reasoning = None
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, "
                               f"got {role!r}", param="input")
            m = {"role": role, "content": _content(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                m["reasoning_content"], reasoning = reasoning, None
            msgs.append(m)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call needs name and call_id",
                               param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "")}}
            if msgs and msgs[-1]["role"] == "assistant" and reasoning is None:
                msgs[-1].setdefault("tool_calls", []).append(call)  # the same turn's message
            else:
                m = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    m["reasoning_content"], reasoning = reasoning, None
                msgs.append(m)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output needs call_id",
                               param="input")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text_of(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text_of(parts, f"{where}.content")
        else:
            raise APIError(400, f"{where}: items of type {kind!r} are not supported (message, "
                           "function_call, function_call_output, reasoning)", param="input")
    return msgs


def to_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function" or not isinstance(t.get("name"), str):
            raise APIError(400, f"tools[{i}]: only function tools (with a name) are supported, "
                           f"got type {kind!r}", param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict")
              if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def to_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", "
                   "\"name\": ...}", param="tool_choice")


def to_response_format(text) -> dict | None:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise APIError(400, "text.format must be of type text, json_object or json_schema",
                   param="text")


class ResponseStore:
    """Stored responses, the oldest dropped first beyond `capacity` of them or `max_chars` of
    their JSON text in all (an agent's conversation may hold a 262K-token history per turn):
    id -> (the conversation's chat messages up to and including the reply, without
    instructions; the Response object; the engine session its conversation continues)."""

    def __init__(self, capacity: int = 1024, max_chars: int = 256 << 20):
        self.capacity, self.max_chars = capacity, max_chars
        self.items: OrderedDict[str, tuple] = OrderedDict()
        self.chars = 0

    def put(self, rid: str, history: list[dict], response: dict,
            session: str | None = None) -> None:
        self.delete(rid)
        size = len(json.dumps([history, response], ensure_ascii=False, default=str))
        self.items[rid] = (history, response, session, size)
        self.chars += size
        while self.items and (len(self.items) > self.capacity or self.chars > self.max_chars):
            self.chars -= self.items.popitem(last=False)[1][3]

    def get(self, rid: str) -> tuple[list[dict], dict, str | None] | None:
        """(history, response, session) of a stored response, or None."""
        found = self.items.get(rid)
        return None if found is None else found[:3]

    def delete(self, rid: str) -> bool:
        found = self.items.pop(rid, None)
        if found is not None:
            self.chars -= found[3]
        return found is not None


def output_items(message: dict, logprobs: TextLogprobs | None = None) -> list[dict]:
    """A chat reply's message as Response output items, in order: reasoning, text, calls;
    `logprobs`: the text's (the reply's tokens added), None: not asked."""
    items = []
    if message.get("reasoning_content"):
        items.append({"id": new_id("rs"), "type": "reasoning", "summary": [],
                      "content": [{"type": "reasoning_text",
                                   "text": message["reasoning_content"]}]})
    if message.get("content"):
        items.append({"id": new_id("msg"), "type": "message", "role": "assistant",
                      "status": "completed",
                      "content": [{"type": "output_text", "text": message["content"],
                                   "annotations": [], "logprobs": [] if logprobs is None
                                   else logprobs.take(message["content"])}]})
    for tc in message.get("tool_calls") or []:
        items.append({"id": new_id("fc"), "type": "function_call", "status": "completed",
                      "call_id": tc["id"], "name": tc["function"]["name"],
                      "arguments": tc["function"]["arguments"]})
    return items


def usage_of(u: dict | None) -> dict | None:
    if not u:
        return None
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {
                "cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)}}


class ResponsesCall:
    """One POST /v1/responses: its chat request body (`chat`) and the Response it becomes."""

    def __init__(self, body: dict, store: ResponseStore, model: str):
        for k in UNSUPPORTED:
            if body.get(k):
                raise APIError(400, f"{k} is not supported by this server", param=k)
        include, top = body.get("include"), body.get("top_logprobs")
        if include is not None and not (isinstance(include, list)
                                        and all(isinstance(k, str) for k in include)):
            raise APIError(400, "include must be a list of strings", param="include")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= 20):
            raise APIError(400, f"top_logprobs must be an integer from 0 to 20, got {top!r}",
                           param="top_logprobs")
        # As OpenAI: logprobs come with include's "message.output_text.logprobs", each token
        # with top_logprobs alternatives (none without it); top_logprobs alone returns none
        # (output_text's logprobs stay []), as OpenAI answers it too, so code written against
        # OpenAI (whose docs ask for include) gets what it gets there, and the engine is not
        # asked for logprobs nobody reads. (Other include values are accepted and ignored.)
        self.logprobs = LOGPROBS in (include or ())
        self.body, self.store, self.model = body, store, model
        self.id, self.created = new_id("resp"), int(time.time())
        prev = body.get("previous_response_id")
        history, self.session = [], None
        if prev is not None:
            found = store.get(prev) if isinstance(prev, str) else None
            if found is None:
                raise APIError(400, f"Previous response with id '{prev}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history = [dict(m) for m in found[0]]
            # A conversation continued by previous_response_id is an engine session from its
            # second turn on (its first turn may be a one-off: parking its state would cost
            # every request): each later turn resumes the state the turn before parked
            # instead of re-reading the history (volundr.session). session_id overrides.
            self.session = found[2] or f"resp-{prev}"
        if "input" not in body:
            raise APIError(400, "input is required", param="input")
        self.history = history + to_messages(body["input"])  # (stored: no instructions)
        msgs = list(self.history)
        if body.get("instructions"):
            msgs.insert(0, {"role": "system", "content": str(body["instructions"])})
        chat = {k: body[k] for k in PASSED if body.get(k) is not None}
        if self.session is not None:
            chat.setdefault("session_id", self.session)
        self.session = chat.get("session_id")
        chat["messages"] = msgs
        if (tools := to_tools(body.get("tools"))) is not None:
            chat["tools"] = tools
        if (choice := to_tool_choice(body.get("tool_choice"))) is not None:
            chat["tool_choice"] = choice
        if body.get("max_output_tokens") is not None:
            chat["max_completion_tokens"] = body["max_output_tokens"]
        if (fmt := to_response_format(body.get("text"))) is not None:
            chat["response_format"] = fmt
        reasoning = body.get("reasoning")
        if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]  # (ChatRequest: thinking on / off)
        if chat.get("stream"):
            chat["stream_options"] = {"include_usage": True}
        if self.logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, top or 0
        self.chat = chat

    def text_logprobs(self) -> TextLogprobs | None:
        """A new tracker of the message text's logprobs (None: not asked). tool_choice
        "required" pre-fills `<tool_call>` (a forced call's opening) before what is generated."""
        if not self.logprobs:
            return None
        required = self.chat.get("tool_choice") == "required" and self.chat.get("tools")
        return TextLogprobs(forced_tool_prefix("required") if required else "")

    def response(self, output: list[dict], finish: str | None, usage: dict | None,
                 status: str | None = None) -> dict:
        b = self.body
        status = status or ("incomplete" if finish == "length" else "completed")
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "model": self.model, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": b.get("reasoning"), "store": b.get("store", True) is not False,
            "temperature": b.get("temperature"), "text": b.get("text") or {"format": {
                "type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "top_logprobs": b.get("top_logprobs"), "top_p": b.get("top_p"),
            "truncation": b.get("truncation", "disabled"), "usage": usage_of(usage),
            "metadata": b.get("metadata") or {}, "user": b.get("user")}

    def finished(self, message: dict, finish: str | None, usage: dict | None,
                 output: list[dict] | None = None, logprobs: dict | None = None) -> dict:
        """The Response of a chat reply (its message and, where not streamed, its choice's
        logprobs object; `output`: its items as streamed, else made from the message), stored
        unless store is false."""
        if output is None:
            text = self.text_logprobs()
            if text is not None:
                text.add(logprobs)
            output = output_items(message, text)
        resp = self.response(output, finish, usage)
        if resp["store"]:
            reply = {k: v for k, v in message.items() if v is not None}
            self.store.put(self.id, self.history + [reply], resp, self.session)
        return resp

    async def events(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The chat stream's SSE lines (`data: {chunk}`) as the Response's SSE events."""
        conv = ResponseEvents(self)
        for e in conv.start():
            yield sse(e)
        async for line in chunks:
            if not line.startswith("data: {"):
                continue  # ([DONE]: a Response stream just ends)
            for e in conv.chunk(json.loads(line[6:])):
                yield sse(e)
        for e in conv.end():
            yield sse(e)
