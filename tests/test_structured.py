"""Structured output (volundr.structured) on the tiny checkpoint (random weights, the real
tokenizer): a request with a JSON schema produces JSON that matches it and ends with "stop",
greedy, sampled and seeded, batched with free-text requests that it leaves as they are; every
output is a token sequence a fresh matcher accepts; bad schemas are refused at the edge."""

from __future__ import annotations

import json

import pytest
import torch

from volundr.llm import LLM
from volundr.sampling_params import SamplingParams
from volundr.structured import bitmask_to_bool

SCHEMA = {"type": "object",
          "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}},
          "required": ["colour", "ok", "n", "tags"], "additionalProperties": False}


def matches(value) -> bool:
    """SCHEMA by hand (no jsonschema dependency)."""
    return (isinstance(value, dict) and set(value) == {"colour", "ok", "n", "tags"}
            and value["colour"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
            and type(value["n"]) is int and 0 <= value["n"] <= 99
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(t in ("a", "b") for t in value["tags"]))


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with LLM(tiny_dir, device="cpu", max_num_seqs=8, decode_steps=4) as m:
        yield m


def outputs(llm: LLM, reqs: list[tuple[str, SamplingParams]]) -> dict[str, tuple[list, str]]:
    """reqs [(prompt, params)] added together -> {request id: (ids, finish reason)}."""
    e = llm.engine
    rids = [e.add_request(llm.tokenizer.encode(p, add_special_tokens=False).ids, sp)
            for p, sp in reqs]
    got: dict[str, tuple[list, str]] = {r: ([], "") for r in rids}
    while e.has_unfinished():
        for o in e.step():
            got[o.request_id] = (got[o.request_id][0] + o.new_token_ids, o.finish_reason or "")
    return {f"r{i}": got[r] for i, r in enumerate(rids)}


def test_bitmask_to_bool_reads_bit_b_of_word_w_as_id_32w_plus_b():
    bits = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int64).to(torch.int32)
    V = 150
    want = torch.tensor([[bool((int(bits[r, i // 32]) >> (i % 32)) & 1) for i in range(V)]
                         for r in range(3)])
    assert torch.equal(bitmask_to_bool(bits, V), want)


def test_batch_row_bits_are_row_bits(llm):
    """The parallel masks (llguidance's executor) == one matcher at a time, for matchers at
    different states with guesses all valid, valid then refused, refused at once and none;
    the matchers end where they began. Rows past a refused guess may differ (never read)."""
    from volundr.structured import batch_row_bits, row_bits

    tok, g = llm.tokenizer, llm.engine.grammars
    ids = tok.encode('{"colour": "green", "ok": false, "n": 42, "tags": ["a"]}',
                     add_special_tokens=False).ids
    ms = [g.matcher(SamplingParams(json_schema=json.dumps(SCHEMA))) for _ in range(4)]
    for m, k in zip(ms, (0, 3, 6, 9)):
        m.consume_tokens(ids[:k])
    guesses = [ids[:3], ids[3:5] + [5], [999, 1], []]
    rows, W = 4, (llm.config.vocab_size + 31) // 32
    got = batch_row_bits(ms, guesses, rows, W)
    for m, d, b in zip(ms, guesses, got):
        read = min(m.validate_tokens(d[:rows - 1]), rows - 1) + 1  # rows the check reads
        assert torch.equal(b[:read], row_bits(m, d, rows, W)[:read])
    for m, k in zip(ms, (0, 3, 6, 9)):  # (unchanged: the rest of the value still fits)
        assert m.validate_tokens(ids[k:]) == len(ids) - k


def test_outputs_match_the_schema(llm):
    """Greedy, sampled and seeded requests with the schema, batched with free-text requests:
    each schema output is JSON matching it, ended with "stop" (the grammar complete); the free
    requests' tokens are what they are alone (the masks touch only their own rows)."""
    schema = json.dumps(SCHEMA)
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [("The forge", SamplingParams(max_tokens=80, temperature=0.0, json_schema=schema)),
            ("A hammer", free),
            ("Anvil and", SamplingParams(max_tokens=80, temperature=1.0, json_schema=schema)),
            ("Sparks", SamplingParams(max_tokens=80, temperature=1.2, top_p=0.9, seed=11,
                                      json_schema=schema)),
            ("Iron", SamplingParams(max_tokens=80, temperature=0.8, seed=5,
                                    presence_penalty=1.0, logit_bias={7: 50.0},
                                    json_schema=schema))]
    got = outputs(llm, reqs)
    alone = outputs(llm, [("A hammer", free)])
    assert got["r1"] == alone["r0"]
    for r in ("r0", "r2", "r3", "r4"):
        ids, reason = got[r]
        text = llm.tokenizer.decode(ids, skip_special_tokens=False)
        assert reason == "stop", (r, text)
        assert matches(json.loads(text)), (r, text)
    seeded = outputs(llm, [reqs[3]])  # a seeded structured request repeats alone
    assert seeded["r0"] == got["r3"]


def test_json_object_tokens_are_accepted_by_a_fresh_matcher(llm):
    """Any JSON object (OpenAI's json_object): the tokens, whether the object closed or the
    request ran out of tokens, are all accepted by a new matcher of the same schema; a
    closed one parses as an object. Without the mask the random model's text is not JSON."""
    obj = '{"type": "object"}'
    got = outputs(llm, [(p, SamplingParams(max_tokens=40, temperature=1.0, seed=s,
                                           json_schema=obj))
                        for s, p in enumerate(("One", "Two", "Three"))])
    for ids, reason in got.values():
        m = llm.engine.grammars.matcher(SamplingParams(json_schema=obj))
        assert m.validate_tokens(ids) == len(ids)
        if reason == "stop":
            assert isinstance(json.loads(llm.tokenizer.decode(ids)), dict)
    ids, _ = outputs(llm, [("One", SamplingParams(max_tokens=40, temperature=1.0, seed=0))])["r0"]
    assert llm.engine.grammars.matcher(SamplingParams(json_schema=obj)).validate_tokens(ids) \
        < len(ids)


def test_multi_step_leaves_structured_requests_one_token_a_step(llm):
    """decode_steps=4: a structured request alone takes one engine step a token (its mask
    needs the token before), a free one fewer steps than tokens."""
    e = llm.engine
    steps = {}
    for name, sp in (("free", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
                     ("json", SamplingParams(max_tokens=16, temperature=0.0,
                                             json_schema='{"type": "object"}'))):
        e.add_request(llm.tokenizer.encode("Hello").ids, sp)
        n, toks = 0, 0
        while e.has_unfinished():
            n += 1
            toks += sum(len(o.new_token_ids) for o in e.step())
        steps[name] = (n, toks)
    assert steps["free"][0] < steps["free"][1]
    assert steps["json"][0] >= steps["json"][1]
    assert SamplingParams(json_schema="{}").token_by_token


@pytest.mark.parametrize("drafter", ["draft-tiny", "mtp"])
def test_speculation_keeps_the_grammar_tokens(llm, tiny_dir, drafter):
    """With a drafter (the tiny one) or the MTP head (k = 2) a structured request's tokens are
    those of plain decoding under the grammar (greedy; seeded sampled), ended the same way,
    batched with a free request; the speculative steps ran and kept guesses (fewer engine
    steps than tokens)."""
    from volundr.serve.launcher import default_cache_dir, tiny_checkpoint

    schema = json.dumps(SCHEMA)
    reqs = [("The forge", SamplingParams(max_tokens=60, temperature=0.0, json_schema=schema)),
            ("Sparks", SamplingParams(max_tokens=60, temperature=1.1, seed=4,
                                      json_schema=schema)),
            ("Iron", SamplingParams(max_tokens=60, temperature=0.0, grammar=(
                'start: "[" num (", " num)* "]"\nnum: /[1-9][0-9]?/'))),
            ("A hammer", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    plain = outputs(llm, reqs)
    draft = "mtp" if drafter == "mtp" else tiny_checkpoint(default_cache_dir(), drafter)
    with LLM(tiny_dir, device="cpu", max_num_seqs=8, draft_model=draft,
             num_speculative_tokens=2 if drafter == "mtp" else 3, spec_min_tokens=0.0) as spec:
        got = outputs(spec, reqs)
        assert spec.engine.spec_tokens > spec.engine.spec_seqs  # guesses were kept
    assert got == plain
    for r in ("r0", "r1"):
        assert got[r][1] == "stop" and matches(json.loads(llm.tokenizer.decode(got[r][0])))


def test_a_step_counts_tokens_up_to_the_completing_one(llm):
    """A speculative step's tokens count up to the one that completes the value (what the
    request keeps: its state must not take in more), and the matcher is left as it was."""
    from volundr.sequence import Sequence

    e, tok = llm.engine, llm.tokenizer
    params = SamplingParams(max_tokens=50, temperature=0.0,
                            json_schema='{"enum": ["red", "green"]}')
    seq = Sequence("x", [1, 2, 3], params)
    seq.grammar = e.grammars.matcher(params)
    ids = tok.encode('"green"', add_special_tokens=False).ids
    eos = min(e.eos_token_ids)
    assert e._counted(seq, ids + [eos]) == len(ids)
    assert e._counted(seq, ids[:-1]) == len(ids) - 1
    assert seq.grammar.validate_tokens(ids) == len(ids)  # (untouched: from the start)


def test_json_grammar_with_thinking(llm):
    """volundr.chat.json_grammar: the value alone, or (think) after an optional think block
    and whitespace; text outside those is refused."""
    from volundr.chat import json_grammar

    tok = llm.tokenizer
    value = tok.encode('{"colour": "red", "ok": true, "n": 3, "tags": []}',
                       add_special_tokens=False).ids
    think = ([tok.token_to_id("<think>")] + tok.encode("plan it", add_special_tokens=False).ids
             + [tok.token_to_id("</think>")] + tok.encode("\n\n", add_special_tokens=False).ids)

    def takes(think_on: bool, ids: list[int]) -> bool:
        m = llm.engine.grammars.matcher(SamplingParams(grammar=json_grammar(SCHEMA, think_on)))
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    assert takes(False, value) and takes(True, value) and takes(True, think + value)
    assert not takes(False, think + value)
    assert not takes(True, tok.encode("Sure: ", add_special_tokens=False).ids + value)


def test_think_first_wraps_any_grammar(llm):
    """volundr.chat.think_first: a Lark grammar (rules of its own, a regex) or one in
    llguidance's JSON form, after an optional think block and whitespace, as
    json_grammar(think=True) has a schema; text outside those is refused."""
    from volundr.chat import think_first

    tok = llm.tokenizer
    enc = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    think = [tok.token_to_id("<think>")] + enc("plan it") + [tok.token_to_id("</think>")]
    lark = 'start: metal ("," metal)*\nmetal: "iron" | "steel"'
    form = json.dumps({"grammars": [{"lark_grammar": "start: /[0-9]{3}/"}]})
    for grammar, good, bad in ((lark, "iron,steel", "gold"), (form, "123", "12a")):
        def takes(g: str, ids: list[int]) -> bool:
            m = llm.engine.grammars.matcher(SamplingParams(grammar=g))
            return (m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids)
                    and m.is_accepting())

        wrapped = think_first(grammar)  # (the tiny tokenizer's tags are special tokens)
        assert takes(grammar, enc(good)) and not takes(grammar, think + enc(good))
        assert takes(wrapped, enc(good)) and takes(wrapped, think + enc("\n\n" + good))
        assert not takes(wrapped, enc(bad)) and not takes(wrapped, think + enc(bad))


def test_without_llguidance_a_structured_request_is_a_clear_error(tiny_dir, monkeypatch):
    from volundr.structured import Grammars

    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)  # (import fails)
    g = Grammars(tiny_dir / "tokenizer.json", 4096, (0,), warm=False)
    with pytest.raises(ValueError, match="needs the llguidance package"):
        g.matcher(SamplingParams(json_schema="{}"))


@pytest.mark.parametrize("schema, match", [("not json", "not JSON"), ("[1, 2]", "JSON object"),
                                           ('{"type": "strin"}', "strin"),
                                           ('{"$ref": "#/nowhere"}', "nowhere")])
def test_bad_schemas_are_refused(llm, schema, match):
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request([1, 2, 3], SamplingParams(json_schema=schema))
    assert not llm.engine.has_unfinished()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": 'add "q"', "parameters": {
        "$defs": {"N": {"type": "integer"}}, "type": "object",
        "properties": {"a": {"$ref": "#/$defs/N"}}, "required": ["a"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}}]  # no parameters: any object


@pytest.mark.parametrize("special", [True, False])
def test_tool_call_grammar(llm, special):
    """volundr.chat.tool_call_grammar over the tiny tokenizer (its tags are special tokens; as
    text with special=False): after a named choice's prefill it takes the arguments matching
    that function, `}` and the closing tag, then nothing; after "required"'s `<tool_call>` one
    or more calls of any tool joined by "\\n<tool_call>", names and arguments as the template
    writes them ($refs of a function's own schema resolve); it refuses other names and
    arguments that break the schema."""
    from volundr.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, tool_call_grammar

    tok = llm.tokenizer

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids if text else []

    def tag(t: str) -> list[int]:  # its special token, or its text in plain tokens
        return [tok.token_to_id(t)] if special else enc(t[:1]) + enc(t[1:])

    def ids(text: str) -> list[int]:
        out = []
        for i, part in enumerate(text.split(TOOL_CALL_CLOSE)):
            out += tag(TOOL_CALL_CLOSE) if i else []
            for j, p in enumerate(part.split(TOOL_CALL_OPEN)):
                out += (tag(TOOL_CALL_OPEN) if j else []) + enc(p)
        return out

    def accepts(choice, text: str) -> tuple[bool, bool]:
        """(all of text's tokens taken, the grammar complete after them)"""
        m = llm.engine.grammars.matcher(SamplingParams(
            grammar=tool_call_grammar(TOOLS, choice, None if special else ())))
        t = ids(text)
        return m.validate_tokens(t) == len(t), m.consume_tokens(t) and m.is_accepting()

    named = {"type": "function", "function": {"name": "get_weather"}}
    assert accepts(named, ' {"city": "Oslo"}}</tool_call>') == (True, True)
    assert accepts(named, '{"city": "Oslo"}}</tool_call>') == (True, True)
    assert accepts(named, ' {"town": "Oslo"}}</tool_call>')[0] is False
    assert accepts(named, ' {"city": 3}}</tool_call>')[0] is False
    assert accepts(named, ' {"city": "Oslo"}}</tool_call>\n')[0] is False
    one = '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    two = '{"name": "add \\"q\\"", "arguments": {"a": 3}}</tool_call>'
    assert accepts("required", one) == (True, True)
    assert accepts("required", one + "\n<tool_call>" + two) == (True, True)
    assert accepts("required", '{"name": "now", "arguments": {"z": [1]}}</tool_call>') == \
        (True, True)
    assert accepts("required", '{"name": "add \\"q\\"", "arguments": {"a": "3"}}')[0] is False
    assert accepts("required", '{"name": "other", "arguments": {}}</tool_call>')[0] is False
    assert tool_call_grammar(TOOLS, "auto") is None and tool_call_grammar(TOOLS, None) is None
    # strict tools under "auto": any text (after an optional think block), then calls
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]

    if not special:  # (text could spell a call out: no grammar)
        assert tool_call_grammar(strict, "auto", ()) is None
        return

    def auto(text: str) -> tuple[bool, bool]:
        m = llm.engine.grammars.matcher(SamplingParams(
            grammar=tool_call_grammar(strict, "auto")))
        t = ids(text)
        return m.validate_tokens(t) == len(t), m.consume_tokens(t) and m.is_accepting()

    assert auto("Just words, no call.") == (True, True)
    assert auto("Let me look.\n<tool_call>" + one) == (True, True)
    assert auto("<tool_call>" + one + "\n<tool_call>" + two) == (True, True)
    assert auto('Hm.<tool_call>{"name": "get_weather", "arguments": {"city": 7}}')[0] is False
    assert auto("<tool_call>" + one + " and more words")[0] is False
    think = [tok.token_to_id("<think>")] + enc("plan") + [tok.token_to_id("</think>")]
    m = llm.engine.grammars.matcher(SamplingParams(grammar=tool_call_grammar(strict, None)))
    t = think + enc("\n\nAnswer.") + ids("<tool_call>" + one)
    assert m.validate_tokens(t) == len(t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_structured_with_graphs_and_mtp(tiny_dir):
    """On CUDA (bf16, graphs, the MTP head at k = 2): structured requests batched with a free
    one give JSON matching the schema, and the same tokens as without speculation."""
    schema = json.dumps(SCHEMA)
    reqs = [("The forge", SamplingParams(max_tokens=60, temperature=0.0, json_schema=schema)),
            ("Sparks", SamplingParams(max_tokens=60, temperature=0.9, seed=2,
                                      json_schema=schema)),
            ("A hammer", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    got = {}
    for draft in (None, "mtp"):
        with LLM(tiny_dir, device="cuda", max_num_seqs=4, draft_model=draft,
                 num_speculative_tokens=2 if draft else None, spec_min_tokens=0.0) as m:
            got[draft] = outputs(m, reqs)
            for r in ("r0", "r1"):
                ids, reason = got[draft][r]
                assert reason == "stop" and matches(json.loads(m.tokenizer.decode(ids)))
    assert got[None] == got["mtp"]
