"""Split generated chat text into reasoning and answer, incrementally (as DeepSeek's API and
vLLM's reasoning parsers do): `<think>...</think>` at the start of the text is the reasoning
(`reasoning_content`), the rest, leading whitespace dropped, is the answer (`content`).

The result equals volundr.chat.split_reasoning on the whole text (reasoning with its leading and
trailing newlines stripped), however the text is cut into deltas: text that may still turn out
to be (part of) a tag, or newlines that may end up right before `</think>`, is held back until
the next delta decides. Text that does not start with `<think>` (after whitespace) is all answer.

`opened`: the chat template opens `<think>` in the generation prompt itself, so the generated
text starts inside the reasoning (a `<think>` the model repeats anyway is dropped). The Volundr
template does not do that (the model writes `<think>` itself; enable_thinking=false pre-fills a
closed, empty block), so it is off by default; see ProxyConfig.reasoning_opened.
"""

from __future__ import annotations

import argparse

from volundr.serve.stop import partial_stop_len

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# States: deciding whether the text opens with <think>; inside the reasoning; after </think>
# (dropping whitespace); and plain answer text.
_START, _INSIDE, _AFTER, _CONTENT = "start", "inside", "after", "content"


class ReasoningSplitter:
    def __init__(self, opened: bool = False) -> None:
        self.opened = opened
        self.state = _START
        self.buf = ""  # text received but not yet released
        self.reasoning_started = False  # a reasoning character was released (stop lstrip)
        self.found = False  # the text has a reasoning part (opened, or started with <think>)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can be released now that `text` has arrived."""
        self.buf += text
        reasoning, content = [], []
        while True:  # each pass either changes state or releases what it can and stops
            if self.state == _START:
                s = self.buf.lstrip()
                if not s or (len(s) < len(THINK_OPEN) and THINK_OPEN.startswith(s)):
                    break  # only whitespace, or a possible partial "<think>": wait
                if s.startswith(THINK_OPEN):
                    self.buf, self.state, self.found = s[len(THINK_OPEN):], _INSIDE, True
                elif self.opened:
                    self.state, self.found = _INSIDE, True
                else:
                    self.state = _CONTENT  # no reasoning: everything, whitespace too, is content
            elif self.state == _INSIDE:
                if not self.reasoning_started:
                    self.buf = self.buf.lstrip("\n")
                at = self.buf.find(THINK_CLOSE)
                if at >= 0:
                    reasoning.append(self._release(self.buf[:at].rstrip("\n")))
                    self.buf, self.state = self.buf[at + len(THINK_CLOSE):], _AFTER
                    continue
                # Hold a possible partial "</think>" and the newlines before it: both vanish
                # if the tag completes.
                end = len(self.buf) - partial_stop_len(self.buf, [THINK_CLOSE])
                while end > 0 and self.buf[end - 1] == "\n":
                    end -= 1
                reasoning.append(self._release(self.buf[:end]))
                self.buf = self.buf[end:]
                break
            elif self.state == _AFTER:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.state = _CONTENT
            else:
                content.append(self.buf)
                self.buf = ""
                break
        return "".join(reasoning), "".join(content)

    def _release(self, piece: str) -> str:
        self.reasoning_started = self.reasoning_started or bool(piece)
        return piece

    def end(self) -> tuple[str, str]:
        """(reasoning, content) left when generation has stopped: held text was not a tag."""
        held, self.buf = self.buf, ""
        if self.state == _START:  # only whitespace or a bare "<thi" came
            if not self.opened:
                return "", held  # never became reasoning: content, as without the split
            self.state, self.found = _INSIDE, True
        if self.state == _INSIDE:  # stopped before </think> (e.g. max_tokens)
            if not self.reasoning_started:
                held = held.lstrip("\n")
            return held.rstrip("\n"), ""
        return "", held  # empty: _AFTER drops whitespace, _CONTENT releases everything


def split_all(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning or None when the text has no reasoning part, content) of a whole text, by
    the same rules as the streamed split."""
    s = ReasoningSplitter(opened)
    r1, c1 = s.feed(text)
    r2, c2 = s.end()
    return (r1 + r2 if s.found else None), c1 + c2


def add_reasoning_args(ap: argparse.ArgumentParser) -> None:
    """The reasoning split's two flags, for the proxy and volundr-serve alike (this module
    needs no FastAPI): --no-reasoning-split, --reasoning-opened-in-prompt."""
    ap.add_argument("--no-reasoning-split", action="store_true",
                    help="chat: return the model's <think>...</think> inside content instead of "
                         "as reasoning_content")
    ap.add_argument("--reasoning-opened-in-prompt", action="store_true",
                    help="the checkpoint's chat template opens <think> in the generation prompt "
                         "(the Volundr template does not): generated text starts as reasoning")
