"""Full attention layer: GQA, no positional encoding (NoPE), causal, over a paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from volundr import ops
from volundr.config import VolundrConfig
from volundr.model.batch import ForwardBatch
from volundr.model.layers import FusedLinear, NextNorm, Normed, PreNorm, out_proj
from volundr.model.parallel import TP, ColumnParallelLinear, RowParallelLinear, local_kv_heads


class Attention(nn.Module):
    def __init__(self, cfg: VolundrConfig, tp: TP = TP()):
        super().__init__()
        d, self.hd = cfg.hidden_size, cfg.head_dim
        # This rank's heads (all of them at tp == 1); KV heads replicated when tp > Hkv.
        h, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        self.h, self.kvh = h // tp.size, local_kv_heads(kvh, tp.size)
        self.q_proj = ColumnParallelLinear(d, h * self.hd, tp)
        self.k_proj = ColumnParallelLinear(d, self.kvh * tp.size * self.hd, tp)
        self.v_proj = ColumnParallelLinear(d, self.kvh * tp.size * self.hd, tp)
        self.o_proj = RowParallelLinear(h * self.hd, d, tp)  # all-reduces
        self.qkv_proj: FusedLinear | None = None  # built by after_load
        self.scale = self.hd ** -0.5
        # [num_blocks, block_size, kvh, hd] each, bound by the ModelRunner
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def after_load(self) -> None:
        self.qkv_proj = FusedLinear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor | PreNorm | Normed, b: ForwardBatch,
                post: NextNorm | None = None):
        """x [T, d], or the PreNorm / Normed of it that the input projection may fold; with
        `post`, the output may be the Normed of the next norm (`out_proj`)."""
        T, hd = x.shape[0], self.hd
        q, k, v = self.qkv_proj(x).split([self.h * hd, self.kvh * hd, self.kvh * hd], dim=-1)
        q, k, v = q.view(T, self.h, hd), k.view(T, self.kvh, hd), v.view(T, self.kvh, hd)
        # Store first: the new tokens attend to themselves through the cache (prefill may read
        # their K/V from k, v instead).
        ops.store_kv(k, v, self.k_cache, self.v_cache, b.slot_mapping)
        if b.rows is not None:  # a check's tokens as decode rows
            o = ops.paged_attention(q, self.k_cache, self.v_cache, b.rows[1], b.rows[0],
                                    b.rows[2], self.scale, 1, b.max_context_len)
        else:
            o = ops.paged_attention(q, self.k_cache, self.v_cache, b.block_tables, b.cu_seqlens,
                                    b.context_lens, self.scale, b.max_q_len, b.max_context_len,
                                    k, v)
        return out_proj(self.o_proj, o.reshape(T, self.h * self.hd), post)
