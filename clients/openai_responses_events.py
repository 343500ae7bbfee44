"""A Response's stream of typed events (response.created, response.output_item.added,
response.output_text.delta, ..., response.completed) from the chat path's stream of chunks
(openai_responses.ResponsesCall.events)."""

from __future__ import annotations

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


class ResponseEvents:
    """Chat chunks -> Response stream events: one output item at a time (reasoning, message,
    each function call), opened at its first text and closed when another starts or the reply
    ends."""

    def __init__(self, call: ResponsesCall):
        self.call, self.seq, self.items = call, 0, []
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
                                part={"type": "output_text", "text": "", "annotations": []}))
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
                             text=part["text"], logprobs=[]),
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
        self.cur["content"][0]["text"] += text
        at = dict(item_id=self.cur["id"], output_index=len(self.items) - 1, content_index=0)
        if kind == "message":
            return out + [self._ev("response.output_text.delta", **at, delta=text, logprobs=[])]
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
