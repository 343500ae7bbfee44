"""The rows of a speculative check (ModelRunner.check / commit), as host lists and tensors.

A check runs up to L tokens of each of n sequences with the recurrent states read only; the
commit then advances them over the tokens each sequence keeps. Rows are laid out L per sequence
(row i * L + j: sequence i's token j). The recurrent kernels see 2n sequences: each real one
followed by a gap over its unused rows (slot -1, which they skip), so one set of shapes serves
any lengths, and the captured graphs (check_graphs.CheckGraphs) any step. Attention sees one
query row per token (`ForwardBatch.rows`): row j of a sequence at position p attends to the
cache up to p + j, its own K/V stored just before.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from volundr.kernels.spec.naive import (  # noqa: F401 (the device side, with the host's)
    counted_lengths,
    greedy_lengths,
    kept_cu,
    next_check,
)
from volundr.model import ForwardBatch
from volundr.scheduler import ScheduledSeq


def check_layout(batch: list[ScheduledSeq], L: int, block_size: int, max_order: int,
                 pad_id: int, lengths: list[int] | None = None) -> dict[str, list]:
    """Host lists of a check of `batch` (item i: its num_new_tokens tokens from
    num_computed_tokens on, 1 <= q_i <= L) or, with `lengths`, of its commit (the first
    lengths[i] tokens; only cu and slots):
      cu [2n + 1]: sequence i's tokens are rows cu[2i]:cu[2i + 1], its gap cu[2i + 1]:cu[2i + 2]
      slots [2n]: (slot, -1) per sequence
      slot_mapping, ngrams, ctx [n L]: each row's KV slot (-1: none), n-gram window and
        context (position + 1; 1 in a gap).
    (The block tables come from the runner's TableMirror: ModelRunner.check_layout.)"""
    out = dict(cu=[0], slots=[], slot_mapping=[], ngrams=[], ctx=[])
    for i, item in enumerate(batch):
        seq, s = item.seq, item.seq.num_computed_tokens
        q = item.num_new_tokens if lengths is None else lengths[i]
        assert 1 <= q <= L, (q, L)
        out["cu"] += [i * L + q, (i + 1) * L]
        out["slots"] += [seq.slot, -1]
        if lengths is not None:
            continue
        window = seq.token_ids[max(0, s - max_order + 1):s + q]
        window = [pad_id] * (q + max_order - 1 - len(window)) + window
        for j in range(L):
            p, live = s + j, j < q
            out["slot_mapping"].append(
                seq.block_table[p // block_size] * block_size + p % block_size if live else -1)
            out["ngrams"].append(window[j:j + max_order] if live else [pad_id] * max_order)
            out["ctx"].append(p + 1 if live else 1)
    return out


def check_batch(lay: dict[str, list], L: int, max_order: int,
                to_device: Callable[[list[int], torch.dtype], torch.Tensor]) -> ForwardBatch:
    """The eager ForwardBatch of a check layout (with its "tables" [n, width]: each sequence's
    block table): every row's logits, attention by rows, the kernels' host dispatch bounded by
    L tokens per sequence (max_q_len)."""
    T, n2 = len(lay["slot_mapping"]), len(lay["slots"])
    tables = np.repeat(lay["tables"], L, axis=0)  # each row its sequence's table
    i64 = lay["slots"] + lay["slot_mapping"] + [i for row in lay["ngrams"] for i in row]
    i32 = np.concatenate([np.asarray(lay["cu"] + list(range(T + 1)) + lay["ctx"], np.int32),
                          tables.ravel()])
    a64, a32 = to_device(i64, torch.long), to_device(i32, torch.int32)
    slot_ids, slot_map, ngram_ids = a64.split([n2, T, T * max_order])
    cu, rows_cu, ctx, table = a32.split([n2 + 1, T + 1, T, tables.size])
    table = table.view(T, -1)
    return ForwardBatch(
        cu_seqlens=cu, cu_list=lay["cu"], slot_ids=slot_ids, slot_mapping=slot_map,
        block_tables=table, context_lens=ctx, max_q_len=L, max_context_len=max(lay["ctx"]),
        ngram_ids=ngram_ids.view(T, max_order), logits_indices=rows_cu[:T].long(),
        rows=(rows_cu, table, ctx))
