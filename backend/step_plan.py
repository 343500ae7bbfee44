"""How many tokens a scheduled step makes: plain multi-token decode steps, which decodes of the
batch speculate and with how many guesses, and how many speculative steps the MTP head's batch
takes back to back on the device. Bookkeeping only (no tensors): the engine asks, the runner
runs. Each answer above one takes the KV blocks its extra positions need."""

from __future__ import annotations

from typing import TYPE_CHECKING

from volundr.block_manager import BlockManager, StateSlots
from volundr.scheduler import ScheduledSeq, Scheduler
from volundr.sequence import Sequence

if TYPE_CHECKING:
    from volundr.engine import EngineConfig

# A sequence's speculative steps before EngineConfig.spec_min_tokens judges them
SPEC_TRIAL_STEPS = 16
# A run of speculative steps draws each seeded sampled sequence's noise rows for all of its
# rows up front (sampler.RowChooser; one row: the vocabulary in fp32, 0.6 MiB for Volundr):
# at most this many rows in all
SEEDED_ROWS = 64


class StepPlan:
    """The engine's step-size policy over its scheduler, slots and KV blocks. spec_k: guesses
    a speculative step (0: no speculation); mtp: they come from the checkpoint's MTP head (else
    from a drafter); max_check_seqs: the largest batch the runner's checks take at once."""

    def __init__(self, ecfg: EngineConfig, scheduler: Scheduler, slots: StateSlots,
                 block_manager: BlockManager, spec_k: int, mtp: bool, max_check_seqs: int):
        self.ecfg, self.scheduler, self.slots, self.bm = ecfg, scheduler, slots, block_manager
        self.spec_k, self.mtp, self.max_check_seqs = spec_k, mtp, max_check_seqs

    def _admissible(self) -> bool:
        """A waiting request could join the batch next step (then no step runs ahead)."""
        sch = self.scheduler
        return bool(sch.waiting) and len(sch.running) < self.ecfg.max_num_seqs \
            and self.slots.num_free > 0

    def _take(self, items: list[ScheduledSeq], reach: list[int]) -> bool:
        """Grows each item's block table to reach[i] positions if the free blocks allow all."""
        bm = self.bm
        if sum(bm.extra_blocks(it.seq, r) for it, r in zip(items, reach)) > bm.num_free:
            return False
        for it, r in zip(items, reach):
            bm.grow(it.seq, r)
        return True

    def decode_steps(self, batch: list[ScheduledSeq]) -> int:
        """How many tokens this step may produce per sequence (1 unless the batch is all
        decodes, no waiting request could be admitted now, every sequence has room for them and
        the KV blocks for the extra positions are free; those blocks are then taken)."""
        k = self.ecfg.decode_steps
        if k <= 1 or self._admissible():
            return 1
        for item in batch:
            s = item.seq
            if item.num_new_tokens != 1 or not item.samples or s.params.token_by_token:
                return 1
            k = min(k, s.params.max_tokens - s.num_output_tokens,
                    self.ecfg.max_model_len - s.num_tokens)
        if k <= 1 or not self._take(batch, [it.seq.num_computed_tokens + k for it in batch]):
            return 1
        return k

    def pays(self, seq: Sequence) -> bool:
        """Whether `seq` speculates: until SPEC_TRIAL_STEPS speculative steps, then while they
        made at least spec_min_tokens tokens a step on average (judged once: a sequence that
        stops, stops for good)."""
        return (seq.spec_steps != SPEC_TRIAL_STEPS  # (past it: it passed)
                or seq.spec_tokens >= self.ecfg.spec_min_tokens * SPEC_TRIAL_STEPS)

    def speculative(self, batch: list[ScheduledSeq]) -> tuple[int, list[ScheduledSeq]]:
        """(k, items) of a speculative step ((0, []): none): the batch's decodes without input
        embeddings (volundr.speculative) that still pay and have room for 2 more tokens, if the
        runner's check takes that many at once. With a drafter k is at most spec_k and the room
        for k + 1 more tokens in each; with the MTP head k = spec_k (the drafts are at hand) and
        the blocks reach 2k positions past the computed ones (its guesses after the first are
        rows past the kept tokens: speculate_mtp). The KV blocks for them are then taken. The
        batch's other items (prefill chunks, the rest) run in a forward of their own."""
        if not self.spec_k:
            return 0, []
        k, reach = self.spec_k, 2 * self.spec_k if self.mtp else 0
        room = {}
        for item in batch:
            s = item.seq
            if (item.num_new_tokens == 1 and item.samples and not s.input_embeds
                    and self.pays(s)
                    and s.num_computed_tokens + reach <= self.ecfg.max_model_len):
                r = min(s.params.max_tokens - s.num_output_tokens - 1,
                        self.ecfg.max_model_len - s.num_tokens - 1)
                if r >= 1:
                    room[s.seq_id] = r
        spec = [it for it in batch if it.seq.seq_id in room]
        if len(spec) > self.max_check_seqs:  # (the captured checks' largest batch)
            # the rest would need a forward of their own: two forwards for the step's decodes
            # (batch 16, H100: 198 tok/s with a random drafter against 1005 without)
            return 0, []
        if not self.mtp:
            k = min([k, *room.values()])
        reach = max(reach, k + 1)
        if not spec or not self._take(spec, [it.seq.num_computed_tokens + reach
                                             for it in spec]):
            return 0, []
        return k, spec

    def spec_steps(self, spec: list[ScheduledSeq], k: int, batch: list[ScheduledSeq]) -> int:
        """How many speculative steps the MTP head's batch `spec` may take back to back on the
        device (speculate_mtp's `steps`, up to decode_steps; 1 unless the whole batch
        speculates, no sequence has a grammar, no waiting request could
        join now, seeded sampled ones' noise rows (steps x (k + 1) each) stay within
        SEEDED_ROWS, none would cross its trial's judgment (SPEC_TRIAL_STEPS) within them, and
        the KV blocks for their rows are free: (steps - 1)(k + 1) positions past the step's
        own; those are then taken). The steps stop early for nobody: one that has stopped is
        padding after."""
        n = self.ecfg.decode_steps
        if n <= 1 or len(spec) < len(batch) or self._admissible():
            return 1
        seeded = 0
        for item in spec:
            s, p = item.seq, item.seq.params
            if s.grammar is not None:
                return 1
            seeded += p.seed is not None and not p.greedy
            if s.spec_steps < SPEC_TRIAL_STEPS:
                n = min(n, SPEC_TRIAL_STEPS - s.spec_steps)
            room = self.ecfg.max_model_len - s.num_computed_tokens - 2 * k
            n = min(n, p.max_tokens - s.num_output_tokens, 1 + room // (k + 1))
        if seeded:  # (their noise rows for the run: SEEDED_ROWS of the vocabulary's size)
            n = min(n, max(1, SEEDED_ROWS // (seeded * (k + 1))))
        reach = [it.seq.num_computed_tokens + (n - 1) * (k + 1) + 2 * k for it in spec]
        if n <= 1 or not self._take(spec, reach):
            return 1
        return n
