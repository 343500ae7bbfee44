"""A request's token ids and bookkeeping, in plain Python (testable without a GPU)."""

from __future__ import annotations

import itertools
from enum import Enum, auto

import torch

from volundr.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = itertools.count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens [0, num_computed_tokens) are in the KV cache and folded into the KDA state.
        self.num_computed_tokens = 0
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.slot: int | None = None  # KDA / conv / Engram state slot while running
        self.finish_reason: str | None = None
        self.num_emitted = 0  # output ids already handed to the caller
        self.generator = None  # per-request torch.Generator for seeded sampling
        # per output token with params.logprobs: (its logprob, [(id, logprob)] alternatives)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        # params.json_schema's llguidance matcher (volundr.structured), fed each token appended
        self.grammar = None
        # the tokens that end it (the engine adds its end-of-sequence ids); min_tokens masks them
        self.stop_ids: tuple[int, ...] = params.stop_token_ids
        self.num_preemptions = 0
        # Precomputed input embeddings (e.g. image patches): prompt position -> [hidden] vector,
        # used instead of the token's embedding row.
        self.input_embeds: dict[int, torch.Tensor] = {}
        self.priority = 0  # lower runs first (vLLM's convention); ties in arrival order
        # Sessions (volundr.session): the id this request parks its state under when it ends;
        # a parked state to restore at admission (tokens [0, num_computed_tokens) come from
        # it: num_cached_tokens of them).
        self.session_id: str | None = None
        self.resume = None  # volundr.session.Resume
        self.num_cached_tokens = 0
        self.prompt_snap = False  # the runner keeps the state after the prompt (key: seq_id)
        self.embed_digests: dict[int, str] = {}  # input_embeds position -> digest (sessions)
        # Speculative decoding (volundr.speculative): tokens [0, num_draft_computed) are in the
        # drafter's state and KV (it catches up lazily, before it drafts).
        self.num_draft_computed = 0
        # the MTP head's guesses of the tokens after the last one (speculate_mtp; [] none yet)
        self.mtp_drafts: list[int] = []
        # speculative steps this sequence ran and the tokens they made (StepPlan.pays)
        self.spec_steps = self.spec_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_pending_tokens == 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """After preemption the state is gone: the whole sequence is prefilled again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.slot = None
        self.num_cached_tokens = 0  # (a running sequence restored its parked state already)
        self.num_draft_computed = 0
        self.mtp_drafts = []
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")
