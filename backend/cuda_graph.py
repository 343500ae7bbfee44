"""CUDA graphs for the decode step: one new token per sequence, batch padded to a captured size.

Decode at batch 1 launches a few hundred small kernels per token; replaying a captured graph
removes the launch overhead. Everything the forward reads lives in static buffers that `run`
fills before each replay. Padding rows point at a scratch state slot (the runner allocates one
slot more than it hands out), store no KV (slot -1) and see a context of 1, so they never touch
a real sequence (their n-gram ids are the pad id, which any table row serves). The lookups of
the host tables (embedding, Engram) are part of the graph: the GPU reads the pinned tables in
place, so a step's only inputs are small index tensors.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from volundr.model import ForwardBatch


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


@contextmanager
def no_gc():
    """Python's cycle collector off while a graph is captured. torch 2.13 no longer collects
    before a capture (torch.cuda.graph's force_cudagraph_gc), so a cycle collected in the middle
    of one could free CUDA objects of an engine built earlier (its graphs, tensors used on other
    streams), calls a capture does not allow: the capture fails (once in run 134: "operation
    failed due to a previous error during capture", the MTP block left eager). No collection
    first: cycles left over are collected after the capture, and one collection per captured
    size would add to start-up."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def check_room(device: torch.device, budget_bytes: int | None, need: int) -> None:
    """Raises RuntimeError unless `need` bytes fit what the allocator may still take. An
    out-of-memory inside a capture does not raise: it ends the process ("Fatal Python
    error: Aborted", H100 run 75), so the room is checked before. The capture allocates from
    the graphs' private pool, which cannot take blocks cached in the default one (they are
    handed back first); blocks a larger capture left free in the pool count as room."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    room = free
    if budget_bytes is not None:
        room = min(room, budget_bytes - reserved)
    room += reserved - torch.cuda.memory_allocated(device)  # free blocks of the graph pool
    margin = need // 8 + 16 * 2**20  # segment rounding, fragmentation
    if need + margin > room:
        raise RuntimeError(f"no room to capture a CUDA graph: it needs ~{need / 2**20:.0f}"
                           f" MiB, {max(room, 0) / 2**20:.0f} MiB is left under the budget")


class CUDAGraphRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, max_bs: int,
                 max_blocks: int, max_model_len: int, scratch_slot: int, tp: bool = False,
                 budget_bytes: int | None = None):
        """tp: a tensor-parallel rank; its graphs hold NCCL collectives (and rank > 0 captures
        no logits: `run` returns None there). budget_bytes: the process's allocator cap (the
        captures must fit under it: `_check_room`). Raises RuntimeError when a size cannot be
        captured (the caller then decodes eagerly)."""
        cfg = model.cfg
        self.model, self.max_bs, self.max_model_len = model, max_bs, max_model_len
        # NCCL's watchdog thread queries events while a rank captures: only this thread's
        # calls must be capture-safe.
        self.mode = "thread_local" if tp else "global"
        self.scratch_slot = scratch_slot
        z = dict(device=device)
        self.slot_ids = torch.full((max_bs,), scratch_slot, dtype=torch.long, **z)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, **z)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, **z)
        self.context_lens = torch.ones(max_bs, dtype=torch.int32, **z)
        self.cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int32, **z)
        self.ngram_ids = torch.full((max_bs, cfg.engram.max_order), cfg.engram.pad_id,
                                    dtype=torch.long, **z)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor | None] = {}
        self.device, self.budget_bytes = device, budget_bytes
        self.build_peak = 0  # the allocator's peak before and during the captures' warm-ups
        self.pool = torch.cuda.graph_pool_handle()
        for bs in reversed(capture_sizes(max_bs)):
            self._capture(bs)

    def _batch(self, bs: int) -> ForwardBatch:
        ar = self.cu_seqlens[:bs]
        return ForwardBatch(
            cu_seqlens=self.cu_seqlens[:bs + 1],
            cu_list=list(range(bs + 1)), slot_ids=self.slot_ids[:bs],
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs], max_q_len=1,
            max_context_len=self.max_model_len, ngram_ids=self.ngram_ids[:bs],
            logits_indices=ar.long())

    def _step(self, b: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(b))

    def _check_room(self, need: int) -> None:
        check_room(self.device, self.budget_bytes, need)

    @torch.inference_mode()
    def _capture(self, bs: int) -> None:
        b = self._batch(bs)
        base = torch.cuda.memory_allocated(self.device)
        # the warm-up's peak is what the capture needs; the process's peak so far is kept
        self.build_peak = max(self.build_peak, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
            self._step(b)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        self.build_peak = max(self.build_peak, peak)
        self._check_room(peak - base)
        g = torch.cuda.CUDAGraph()
        with no_gc(), torch.cuda.graph(g, pool=self.pool, capture_error_mode=self.mode):
            self.logits[bs] = self._step(b)
        torch.cuda.synchronize()
        self.graphs[bs] = g

    def can_run(self, b: ForwardBatch) -> bool:
        """A decode step (one token per sequence, no image embeddings) of at most max_bs."""
        return (b.max_q_len == 1 and b.num_seqs <= self.max_bs and b.embeds is None
                and b.ngram_ids.is_cuda and bool(self.graphs))

    def release(self) -> None:
        """Destroys the graphs (idempotent; decode then runs eagerly). A tensor-parallel rank
        must do this before it destroys its process group: NCCL's communicator teardown waits
        until every graph that captured one of its collectives is gone (pytorch#115388)."""
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.logits.clear()
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, b: ForwardBatch) -> torch.Tensor | None:
        """Decode logits [N, vocab] (fp32) of the N sequences of `b` (None on a tensor-parallel
        rank > 0)."""
        n = b.num_seqs
        bs = next(s for s in sorted(self.graphs) if s >= n)
        self.slot_ids[:bs].fill_(self.scratch_slot)
        self.slot_mapping[:bs].fill_(-1)
        self.context_lens[:bs].fill_(1)
        self.block_tables[:bs].zero_()
        self.slot_ids[:n] = b.slot_ids
        self.slot_mapping[:n] = b.slot_mapping
        self.context_lens[:n] = b.context_lens
        self.block_tables[:n, :b.block_tables.shape[1]] = b.block_tables
        self.ngram_ids[:bs].fill_(self.model.cfg.engram.pad_id)
        self.ngram_ids[:n] = b.ngram_ids
        self.graphs[bs].replay()
        logits = self.logits[bs]
        return None if logits is None else logits[:n]
