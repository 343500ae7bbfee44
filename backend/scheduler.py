"""Continuous batching with chunked prefill.

Each step gets a token budget (`max_num_batched_tokens`). Running sequences that decode get one
token each first (latency), then unfinished prefills continue, then waiting requests are
admitted while a state slot, KV blocks and budget remain and fewer than `max_num_seqs` run. A
long prompt is split over steps (chunked prefill): the KDA state and KV cache carry the prefix.
Waiting requests are admitted by priority (lower first), then arrival. When KV blocks run out,
the most recently admitted sequence of the lowest priority is preempted and later recomputed
(its fixed-size KDA state cannot be rebuilt without re-reading its tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from volundr.block_manager import BlockManager, StateSlots
from volundr.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens [num_computed, num_computed + num_new) run this step

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, slots: StateSlots, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.bm = block_manager
        self.slots = slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq, ahead_of_equals=False)

    def _enqueue(self, seq: Sequence, ahead_of_equals: bool) -> None:
        """Into the waiting queue behind every more urgent request, and behind (a new request)
        or ahead of (a preempted one) the requests of its own priority."""
        p = seq.priority
        at = next((i for i, w in enumerate(self.waiting)
                   if w.priority > p or (ahead_of_equals and w.priority == p)), len(self.waiting))
        self.waiting.insert(at, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        # Decoding sequences first, then continuing prefills; each in admission order.
        order = sorted(self.running, key=lambda s: not s.is_decoding)
        scheduled: set[int] = set()
        for seq in order:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted in this loop
                continue
            n = min(seq.num_pending_tokens, budget)
            while not self.bm.can_grow(seq, seq.num_computed_tokens + n):
                # The newest of the least urgent sequences not already in this step's batch
                # gives way (maybe seq).
                victim = max((s for s in reversed(self.running) if s.seq_id not in scheduled),
                             key=lambda s: s.priority)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            scheduled.add(seq.seq_id)
            self.bm.grow(seq, seq.num_computed_tokens + n)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_pending_tokens, budget)
            # (a resumed session starts with num_computed_tokens > 0: blocks for those too)
            if (self.slots.num_free == 0
                    or not self.bm.can_grow(seq, seq.num_computed_tokens + n)):
                break
            self.waiting.popleft()
            seq.slot = self.slots.allocate()
            seq.status = SequenceStatus.RUNNING
            self.bm.grow(seq, seq.num_computed_tokens + n)
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self._release(seq)
        seq.reset_for_recompute()
        self._enqueue(seq, ahead_of_equals=True)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its blocks and slot (also used for aborts)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.bm.free(seq)
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None
