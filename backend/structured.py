"""Structured output: a request's tokens kept to a JSON schema or a grammar by masking the logits.

llguidance (the grammar engine vLLM, SGLang and llama.cpp use) compiles the schema (or takes
the grammar: its Lark dialect; volundr.chat.tool_call_grammar's, vLLM's regex / choice) over the
model's tokenizer; a sequence's `LLMatcher` says, before each token, which
token ids can continue a text that still matches (a bitmask, one bit per id), and takes each
token the sequence emits. The sampler sets every other id's logit to -inf after penalties and
logit_bias, so greedy, sampled and seeded requests all choose among the allowed ids; the token
that completes the JSON value ends the request ("stop"; an EOS the grammar allows ends it too).

Such a request stays out of multi-step decode (its mask for a token depends on the tokens
before it, which only the host's matcher knows). It speculates: a check's row j is masked by
the matcher after the guesses before it (`mask_rows`, then rolled back), so the kept tokens are
those plain decoding under the grammar would make; the tokens the grammar forces (a schema's
keys and punctuation) are the step's first guesses (`forced_drafts`), kept for certain.

OpenAI's response_format maps here: {"type": "json_object"} is the schema {"type": "object"},
{"type": "json_schema", "json_schema": {"schema": S}} is S.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from volundr.chat import json_grammar


def check_schema(text: str) -> dict:
    """The schema `text` is JSON of (an object; true, any value, as {}); else ValueError."""
    try:
        schema = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema is not JSON: {e}") from None
    if not isinstance(schema, dict) and schema is not True:
        raise ValueError("json_schema must be a JSON object (a JSON Schema)")
    return {} if schema is True else schema


class Grammars:
    """Compiles requests' schemas and grammars against the model's tokenizer, which llguidance
    reads once (about a second for a large vocabulary: started on a thread when the engine is
    made, so the first structured request does not wait for it)."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 warm: bool = True):
        """tokenizer_json: the checkpoint's tokenizer.json; vocab_size: the logits' width (may
        exceed the tokenizer's: ids past it are never allowed); eos_token_ids: the ids that
        end a request (allowed once the value is complete)."""
        self.path, self.vocab_size = Path(tokenizer_json), vocab_size
        self.eos = list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        if warm:
            threading.Thread(target=self._warm, daemon=True, name="grammars-warm").start()

    def _warm(self) -> None:
        try:
            self.tokenizer()
        except Exception:  # (no llguidance, a tokenizer it cannot read: the request says so)
            pass

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                try:
                    import llguidance
                except ImportError:
                    raise ValueError("structured output needs the llguidance package "
                                     "(pip install llguidance)") from None
                self._tokenizer = llguidance.LLTokenizer(self.path.read_text("utf-8"),
                                                         n_vocab=self.vocab_size,
                                                         eos_token=self.eos or None)
            return self._tokenizer

    def matcher(self, params):
        """A fresh LLMatcher for params.json_schema (JSON text of a schema) or params.grammar
        (llguidance's Lark or JSON grammar); ValueError naming what is wrong with one it
        cannot compile."""
        tokenizer = self.tokenizer()  # (first: a missing llguidance is a ValueError)
        import llguidance

        if params.grammar is not None:
            name, grammar = "grammar", params.grammar
        else:  # (the grammar preprocessing builds for the ensemble's json_schema too)
            name, grammar = "json_schema", json_grammar(check_schema(params.json_schema))
        m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"{name} cannot be compiled: {m.get_error()}")
        return m


def _bits(m, W: int) -> torch.Tensor:
    """The matcher's next-token bitmask as [W] int32 (host)."""
    return torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)[:W]


def row_bits(m, guesses: list[int], rows: int, W: int) -> torch.Tensor:
    """[rows, W] int32: row j's bitmask after the matcher took guesses d_1 .. d_j (a speculative
    check's rows; volundr.speculative), one matcher at a time (the plain form of
    `batch_row_bits`). Past the first guess the grammar refuses, the rows repeat that row's
    mask (the guess is rejected there anyway). The matcher ends as it began."""
    taken = m.validate_tokens(guesses[:rows - 1])  # (changes nothing)
    out = torch.empty(rows, W, dtype=torch.int32)
    for j in range(rows):
        if j <= taken:
            out[j] = _bits(m, W)
            if j < taken:
                m.consume_token(guesses[j])
        else:
            out[j] = out[taken]
    if taken:
        m.rollback(taken)
    return out


def completes_at(m, tokens: list[int]) -> int:
    """How many of `tokens` (appended one by one) the request keeps: up to the one that
    completes the matcher's value, or all. The matcher ends as it began."""
    n = stopped = 0
    for t in tokens[:m.validate_tokens(tokens)]:
        m.consume_token(t)
        n += 1
        if stopped := m.is_stopped():
            break
    if n:
        m.rollback(n)
    return n if stopped else len(tokens)


def forced_drafts(seqs, drafts: list[list[int]], k: int) -> list[list[int]]:
    """A speculative step's guesses with each structured sequence's first ones replaced by the
    tokens its grammar forces next (llguidance's fast-forward tokens: the only ones its mask
    will allow, so the check keeps them whatever the model says), the drafter's after them;
    at most k forced. Others' drafts as they are."""
    out = []
    for s, d in zip(seqs, drafts):
        ff = s.grammar.compute_ff_tokens()[:k] if s.grammar is not None else []
        out.append(ff + d[len(ff):] if ff else d)
    return out


_executor = None


def batch_row_bits(matchers: list, guesses: list[list[int]], rows: int, W: int) -> torch.Tensor:
    """`row_bits` of every matcher at once, in parallel on llguidance's thread pool (its
    LLExecutor: the matchers' masks are independent): [len(matchers), rows, W] int32. Rows
    past a matcher's first refused guess are all ones (never read: the guess is rejected at
    the row before). W: ceil(V / 32) of the tokenizer's n_vocab."""
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    bits = torch.full((len(matchers) * rows, W), -1, dtype=torch.int32)
    jobs = [(m, i * rows, g[:rows - 1]) for i, (m, g) in enumerate(zip(matchers, guesses))]
    if drafted := [j for j in jobs if j[2]]:  # (the executor takes no empty guess lists)
        _executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bits.data_ptr(), W * 4,
                                                           bits.shape[0])
    if alone := [(m, at) for m, at, g in jobs if not g]:
        _executor.unsafe_compute_mask_ptr(alone, bits.data_ptr(), W * 4, bits.shape[0])
    return bits.view(len(matchers), rows, W)


def mask_rows(logits: torch.Tensor, seqs, guesses: list[list[int]]) -> torch.Tensor:
    """A speculative check's logits [n, rows, V] with row j of sequence i masked by its
    grammar after guesses[i][:j] (`batch_row_bits`); sequences without a grammar as they
    are."""
    n, rows, V = logits.shape
    idx = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not idx:
        return logits
    W = (V + 31) // 32
    bits = batch_row_bits([seqs[i].grammar for i in idx], [guesses[i] for i in idx], rows, W)
    allowed = bitmask_to_bool(bits.view(-1, W).to(logits.device, non_blocking=True), V)
    at = torch.tensor(idx, device=logits.device)
    sub = logits[at].masked_fill(~allowed.view(len(idx), rows, V), float("-inf"))
    return logits.index_copy(0, at, sub)


def bitmask_to_bool(bits: torch.Tensor, V: int) -> torch.Tensor:
    """bits [M, ceil(V / 32)] int32, bit b of word w = id 32 w + b allowed -> [M, V] bool."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :V]


def mask_seqs(logits: torch.Tensor, seqs) -> torch.Tensor:
    """logits [M, V] with -inf at every id row i's grammar (seqs[i].grammar) does not allow
    next; rows without one as they are (logits itself when no row has one). A grammar that
    allows nothing (an error state) leaves only its EOS ids, so the request ends."""
    if all(s.grammar is None for s in seqs):
        return logits
    return mask_rows(logits.unsqueeze(1), seqs, [[] for _ in seqs]).squeeze(1)
