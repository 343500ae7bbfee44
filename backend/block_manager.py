"""Paged attention-KV blocks and per-sequence state slots.

Attention layers keep K/V per token in fixed-size blocks (a block table per sequence maps
positions to blocks). KDA, conv and Engram state is per sequence and fixed-size, so it lives in
`StateSlots`: one slot per running sequence. Refcounts let later features (prefix caching,
forks) share blocks.
"""

from __future__ import annotations

from collections import deque

import numpy as np

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


def grown_from(prev: list[int] | None, n: int, table: list[int]) -> int:
    """How many leading entries of `table` a copy holds that was made of `prev` when it had n:
    n where `table` is that list, grown since by appending (BlockManager.grow), else 0 (another
    table: a new sequence in the slot, one freed and regrown; copy it whole)."""
    return n if prev is table and n <= len(table) else 0


class TableMirror:
    """The block tables of the sequences in the state slots as one int32 array [slots, width],
    kept in step by copying only what each table grew since it was last read: building the
    rows from the lists every step costs ~6 ms of host time a step at 16 sequences of 128K
    tokens (8192 blocks each), while a decode step adds at most a block a sequence. Tables only
    grow by appending (BlockManager.grow) and are replaced, not emptied, when freed; the mirror
    keeps the list it copied for each slot, so `is` tells a grown table from another one (a new
    sequence in the slot, a preempted one regrown), which is copied whole."""

    def __init__(self, num_slots: int, max_blocks: int):
        self.array = np.zeros((num_slots, max(1, max_blocks)), dtype=np.int32)
        self.lists: list[list[int] | None] = [None] * num_slots
        self.synced = [0] * num_slots

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """[len(seqs), width] int32 (a copy): each sequence's block table (its slot's row),
        zero-padded to the longest."""
        width = max([1, *(len(s.block_table) for s in seqs)])
        if width > self.array.shape[1]:
            self.array = np.pad(self.array, ((0, 0), (0, width - self.array.shape[1])))
        for s in seqs:
            t, slot = s.block_table, s.slot
            n = grown_from(self.lists[slot], self.synced[slot], t)
            if n == 0:  # another table (or none copied yet): whole, the rest of the row zeroed
                self.array[slot] = 0
            if n < len(t):
                self.array[slot, n:len(t)] = t[n:]
            self.lists[slot], self.synced[slot] = t, len(t)
        return self.array[[s.slot for s in seqs], :width]
