"""A Response's stream of typed events (response.created, response.output_item.added,
response.output_text.delta, ..., response.completed) from the chat path's stream of chunks
(openai_responses.ResponsesCall.events); the message text's share of the chat path's token
logprobs (TextLogprobs), whole or streamed."""

from __future__ import annotations

import codecs
import json
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from volundr.clients.openai_responses import ResponsesCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse(e: dict) -> str:
    """One Server-Sent Event of a Response stream (named by its type)."""
    return f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n"


THINK_CLOSE = "</think>"
TOOL_CALL = ("<tool_call>", "</tool_call>")


def brief(e: dict) -> dict:
    """A token's logprob entry as response.output_text.delta / .done events have it (token,
    logprob, top_logprobs of token and logprob: the SDK's types, no bytes; the output_text
    part's entries have OpenAI's whole form, bytes too, as the chat path gives them)."""
    return {"token": e["token"], "logprob": e["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                             for t in e.get("top_logprobs") or []]}


class TextLogprobs:
    """The message text's share of a reply's token logprobs.

    The chat path's logprobs (its `logprobs.content` entries, whole or a chunk's) cover every
    generated token in order: a leading `<think>`...`</think>` block's, the text's, tool calls'
    (`<tool_call>`...`</tool_call>`), and past a stop string those whose text it cut. A
    Response's output_text carries the text's only (reasoning items and function calls have no
    logprobs). The tokens are laid end to end over the raw generated text (their exact UTF-8
    bytes), and the text's characters are matched to it in order, passing over what the chat
    path leaves out of the text (openai_render, openai_reasoning): before the text's first
    character the reasoning, up to the first `</think>` (opened by `<think>`, or by the
    template in the prompt), tool-call blocks, and whitespace (after `</think>`, around
    calls). A token is the text's when one of its characters (or a byte of one) is
    matched; it goes with the piece of text (a stream's delta) where that first happens, each
    token once. So the entries' tokens join to the text, up to whitespace at its edges that a
    token held with whitespace that was dropped. `prefix`: text that the prompt pre-filled
    before the generated text (tool_choice "required"'s `<tool_call>`), no token's: the text
    starts with it where no call parsed. Text that cannot be matched (not expected) gets no
    more entries."""

    def __init__(self, prefix: str = ""):
        self.raw: list[str] = list(prefix)  # the raw text, a character an element
        self.tokens: list[tuple[dict, int, int]] = []  # (entry, its characters' range in raw)
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.pos = 0  # raw[:pos] is matched or passed over
        self.next = 0  # tokens[:next] are given or passed over
        self.started = False  # a character of the text is matched
        self.lost = False

    def add(self, logprobs: dict | None) -> None:
        """The tokens of a chat logprobs object ({"content": entries}; None: none)."""
        for e in (logprobs or {}).get("content") or []:
            start = len(self.raw)  # (the character a token's first byte is in: a split one's
            # is raw's next, emitted by the byte that completes it)
            b = e.get("bytes")
            self.raw += self.decoder.decode(bytes(b) if b is not None
                                            else e["token"].encode("utf-8"))
            self.tokens.append((e, start, len(self.raw) + bool(self.decoder.getstate()[0])))

    def take(self, text: str) -> list[dict]:
        """The entries of the tokens of the text's next piece `text`."""
        out: list[dict] = []
        for ch in text:
            p = None if self.lost else self._find(ch)
            if p is None:
                self.lost = True
                break
            self.started, self.pos = True, p + 1
            while self.next < len(self.tokens):  # tokens before p: left out; touching it: given
                e, a, b = self.tokens[self.next]
                if a > p:
                    break
                self.next += 1
                if b > p:
                    out.append(e)
        return out

    def _find(self, ch: str) -> int | None:
        """Where in raw the text's next character `ch` is (None: not found)."""
        p = self.pos
        while p is not None and p < len(self.raw):
            if self.raw[p] == ch:
                return p
            p = self._past(p)
        return None

    def _past(self, p: int) -> int | None:
        """Where the text may go on when raw[p] is not its next character: past that
        whitespace character (or U+FFFD), past the tool-call block starting at p, or (before
        the text's first character) past the first `</think>`: the reasoning, opened by
        `<think>` or by the template; None: nowhere."""
        if self.raw[p].isspace() or self.raw[p] == "\ufffd":  # (bytes that are no character:
            return p + 1  # the tokenizer's decoder may count them apart from Python's)
        if "".join(self.raw[p:p + len(TOOL_CALL[0])]) == TOOL_CALL[0]:
            end = "".join(self.raw[p:]).find(TOOL_CALL[1], len(TOOL_CALL[0]))
            return None if end < 0 else p + end + len(TOOL_CALL[1])
        if not self.started:
            end = "".join(self.raw[p:]).find(THINK_CLOSE)
            return None if end < 0 else p + end + len(THINK_CLOSE)
        return None


class ResponseEvents:
    """Chat chunks -> Response stream events: one output item at a time (reasoning, message,
    each function call), opened at its first text and closed when another starts or the reply
    ends."""

    def __init__(self, call: ResponsesCall):
        self.call, self.seq, self.items = call, 0, []
        self.logprobs = call.text_logprobs()  # (None: not asked)
        self.cur: dict | None = None  # the open item
        self.message: dict = {"role": "assistant"}  # the reply as a chat message (stored)
        self.finish, self.usage, self.error = None, None, None

    def _ev(self, kind: str, **kw) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **kw}

    def start(self) -> list[dict]:
        r = self.call.response([], None, None, status="in_progress")
        return [self._ev("response.created", response=r),
                self._ev("response.in_progress", response=r)]

    def _open(self, item: dict) -> list[dict]:
        out = self._close()
        self.cur = item
        self.items.append(item)
        idx = len(self.items) - 1
        out.append(self._ev("response.output_item.added", output_index=idx,
                            item={**item, "content": []} if "content" in item else dict(item)))
        if item["type"] == "message":
            out.append(self._ev("response.content_part.added", item_id=item["id"],
                                output_index=idx, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": [],
                                      "logprobs": []}))
        return out

    def _close(self) -> list[dict]:
        it, self.cur = self.cur, None
        if it is None:
            return []
        idx, out = self.items.index(it), []
        at = dict(item_id=it["id"], output_index=idx)
        if it["type"] == "message":
            it["status"], part = "completed", it["content"][0]
            out += [self._ev("response.output_text.done", **at, content_index=0,
                             text=part["text"],
                             logprobs=[brief(e) for e in part["logprobs"]]),
                    self._ev("response.content_part.done", **at, content_index=0, part=part)]
        elif it["type"] == "reasoning":
            out.append(self._ev("response.reasoning_text.done", **at, content_index=0,
                                text=it["content"][0]["text"]))
        else:
            it["status"] = "completed"
            out.append(self._ev("response.function_call_arguments.done", **at,
                                name=it["name"], arguments=it["arguments"]))
        return out + [self._ev("response.output_item.done", output_index=idx, item=it)]

    def _text(self, kind: str, text: str) -> list[dict]:
        out = []
        if self.cur is None or self.cur["type"] != kind:
            item = ({"id": new_id("msg"), "type": "message", "role": "assistant",
                     "status": "in_progress",
                     "content": [{"type": "output_text", "text": "", "annotations": [],
                                  "logprobs": []}]}
                    if kind == "message" else
                    {"id": new_id("rs"), "type": "reasoning", "summary": [],
                     "content": [{"type": "reasoning_text", "text": ""}]})
            out = self._open(item)
        part = self.cur["content"][0]
        part["text"] += text
        at = dict(item_id=self.cur["id"], output_index=len(self.items) - 1, content_index=0)
        if kind == "message":
            lps = self.logprobs.take(text) if self.logprobs is not None else []
            part["logprobs"] += lps
            return out + [self._ev("response.output_text.delta", **at, delta=text,
                                   logprobs=[brief(e) for e in lps])]
        return out + [self._ev("response.reasoning_text.delta", **at, delta=text)]

    def _call(self, tc: dict) -> list[dict]:
        fn, out = tc.get("function") or {}, []
        if tc.get("id"):  # a call's first delta: its id and name
            out = self._open({"id": new_id("fc"), "type": "function_call",
                              "status": "in_progress", "call_id": tc["id"],
                              "name": fn.get("name", ""), "arguments": ""})
            self.message.setdefault("tool_calls", []).append(
                {"id": tc["id"], "type": "function", "function": {"name": fn.get("name", ""),
                                                                  "arguments": ""}})
        piece = fn.get("arguments") or ""
        if piece and self.cur is not None and self.cur["type"] == "function_call":
            self.cur["arguments"] += piece
            self.message["tool_calls"][-1]["function"]["arguments"] += piece
            out.append(self._ev("response.function_call_arguments.delta",
                                item_id=self.cur["id"], output_index=len(self.items) - 1,
                                delta=piece))
        return out

    def chunk(self, c: dict) -> list[dict]:
        if "error" in c:
            self.error = c["error"]
            return [self._ev("error", code=c["error"].get("code"),
                             message=c["error"].get("message"), param=c["error"].get("param"))]
        if c.get("usage") and not c.get("choices"):
            self.usage = c["usage"]
            return []
        out = []
        for ch in c.get("choices") or []:
            d = ch.get("delta") or {}
            if self.logprobs is not None:  # (a chunk's tokens come with or before their text)
                self.logprobs.add(ch.get("logprobs"))
            for key, kind in (("reasoning_content", "reasoning"), ("content", "message")):
                if d.get(key):
                    self.message[key] = self.message.get(key, "") + d[key]
                    out += self._text(kind, d[key])
            for tc in d.get("tool_calls") or []:
                out += self._call(tc)
            self.finish = ch.get("finish_reason") or self.finish
        return out

    def end(self) -> list[dict]:
        out = self._close()
        if self.error is not None:
            r = self.call.response(self.items, None, self.usage, status="failed")
            r["error"] = {"code": self.error.get("code") or "server_error",
                          "message": self.error.get("message")}
            return out + [self._ev("response.failed", response=r)]
        r = self.call.finished(self.message, self.finish, self.usage, self.items)
        kind = "response.incomplete" if r["status"] == "incomplete" else "response.completed"
        return out + [self._ev(kind, response=r)]
