"""Stateless incremental detokenization and stop strings, on the tiny checkpoint's tokenizer.

The chunks are produced by the same RequestStream that volundr_llm runs and decoded by the same
text_delta that the postprocessing model runs; joined, they must equal tokenizer.decode(all ids).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from volundr.serve.detok import Utf8Boundary, _incomplete_tail, decode, text_delta
from volundr.serve.triton_llm import RequestStream

MULTIBYTE = "你好，世界！ 日本語のテキスト 🎉 emoji 😀 family 👨‍👩‍👧 café ✓ 한국어 Ωμέγα"


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def run_stream(tok, ids_per_step, stops=(), stream=True, final="length", min_tokens=0):
    """Feeds steps of ids through a RequestStream; returns (chunks, deltas as postprocessing
    makes them, with trim_chars applied)."""
    rs = RequestStream(Utf8Boundary(tok), stops, stream, num_input_tokens=3,
                       min_tokens=min_tokens)
    chunks = []
    for step in ids_per_step:
        c = rs.push(step, None)
        if c is not None:
            chunks.append(c)
            if c.finish_reason:
                break
    else:
        chunks.append(rs.push([], final))
    deltas = []
    for c in chunks:
        d = text_delta(tok, c.prefix_ids, c.output_ids)
        deltas.append(d[:len(d) - c.trim_chars] if c.trim_chars else d)
    return chunks, deltas


def test_multibyte_round_trip_token_by_token(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False).ids
    assert decode(tok, ids) == MULTIBYTE
    b = Utf8Boundary(tok)
    split = [i for i in ids if _incomplete_tail(b.token_bytes(i)) or not _valid(b.token_bytes(i))]
    assert split, "the sample must contain characters split across tokens"
    # Decoding each token on its own (the TRT-LLM ensemble's way) breaks those characters.
    assert "".join(decode(tok, [i]) for i in ids) != MULTIBYTE

    chunks, deltas = run_stream(tok, [[i] for i in ids])
    assert "".join(deltas) == MULTIBYTE
    assert all("\ufffd" not in d for d in deltas)
    assert len(chunks) > 5 and chunks[-1].finish_reason == "length"
    assert [i for c in chunks for i in c.output_ids] == ids
    assert all(len(c.prefix_ids) <= 8 for c in chunks)  # stateless: a few ids of context


def _valid(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ids_round_trip(tok, seed):
    """Random ids make invalid UTF-8 (lone continuation bytes, cut sequences) and special tokens:
    the joined deltas still equal the decode of all ids, whatever the step sizes."""
    rng = random.Random(seed)
    ids = [rng.randrange(tok.get_vocab_size()) for _ in range(300)]
    steps, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 7])
        steps.append(ids[i:i + n])
        i += n
    chunks, deltas = run_stream(tok, steps)
    assert "".join(deltas) == decode(tok, ids)
    assert [i for c in chunks for i in c.output_ids] == ids


def test_special_tokens_are_text(tok):
    """<tool_call> and <think> are special tokens and must reach the client as text."""
    text = '<think>\nok\n</think>\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    ids = tok.encode(text, add_special_tokens=False).ids
    _, deltas = run_stream(tok, [[i] for i in ids])
    assert "".join(deltas) == text


@pytest.mark.parametrize("stops,expected", [
    (["END"], "The answer is 42. "),
    (["42. E"], "The answer is "),  # spans tokens
    (["nope", "swer"], "The an"),  # the earliest of several; ends inside a token
    (["世界"], "The answer is 42. END of story, "),
])
def test_stop_strings_never_emitted(tok, stops, expected):
    text = "The answer is 42. END of story, 世界 and more text after it"
    ids = tok.encode(text, add_special_tokens=False).ids
    for stream in (True, False):
        chunks, deltas = run_stream(tok, [[i] for i in ids], stops=stops, stream=stream)
        assert "".join(deltas) == expected
        assert chunks[-1].finish_reason == "stop"
        assert len(chunks) == 1 or stream
        # Nothing past the stop string went out before the last chunk either.
        assert all(not any(s in d for s in stops) for d in deltas)


def test_stop_strings_wait_for_min_tokens(tok):
    """With min_tokens (vLLM's rule), a stop string in the first min_tokens tokens' text does
    not end the reply; one after them does."""
    text = "END one two END three"
    ids = tok.encode(text, add_special_tokens=False).ids
    first = len(tok.encode("END one", add_special_tokens=False).ids)
    chunks, deltas = run_stream(tok, [[i] for i in ids], stops=["END"], min_tokens=first)
    assert "".join(deltas) == "END one two " and chunks[-1].finish_reason == "stop"
    _, deltas = run_stream(tok, [[i] for i in ids], stops=["END"])
    assert "".join(deltas) == ""


def test_partial_stop_is_released_at_the_end(tok):
    text = "almost EN but not quite"
    ids = tok.encode(text, add_special_tokens=False).ids
    chunks, deltas = run_stream(tok, [[i] for i in ids], stops=["END"])
    assert "".join(deltas) == text
    assert chunks[-1].finish_reason == "length"


def test_not_streamed_is_one_chunk(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False).ids
    chunks, deltas = run_stream(tok, [[i] for i in ids], stream=False)
    assert len(chunks) == 1 and chunks[0].prefix_ids == [] and chunks[0].output_ids == ids
    assert deltas == [MULTIBYTE]


def test_incomplete_tail():
    e = "界".encode()  # 3 bytes
    assert _incomplete_tail(e[:1]) and _incomplete_tail(e[:2]) and not _incomplete_tail(e)
    assert not _incomplete_tail(b"ab") and not _incomplete_tail(b"\x80\x80")
    assert _incomplete_tail("😀".encode()[:3]) and not _incomplete_tail("😀".encode())


@pytest.mark.parametrize("stream", [True, False])
def test_logprobs_follow_their_ids(tok, stream):
    """Each chunk carries the logprobs of exactly its output ids, through ids held back for a
    character split across tokens and a stop string; logprobs_with_text gives each token's
    exact bytes (the characters of the multibyte sample, joined back)."""
    import json

    from volundr.serve.detok import logprobs_with_text
    from volundr.serve.triton_llm import logprobs_json

    ids = tok.encode(MULTIBYTE + " stop here", add_special_tokens=False).ids
    rs = RequestStream(Utf8Boundary(tok), ["stop"], stream, num_input_tokens=3)
    chunks = []
    for n, t in enumerate(ids):
        c = rs.push([t], None, new_logprobs=[(-float(n), [(t, -float(n))])])
        if c is not None:
            chunks.append(c)
            if c.finish_reason:
                break
    assert chunks[-1].finish_reason == "stop" and (len(chunks) > 5) == stream
    got = [i for c in chunks for i in c.output_ids]
    assert [lp for c in chunks for lp, _ in c.logprobs] == [-float(n) for n in range(len(got))]
    entries = [e for c in chunks
               for e in json.loads(logprobs_with_text(Utf8Boundary(tok), logprobs_json(c)))]
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8").startswith(MULTIBYTE)
    assert [e["top_logprobs"][0]["bytes"] for e in entries] == [e["bytes"] for e in entries]
