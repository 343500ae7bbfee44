"""Paged attention-KV blocks and per-sequence state slots.

Attention layers keep K/V per token in fixed-size blocks (a block table per sequence maps
positions to blocks). KDA, conv and Engram state is per sequence and fixed-size, so it lives in
`StateSlots`: one slot per running sequence. Refcounts let later features (prefix caching,
forks) share blocks.
"""

from __future__ import annotations

from collections import deque

from volundr.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must add so that its table covers `num_tokens` positions."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        n = self.extra_blocks(seq, num_tokens)
        if n > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {n}, have {self.num_free}")
        for _ in range(n):
            b = self.free_blocks.popleft()
            self.ref_counts[b] = 1
            seq.block_table.append(b)

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)
        seq.block_table = []


class StateSlots:
    """Fixed-size per-sequence state (KDA recurrent + conv tails + Engram conv tails)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no free state slot")
        return self.free_slots.popleft()

    def free(self, slot: int) -> None:
        if slot in self.free_slots:
            raise RuntimeError(f"state slot {slot} freed twice")
        self.free_slots.append(slot)
