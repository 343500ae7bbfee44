"""The reply to a named `tool_choice`: the arguments of the forced call, whole or as they stream.

The prompt ends in the call's opening, `<tool_call>{"name": "X", "arguments":` (volundr.chat.
forced_tool_prefix: a prefill, no grammar), so the generated text should be the arguments value,
the `}` that closes the call's object and `</tool_call>`. The arguments are that value's text as
the model wrote it, whitespace around it dropped, valid JSON or not (OpenAI documents that
arguments may be invalid JSON; clients validate):

- a value that opens with `{`, `[` or `"` ends where it closes (strings and escapes respected);
  what follows (the call's `}`, anything the model adds) is not arguments;
- any other value (a number, a literal, garbage) ends before the first `}`;
- a value still open at `</tool_call>` or at the end of generation is all the text up to there.

`ForcedArguments` reads the text incrementally (a streamed reply scans each character once) and
`arguments(final=False)` only returns what later text cannot change, so the streamed fragments
joined are `arguments(final=True)` of the whole text, however it was cut into deltas.
"""

from __future__ import annotations

from volundr.chat import TOOL_CALL_CLOSE
from volundr.serve.stop import partial_stop_len


class ForcedArguments:
    def __init__(self) -> None:
        self.text = ""  # all the text generated after the prefix
        self.pos = 0  # characters scanned (a possible partial </tool_call> is held back)
        self.start: int | None = None  # where the value starts (its first non-space)
        self.end: int | None = None  # where it ends, once it has
        self.limit: int | None = None  # where </tool_call> starts, once seen
        self.kind = ""  # "{", "[" (a container), '"' (a string) or "" (anything else)
        self.depth = 0
        self.quoted = self.escaped = False

    def feed(self, text: str) -> None:
        self.text += text
        if self.limit is None:
            at = self.text.find(TOOL_CALL_CLOSE, max(0, self.pos - len(TOOL_CALL_CLOSE) + 1))
            if at >= 0:
                self.limit = at
        stop = self.limit if self.limit is not None else \
            len(self.text) - partial_stop_len(self.text, [TOOL_CALL_CLOSE])
        if self.end is None:
            self._scan(stop)
        self.pos = max(self.pos, stop)

    def _scan(self, stop: int) -> None:
        for i in range(self.pos, stop):
            c = self.text[i]
            if self.start is None:
                if c.isspace():
                    continue
                self.start, self.kind = i, c if c in '{["' else ""
                if self.kind:
                    self.depth, self.quoted = (0, True) if c == '"' else (1, False)
                    continue
            if self.quoted:  # inside a string (the value itself or one in a container)
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.quoted = False
                    if self.depth == 0:
                        self.end = i + 1
            elif not self.kind:
                if c == "}":
                    self.end = i
            elif c == '"':
                self.quoted = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
            if self.end is not None:
                return

    @property
    def closed(self) -> bool:
        """`</tool_call>` was generated."""
        return self.limit is not None

    def arguments(self, final: bool) -> str:
        """The arguments text; not `final`: the part that more text cannot change."""
        if self.start is None:
            return ""
        if self.end is not None:
            stop = self.end
        elif self.limit is not None:
            stop = self.limit
        else:
            stop = len(self.text) if final else self.pos
        return self.text[self.start:stop].strip()
