"""Stateless, exact incremental detokenization.

The TRT-LLM ensemble decodes each streamed chunk of ids on its own, which breaks multi-byte
characters split across tokens and drops the leading space of SentencePiece pieces
(tensorrtllm_backend #34, #493). Here a chunk is decoded *in context*:

    delta = decode(prefix_ids + output_ids)[len(decode(prefix_ids)):]

which is exact as long as both ends of `prefix_ids` and of `output_ids` fall on clean UTF-8
boundaries of the byte stream (no character cut in two). The producer (volundr_llm) guarantees
that with `Utf8Boundary`: it only ends a chunk where the bytes so far do not end inside a
character, so the joined deltas of a request equal `decode(all output ids)`. No state is needed on
the consumer side (the postprocessing model).

Text is decoded with `skip_special_tokens=False`: `<tool_call>` and `<think>` are special tokens
of the Volundr tokenizer and must reach the client; EOS never does (the engine does not emit it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache

from tokenizers import Tokenizer, decoders

MAX_HOLD = 8  # ids held back at most when the decoder is not byte level (heuristic path)


def decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False) if len(ids) else ""


def text_delta(tokenizer: Tokenizer, prefix_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """The text that `output_ids` add after `prefix_ids` (both ends on clean boundaries)."""
    if not len(output_ids):
        return ""
    head = decode(tokenizer, prefix_ids)
    full = decode(tokenizer, list(prefix_ids) + list(output_ids))
    if full.startswith(head):
        return full[len(head):]
    # A decoder that rewrites across the boundary (e.g. WordPiece cleanup): keep what differs.
    n = 0
    for a, b in zip(head, full):
        if a != b:
            break
        n += 1
    return full[n:]


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode, the alphabet of byte-level BPE tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _incomplete_tail(tail: bytes) -> bool:
    """Whether `tail` (the last <= 4 bytes of a stream) ends inside a UTF-8 sequence.

    Conservative: a lead byte followed by fewer continuation bytes than it announces counts as
    incomplete even if the sequence is already invalid; that only delays a chunk by one token.
    """
    for back in range(1, min(4, len(tail)) + 1):
        b = tail[-back]
        if 0x80 <= b <= 0xBF:
            continue  # continuation byte: look further back for its lead
        need = 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 0
        return need > back
    return False


class Utf8Boundary:
    """Tells whether the byte stream of a list of ids ends on a character boundary.

    Byte-level BPE (the Volundr tokenizer): exact, from each token's bytes. Any other decoder:
    the decoded tail must not end in U+FFFD, and at most MAX_HOLD ids are held back.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._u2b = _unicode_to_byte()

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        return bytes(self._u2b[c] for c in piece if c in self._u2b)

    def is_clean(self, ids: Sequence[int], held: int = 0) -> bool:
        """`ids`: the ids of the stream so far (only the last few are read); `held`: how many of
        them are waiting for a boundary (for the heuristic's cap)."""
        if not len(ids):
            return True
        if self.byte_level:
            tail = b""
            for t in reversed(ids[-4:]):
                tail = self.token_bytes(int(t)) + tail
                if len(tail) >= 4:
                    break
            return not _incomplete_tail(tail[-4:])
        if held >= MAX_HOLD:
            return True
        return not decode(self.tokenizer, ids[-4:]).endswith("\ufffd")


def logprobs_with_text(boundary: Utf8Boundary, text: str) -> str:
    """volundr_llm's logprobs JSON ([[id, logprob, [[id, logprob], ...]], ...], or "") with each
    token's text and UTF-8 bytes, in OpenAI's form: [{"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...] ("" stays ""). A token that
    ends inside a character shows U+FFFD in `token`; its `bytes` are exact."""
    if not text:
        return ""

    def entry(token_id: int, lp: float) -> dict:
        b = (boundary.token_bytes(token_id) if boundary.byte_level
             else decode(boundary.tokenizer, [token_id]).encode("utf-8"))
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

    return json.dumps([{**entry(t, lp), "top_logprobs": [entry(i, x) for i, x in top]}
                       for t, lp, top in json.loads(text)], ensure_ascii=False)
