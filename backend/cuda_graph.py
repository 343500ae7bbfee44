"""CUDA graphs for the decode step: one new token per sequence, batch padded to a captured size.

Decode at batch 1 launches a few hundred small kernels per token; replaying a captured graph
removes the launch overhead. Everything the forward reads lives in static buffers that `run`
fills before each replay. Padding rows point at a scratch state slot (the runner allocates one
slot more than it hands out), store no KV (slot -1) and see a context of 1, so they never touch
a real sequence. Host lookups (embedding, Engram rows) happen before, in `ModelRunner.prepare`.
"""

from __future__ import annotations

import torch

from volundr.model import ForwardBatch


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CUDAGraphRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, max_bs: int,
                 max_blocks: int, max_model_len: int, scratch_slot: int):
        cfg = model.cfg
        self.model, self.max_bs, self.max_model_len = model, max_bs, max_model_len
        self.scratch_slot = scratch_slot
        z = dict(device=device)
        self.slot_ids = torch.full((max_bs,), scratch_slot, dtype=torch.long, **z)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, **z)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, **z)
        self.context_lens = torch.ones(max_bs, dtype=torch.int32, **z)
        self.cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int32, **z)
        self.inputs_embeds = torch.zeros(max_bs, cfg.hidden_size, dtype=dtype, **z)
        e = cfg.engram
        self.engram = {i: torch.zeros(max_bs, e.num_tables * e.dim, dtype=dtype, **z)
                       for i in e.layers}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
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
            max_context_len=self.max_model_len, ngram_ids=torch.empty(0),
            logits_indices=ar.long(), inputs_embeds=self.inputs_embeds[:bs],
            engram_embeds={i: t[:bs] for i, t in self.engram.items()})

    @torch.inference_mode()
    def _capture(self, bs: int) -> None:
        b = self._batch(bs)
        for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
            self.model.compute_logits(self.model(b))
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.logits[bs] = self.model.compute_logits(self.model(b))
        torch.cuda.synchronize()
        self.graphs[bs] = g

    def can_run(self, b: ForwardBatch) -> bool:
        n = b.num_seqs
        return b.max_q_len == 1 and n <= self.max_bs and b.inputs_embeds.shape[0] == n

    @torch.inference_mode()
    def run(self, b: ForwardBatch) -> torch.Tensor:
        """Decode logits [N, vocab] (fp32) of the N sequences of `b`."""
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
        self.inputs_embeds[:n] = b.inputs_embeds
        for i, t in self.engram.items():
            t[:n] = b.engram_embeds[i]
        self.graphs[bs].replay()
        return self.logits[bs][:n]
