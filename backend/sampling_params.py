"""Per-request generation settings, validated once at the edge (engine and Triton model)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from volundr.structured import check_schema

MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    top_k: int = 0  # 0 or -1 -> off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # same seed -> same ids, alone or batched
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's: the stop tokens (end of sequence, stop_token_ids) are masked out of the logits
    # until this many tokens have been generated
    min_tokens: int = 0
    # OpenAI's penalties on the tokens generated so far: logit -= presence (if generated at all)
    # + frequency * count; and the repetition penalty (vLLM / Hugging Face) on every token of
    # the prompt or the output: a positive logit divided by it, a negative one multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits (a dict
    # {id: bias} is taken too); -100 / 100 all but ban / force a token.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities of each generated token under the model (its raw logits' log-softmax)
    # and of the `logprobs` most likely alternatives (0-20); None: none returned.
    logprobs: int | None = None
    # Structured output: the text must be JSON matching this JSON Schema (its JSON text; OpenAI's
    # json_object is '{"type": "object"}'); the sampler allows only ids that keep it matching
    # (volundr.structured). None: free text.
    json_schema: str | None = None
    # ... or this llguidance grammar (its Lark dialect, %json rules included, or its JSON form):
    # vLLM's guided grammar / regex / choice, and a forced tool call (volundr.chat).
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:  # OpenAI's range (a NaN fails it too)
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got "
                             f"{self.repetition_penalty}")
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple(sorted((int(t), float(b)) for t, b in pairs))
        for t, b in bias:
            if t < 0 or not (math.isfinite(b) and -100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias takes token ids >= 0 with biases in [-100, 100], "
                                 f"got {t}: {b}")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", bias)
        if self.logprobs is not None and not (isinstance(self.logprobs, int)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                             f"{self.logprobs!r}")
        if self.json_schema is not None:
            check_schema(self.json_schema)
            if self.grammar is not None:
                raise ValueError("give json_schema or grammar, not both")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise ValueError("grammar must be a non-empty string")
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer from 0 to max_tokens "
                             f"({self.max_tokens}), got {self.min_tokens!r}")
        if self.min_tokens and self.structured:  # (a finished form allows the stop alone)
            raise ValueError("min_tokens cannot be combined with json_schema or grammar")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (volundr.sampler.apply_penalties)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes the model's logits (penalties, logit_bias) before
        choosing, greedy included (volundr.sampler.adjust_logits)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def token_by_token(self) -> bool:
        """Whether each token must be chosen on the host before the next is computed (a
        grammar's mask after each token): no multi-step decode (speculative checks take part:
        they mask their rows on the host). Logprobs are not: multi-step decode keeps them on
        the device until its read back."""
        return self.structured

    @property
    def structured(self) -> bool:
        """Whether a grammar keeps the output to a form (json_schema or grammar)."""
        return self.json_schema is not None or self.grammar is not None
