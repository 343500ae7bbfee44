"""Engram: DeepSeek-style conditional memory, a hashed n-gram lookup added to the residual.

For n-gram order n and head j the row of token t is hash_{n,j}(ids[t-n+1..t]) mod p_{n,j}
(positions before the start read the pad id). e_t = the rows of all tables concatenated;
k = W_K e_t, v = W_V e_t, alpha = sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(d)), u = alpha v,
h <- h + u + SiLU(causal_conv4(RMSNorm(u))).

The tables are lookup data, not compute: they stay in host memory and only the rows a step
needs are gathered and copied to the device. Row indices depend on token ids alone, so the
runner hashes once per step for every Engram layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from volundr import ops
from volundr.config import EngramConfig, VolundrConfig
from volundr.model.batch import ForwardBatch
from volundr.model.layers import RMSNorm

HASH_MULT = 0x5BD1E995  # < 2**31, so (h < 2**32) * HASH_MULT never overflows int64
HASH_MASK = 0xFFFFFFFF


def engram_rows(ngram_ids: torch.Tensor, e: EngramConfig) -> torch.Tensor:
    """Table rows of every token.  ngram_ids [T, max_order] (oldest first) -> [T, tables] long.

    hash_{n,j}: h = seed_{n,j}; for each id of the n-gram, oldest first:
    h = ((h XOR id) * 0x5BD1E995) mod 2**32; row = h mod p_{n,j}.
    """
    T, m = ngram_ids.shape
    ids = ngram_ids.long()
    sizes = e.table_sizes
    out = torch.empty(T, e.num_tables, dtype=torch.long, device=ids.device)
    j = 0
    for n in e.ngram_orders:
        for _ in range(e.heads_per_order):
            h = torch.full((T,), e.hash_seeds[j], dtype=torch.long, device=ids.device)
            for col in range(m - n, m):
                h = ((h ^ ids[:, col]) * HASH_MULT) & HASH_MASK
            out[:, j] = h % sizes[j]
            j += 1
    return out


class Engram(nn.Module):
    def __init__(self, cfg: VolundrConfig):
        super().__init__()
        e, d = cfg.engram, cfg.hidden_size
        self.cfg = e
        self.k_proj = nn.Linear(e.num_tables * e.dim, d, bias=False)
        self.v_proj = nn.Linear(e.num_tables * e.dim, d, bias=False)
        self.h_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.u_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(d, e.conv_size))
        self.inv_sqrt_d = 1.0 / math.sqrt(d)
        # Host-resident tables [p_j, dim] (set by the loader, pinned when serving on CUDA) and
        # the conv tails [slots, d, conv - 1] (bound by the ModelRunner).
        self.tables: list[torch.Tensor] = []
        self.conv_state: torch.Tensor | None = None

    def gather(self, rows: torch.Tensor, device: torch.device, dtype: torch.dtype):
        """e [T, tables * dim] on `device`: the looked-up rows, gathered on the host."""
        e = torch.cat([t[rows[:, j]] for j, t in enumerate(self.tables)], dim=-1)
        if device.type == "cuda":
            e = e.pin_memory().to(device, non_blocking=True)
        return e.to(device=device, dtype=dtype)

    def forward(self, h: torch.Tensor, b: ForwardBatch, e: torch.Tensor) -> torch.Tensor:
        """h [T, d]; e [T, tables * dim], the rows gathered by `gather` ahead of the forward."""
        k, v = self.k_proj(e), self.v_proj(e)
        score = (self.h_norm(h).float() * self.k_norm(k).float()).sum(-1, keepdim=True)
        u = (torch.sigmoid(score * self.inv_sqrt_d) * v.float()).to(h.dtype)
        c = ops.causal_conv(self.u_norm(u), self.conv1d.weight, self.conv_state, b.slot_ids,
                            b.cu_seqlens, activation="silu")
        return h + u + c
