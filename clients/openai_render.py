"""Triton deltas -> OpenAI response objects (chat.completion / text_completion, and chunks).

Chat: a leading `<think>...</think>` goes to `reasoning_content` (openai_reasoning; streamed as
it is generated), the rest to `content`. With `tools`, content is streamed until a `<tool_call>`
starts; the rest is held back, parsed with volundr.chat.parse_tool_calls at the end and sent as
`tool_calls` (finish_reason "tool_calls"). Tool calls are only looked for in the content.

A tool_choice that forces a call pre-fills the call's opening in the prompt (volundr.chat.
forced_tool_prefix), so the generated text continues it and has no reasoning part. "required":
prefix + text is parsed as above, all of it held back while streamed; when nothing parses as a
call, the message is what parse_tool_calls leaves, prefix + text as content (as with "auto",
nothing the model wrote is lost). A named function: always one call with that name (no content),
its arguments read by openai_tool_choice.ForcedArguments (valid JSON or not) and streamed as
they are generated.

`n` choices: one render per choice (its `index`), all under one response id (`share_id`); the
proxy merges their results (`merge_full`) and sends one usage for all (`total_usage`).
"""

from __future__ import annotations

import json
import time
import uuid

from volundr.chat import forced_tool_name, forced_tool_prefix, parse_tool_calls
from volundr.clients.openai_reasoning import ReasoningSplitter, split_all
from volundr.clients.openai_schema import ChatRequest, CompletionRequest, finish_reason
from volundr.clients.openai_tool_choice import ForcedArguments
from volundr.clients.triton import Delta
from volundr.serve.stop import partial_stop_len

TOOL_OPEN = "<tool_call>"


def _usage(last: Delta | None) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: the prompt tokens a session's
    parked state supplied (the rest ran through the model)."""
    n_in = last.num_input_tokens if last else 0
    n_out = last.num_output_tokens if last else 0
    cached = last.num_cached_tokens if last else 0
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _summed(usages: list[dict]) -> dict:
    """The usage of n choices: the prompt counted once (it is the same prompt for each, as
    OpenAI reports n > 1), completion tokens summed over the choices."""
    n_in = max(u["prompt_tokens"] for u in usages)
    n_out = sum(u["completion_tokens"] for u in usages)
    cached = max(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
            "prompt_tokens_details": {"cached_tokens": cached}}


def total_usage(lasts: list[Delta | None]) -> dict:
    """The usage of the choices whose last deltas these are."""
    return _summed([_usage(d) for d in lasts])


def share_id(renders: list) -> list:
    """The renders of one request's choices answer under the first one's id and time."""
    for r in renders[1:]:
        r.id, r.created = renders[0].id, renders[0].created
    return renders


def merge_full(parts: list[dict]) -> dict:
    """One response of the choices' whole ones (`full` of each render, in index order)."""
    return {**parts[0], "choices": [c for p in parts for c in p["choices"]],
            "usage": _summed([p["usage"] for p in parts])}


def _tool_calls(calls: list[dict], indexed: bool) -> list[dict]:
    """OpenAI tool calls of parsed ones (arguments: a dict, or already the text to send)."""
    out = []
    for i, c in enumerate(calls):
        args = c["arguments"]
        tc = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c["name"], "arguments": args if isinstance(args, str)
                           else json.dumps(args, ensure_ascii=False)}}
        out.append({"index": i, **tc} if indexed else tc)
    return out


def _chat_logprobs(entries: list[dict]) -> dict:
    """Chat's logprobs of some tokens (postprocessing gives OpenAI's content entries)."""
    return {"content": entries, "refusal": None}


def _completion_logprobs(entries: list[dict], offset: int) -> dict:
    """Legacy completions' logprobs of some tokens, the first `offset` characters into the
    returned text."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}


class _Logprobs:
    """A choice's token logprobs (Delta.logprobs) on their way to the chunks: held until a
    chunk goes out, then given to the first one (text held back, e.g. a possible tool call,
    keeps them waiting; the last chunk takes the rest)."""

    def __init__(self, on: bool):
        self.on, self.pending = on, []

    def add(self, d: Delta) -> None:
        if self.on and d.logprobs:
            self.pending += d.logprobs

    def attach(self, chunks: list[dict], form) -> list[dict]:
        """chunks with the pending logprobs on the first one that has a choice (form: the
        entries -> the API's logprobs object)."""
        for c in chunks:
            if self.pending and c["choices"]:
                c["choices"][0]["logprobs"] = form(self.pending)
                self.pending = []
        return chunks

    @staticmethod
    def whole(deltas: list[Delta], on: bool, form) -> dict | None:
        """The logprobs object of a whole response, None when not asked."""
        return form([e for d in deltas for e in d.logprobs or []]) if on else None


def _forced_reason(args: ForcedArguments, reason: str) -> str:
    """finish_reason of a named call: "length" when max_tokens cut it before `</tool_call>`
    (as vLLM: a forced call keeps the engine's "length"), else "tool_calls", as this server
    answers calls under "auto" (OpenAI and vLLM answer a named one with "stop")."""
    return "length" if reason == "length" and not args.closed else "tool_calls"


class ChatRender:
    id_prefix = "chatcmpl"

    def __init__(self, req: ChatRequest, model: str, reasoning: bool = True,
                 reasoning_opened: bool = False, index: int = 0):
        """`reasoning`: split `<think>...</think>` off into reasoning_content (off: all text is
        content); `reasoning_opened`: the template opens `<think>` in the prompt; `index`: the
        choice this render is (of n)."""
        self.req, self.model, self.index = req, model, index
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tools = req.tools_active()
        self.opened = reasoning_opened
        forced = req.forced_tool_choice()
        # A forced call: the text continues the pre-filled prefix (no reasoning part).
        self.splitter = ReasoningSplitter(reasoning_opened) if reasoning and not forced else None
        self.name = forced_tool_name(forced)  # a named call: its arguments are read apart
        self.args = ForcedArguments() if self.name else None
        self.args_sent = ""  # the arguments streamed so far
        # "required": the text parsed is the prefix + the generated text, all of it held back
        self.prefix = forced_tool_prefix(forced) if forced == "required" else ""
        self.text = self.prefix  # the content part of the text (without the reasoning)
        self.sent = 0  # characters of self.text already streamed
        self.holding = forced == "required"  # a <tool_call> started: hold the rest for parsing
        self.logprobs = _Logprobs(req.num_logprobs() is not None)

    def _chunk(self, delta: dict, reason: str | None = None) -> dict:
        obj = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.model,
               "choices": [{"index": self.index, "delta": delta, "logprobs": None,
                            "finish_reason": reason}]}
        if self.req.include_usage():
            obj["usage"] = None
        return obj

    def start(self) -> list[dict]:
        out = [self._chunk({"role": "assistant", "content": ""})]
        if self.name:  # OpenAI's first delta of a call: index, id, type, name, no arguments yet
            out.append(self._chunk({"tool_calls": _tool_calls(
                [{"name": self.name, "arguments": ""}], indexed=True)}))
        return out

    def _arguments(self, final: bool) -> list[dict]:
        args = self.args.arguments(final)
        piece, self.args_sent = args[len(self.args_sent):], args
        if not piece:
            return []
        return [self._chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})]

    def delta(self, d: Delta) -> list[dict]:
        self.logprobs.add(d)
        return self.logprobs.attach(self._delta(d), _chat_logprobs)

    def _delta(self, d: Delta) -> list[dict]:
        if self.args is not None:
            self.args.feed(d.text)
            return self._arguments(final=False)
        if self.splitter is None:
            return self._content(d.text)
        reasoning, content = self.splitter.feed(d.text)
        out = [self._chunk({"reasoning_content": reasoning})] if reasoning else []
        return out + self._content(content)

    def _content(self, text: str) -> list[dict]:
        """Chunks for more content text: all of it, except what may be or is a tool call."""
        self.text += text
        end = len(self.text)
        if self.tools and not self.holding:
            at = self.text.find(TOOL_OPEN, self.sent)
            if at >= 0:
                end, self.holding = at, True
            else:
                end -= partial_stop_len(self.text[self.sent:], [TOOL_OPEN])
        elif self.holding:
            end = self.sent
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:end], end
        return [self._chunk({"content": piece})]

    def usage_chunk(self, usage: dict) -> dict:
        obj = self._chunk({})
        obj["choices"], obj["usage"] = [], usage
        return obj

    def finish(self, last: Delta | None, usage: bool = True) -> list[dict]:
        """The last chunks of this choice; `usage`: and the usage chunk (include_usage)."""
        out, reason = [], finish_reason(last.finish_reason if last else "stop")
        if self.args is not None:
            out, reason = self._arguments(final=True), _forced_reason(self.args, reason)
        elif self.splitter is not None:  # release what was held back as a possible tag
            reasoning, content = self.splitter.end()
            if reasoning:
                out.append(self._chunk({"reasoning_content": reasoning}))
            self.text += content
        tail = self.text[self.sent:] if self.args is None else ""
        calls = []
        if self.tools and tail:
            tail, calls = parse_tool_calls(tail)
            calls = self._allowed(calls)
        if tail and (tail.strip() or not calls):
            out.append(self._chunk({"content": tail}))
        if calls:
            out.append(self._chunk({"tool_calls": _tool_calls(calls, indexed=True)}))
            reason = "tool_calls"
        out.append(self._chunk({}, reason))
        out = self.logprobs.attach(out, _chat_logprobs)
        if usage and self.req.include_usage():
            out.append(self.usage_chunk(_usage(last)))
        return out

    def _allowed(self, calls: list[dict]) -> list[dict]:
        """parallel_tool_calls false: the first call only (the rest dropped, as vLLM does)."""
        return calls[:1] if self.req.parallel_tool_calls is False else calls

    def full(self, deltas: list[Delta]) -> dict:
        last = deltas[-1] if deltas else None
        text = self.prefix + "".join(d.text for d in deltas)
        message: dict = {"role": "assistant", "content": text}
        reason = finish_reason(last.finish_reason if last else "stop")
        if self.args is not None:
            args = ForcedArguments()
            args.feed(text)
            message["content"], reason = None, _forced_reason(args, reason)
            message["tool_calls"] = _tool_calls(
                [{"name": self.name, "arguments": args.arguments(final=True)}], indexed=False)
        elif self.splitter is not None:  # (the whole text at once, by the same rules)
            reasoning, rest = split_all(text, self.opened)
            if reasoning is not None:  # without a reasoning part the message is as before
                text = rest
                message["content"], message["reasoning_content"] = text or None, reasoning or None
        if self.tools and self.args is None:
            rest, calls = parse_tool_calls(text)
            calls = self._allowed(calls)
            if calls:
                message["content"] = rest or None
                message["tool_calls"] = _tool_calls(calls, indexed=False)
                reason = "tool_calls"
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": self.index, "message": message,
                             "logprobs": _Logprobs.whole(deltas, self.logprobs.on,
                                                         _chat_logprobs),
                             "finish_reason": reason}],
                "usage": _usage(last)}


class CompletionRender:
    id_prefix = "cmpl"

    def __init__(self, req: CompletionRequest, model: str, index: int = 0):
        self.req, self.model, self.index = req, model, index
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.logprobs = _Logprobs(req.num_logprobs() is not None)
        # text_offset: characters before each token in the returned text
        self.offset = len(req.text()) if req.echo else 0

    def _chunk(self, text: str, reason: str | None = None) -> dict:
        obj = {"id": self.id, "object": "text_completion", "created": self.created,
               "model": self.model,
               "choices": [{"index": self.index, "text": text, "logprobs": None,
                            "finish_reason": reason}]}
        if self.req.include_usage():
            obj["usage"] = None
        return obj

    def start(self) -> list[dict]:
        return [self._chunk(self.req.text())] if self.req.echo else []

    def delta(self, d: Delta) -> list[dict]:
        self.logprobs.add(d)
        return self.logprobs.attach([self._chunk(d.text)] if d.text else [], self._lp)

    def _lp(self, entries: list[dict]) -> dict:
        lp = _completion_logprobs(entries, self.offset)
        self.offset += sum(len(e["token"]) for e in entries)
        return lp

    def usage_chunk(self, usage: dict) -> dict:
        obj = self._chunk("")
        obj["choices"], obj["usage"] = [], usage
        return obj

    def finish(self, last: Delta | None, usage: bool = True) -> list[dict]:
        out = [self._chunk("", finish_reason(last.finish_reason if last else "stop"))]
        out = self.logprobs.attach(out, self._lp)
        if usage and self.req.include_usage():
            out.append(self.usage_chunk(_usage(last)))
        return out

    def full(self, deltas: list[Delta]) -> dict:
        last = deltas[-1] if deltas else None
        text = "".join(d.text for d in deltas)
        if self.req.echo:
            text = self.req.text() + text
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": self.index, "text": text,
                             "logprobs": _Logprobs.whole(deltas, self.logprobs.on, self._lp),
                             "finish_reason": finish_reason(last.finish_reason if last
                                                            else "stop")}],
                "usage": _usage(last)}
