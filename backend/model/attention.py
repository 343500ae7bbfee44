"""Full attention layer: GQA, no positional encoding (NoPE), causal, over a paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from volundr import ops
from volundr.config import VolundrConfig
from volundr.model.batch import ForwardBatch


class Attention(nn.Module):
    def __init__(self, cfg: VolundrConfig):
        super().__init__()
        d, self.hd = cfg.hidden_size, cfg.head_dim
        self.h, self.kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(d, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.kvh * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, d, bias=False)
        self.scale = self.hd ** -0.5
        # [num_blocks, block_size, kvh, hd] each, bound by the ModelRunner
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.h, self.hd)
        k = self.k_proj(x).view(T, self.kvh, self.hd)
        v = self.v_proj(x).view(T, self.kvh, self.hd)
        # Store first: the new tokens attend to themselves through the cache.
        ops.store_kv(k, v, self.k_cache, self.v_cache, b.slot_mapping)
        o = ops.paged_attention(q, self.k_cache, self.v_cache, b.block_tables, b.cu_seqlens,
                                b.context_lens, self.scale, b.max_q_len, b.max_context_len)
        return self.o_proj(o.reshape(T, self.h * self.hd))
