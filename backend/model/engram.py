"""Engram: DeepSeek-style conditional memory, a hashed n-gram lookup added to the residual.

For n-gram order n and head j the row of token t is hash_{n,j}(ids[t-n+1..t]) mod p_{n,j}
(positions before the start read the pad id). e_t = the rows of all tables concatenated;
k = W_K e_t, v = W_V e_t, alpha = sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(d)), u = alpha v,
h <- h + u + SiLU(causal_conv4(RMSNorm(u))).

The tables are lookup data, not compute: they stay in host memory. On CUDA a layer's tables
are one pinned buffer that the GPU reads in place (volundr.kernels.engram: hash and gather in one
kernel, inside the decode step's CUDA graph); elsewhere the rows are gathered on the host and
copied. The hash math is volundr.kernels.engram.naive.engram_rows.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from volundr import ops
from volundr.config import EngramConfig, VolundrConfig
from volundr.model.batch import ForwardBatch
from volundr.model.layers import RMSNorm


@dataclass(frozen=True)
class LookupMeta:
    """A layer's J tables as one host buffer `table` [sum p_j, D] (pinned) for the GPU lookup;
    table j starts at offsets[j]. offsets, sizes, seeds [J] int64, orders [J] int32, on the GPU."""
    table: torch.Tensor
    offsets: torch.Tensor
    sizes: torch.Tensor
    orders: torch.Tensor
    seeds: torch.Tensor


def pin(t: torch.Tensor) -> torch.Tensor:
    """t in page-locked host memory, which the GPU reads in place: a pinned copy; or, for a
    tensor in shared memory (the tables tensor-parallel ranks share), t itself, its storage
    registered with CUDA in this process, so that host memory still holds one copy for all
    ranks. The registration lasts as long as the process (the tables live as long)."""
    if not t.is_shared():
        return t.pin_memory()
    if not t.is_pinned():
        st = t.untyped_storage()
        err = int(torch.cuda.cudart().cudaHostRegister(st.data_ptr(), st.nbytes(), 0))
        if err:
            warnings.warn(f"cudaHostRegister of a shared host table ({st.nbytes()} bytes) "
                          f"failed (CUDA error {err}): this process pins a copy", stacklevel=2)
            return t.pin_memory()
    return t


def back_to_back(tables: list[torch.Tensor]) -> torch.Tensor | None:
    """[sum p_j, D]: the tables as one tensor when they already lie back to back in one storage
    (volundr.distributed shares a layer's tables that way), else None."""
    t0, end = tables[0], tables[0].data_ptr()
    for t in tables:
        if (not t.is_contiguous() or t.data_ptr() != end or t.shape[1:] != t0.shape[1:]
                or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr()):
            return None
        end += t.numel() * t.element_size()
    return t0.as_strided((sum(t.shape[0] for t in tables), t0.shape[1]), t0.stride())


def pinned_tables(tables: list[torch.Tensor], e: EngramConfig,
                  device: torch.device) -> tuple[list[torch.Tensor], LookupMeta]:
    """The J tables as one pinned buffer (a copy, or in place for tables in shared memory that
    lie back to back); returns views of it (the tables the host path reads) and the LookupMeta
    of the GPU lookup."""
    sizes = [t.shape[0] for t in tables]
    whole = back_to_back(tables) if tables[0].is_shared() else None
    if whole is not None:
        buf = pin(whole)
        views = list(tables) if buf.data_ptr() == whole.data_ptr() else list(buf.split(sizes))
    else:
        buf = torch.empty(sum(sizes), tables[0].shape[1], dtype=tables[0].dtype,
                          pin_memory=True)
        views, off = [], 0
        for t, p in zip(tables, sizes):
            views.append(buf[off:off + p])
            views[-1].copy_(t)
            off += p
    offsets = torch.tensor([0] + sizes[:-1]).cumsum(0)
    orders = [n for n in e.ngram_orders for _ in range(e.heads_per_order)]

    def dev(x, dtype=torch.long):
        return torch.as_tensor(x, dtype=dtype).to(device)

    return views, LookupMeta(buf, dev(offsets), dev(sizes), dev(orders, torch.int32),
                             dev(list(e.hash_seeds)))


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
        # Host-resident tables [p_j, dim] (set by the loader; on CUDA views of one pinned
        # buffer, described by `meta`) and the conv tails [slots, d, conv - 1] (the runner's).
        self.tables: list[torch.Tensor] = []
        self.meta: LookupMeta | None = None
        self.conv_state: torch.Tensor | None = None

    def lookup(self, ngram_ids: torch.Tensor, device: torch.device, dtype: torch.dtype):
        """e [T, tables * dim] on `device` for ngram_ids [T, max_order] (on the GPU when the
        tables are pinned: the GPU hashes and reads them; else on the host)."""
        return ops.engram_lookup(ngram_ids, self.tables, self.meta, self.cfg, device, dtype)

    def forward(self, h: torch.Tensor, b: ForwardBatch, e: torch.Tensor) -> torch.Tensor:
        """h [T, d]; e [T, tables * dim], the rows `lookup` gathered ahead of the forward."""
        k, v = self.k_proj(e), self.v_proj(e)
        score = (self.h_norm(h).float() * self.k_norm(k).float()).sum(-1, keepdim=True)
        u = (torch.sigmoid(score * self.inv_sqrt_d) * v.float()).to(h.dtype)
        x = self.u_norm(u)
        c = self._conv(x, b, update=b.stash is None)
        if b.stash is not None:
            b.stash.append((self, (x,)))
        return h + u + c

    def _conv(self, x: torch.Tensor, b: ForwardBatch, update: bool) -> torch.Tensor:
        few = b.max_q_len if b.rows is not None else None  # a check's few tokens
        return ops.causal_conv(x, self.conv1d.weight, self.conv_state, b.slot_ids, b.cu_seqlens,
                               activation="silu", update_state=update, max_len=few)

    def commit(self, inputs: tuple, b: ForwardBatch) -> None:
        """The conv tail advanced over a check's kept tokens (see KDA.commit)."""
        self._conv(*inputs, b, update=True)
