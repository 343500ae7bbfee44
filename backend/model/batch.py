"""What one forward pass needs besides the weights: the packed batch and its cache indices.

The ModelRunner builds one `ForwardBatch` per engine step. T tokens of N sequences are packed
back to back; sequence n owns tokens cu_list[n]:cu_list[n + 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    cu_seqlens: torch.Tensor         # [N + 1] int32, device
    cu_list: list[int]               # the same on the host
    slot_ids: torch.Tensor           # [N] long, device: state slot of each sequence
    slot_mapping: torch.Tensor       # [T] long, device: KV cache slot of each token
    block_tables: torch.Tensor       # [N, max_blocks] int32, device
    context_lens: torch.Tensor       # [N] int32, device: cached tokens incl. this step's
    max_q_len: int
    max_context_len: int
    # [T, max_order] long: ids[t - max_order + 1 .. t]; the last column is the token itself
    # (NoPE: no position tensor is needed; ids only index the host tables). On the GPU when the
    # model's lookups run there (VolundrForCausalLM.lookups_on_gpu), else on the host.
    ngram_ids: torch.Tensor
    logits_indices: torch.Tensor     # [M] long, device: tokens whose next-token logits we need
    # Precomputed input embeddings (images): rows of the packed batch to overwrite, and values.
    embed_positions: torch.Tensor | None = None  # [E] long
    embeds: torch.Tensor | None = None           # [E, hidden]
    # The lookups, done ahead of the forward by VolundrForCausalLM.gather_inputs.
    inputs_embeds: torch.Tensor | None = None    # [T, hidden], device
    engram_embeds: dict[int, torch.Tensor] | None = None  # layer -> [T, tables * dim], device
    # A speculative check (ModelRunner.check): the recurrent states (KDA, convs) are read, not
    # written; each KDA / Engram layer appends (itself, its inputs) here for ModelRunner.commit.
    stash: list | None = None
    # Attention over one query row per token (a check's few tokens per sequence as decode rows):
    # (cu_seqlens [T + 1] = arange, block_tables [T, max_blocks], context_lens [T]: the token's
    # position + 1); None: attention over cu_seqlens / block_tables / context_lens above.
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.cu_list) - 1
