"""The rows of a speculative check (ModelRunner.check / commit), as host lists and tensors.

A check runs up to L tokens of each of n sequences with the recurrent states read only; the
commit then advances them over the tokens each sequence keeps. Rows are laid out L per sequence
(row i * L + j: sequence i's token j). The recurrent kernels see 2n sequences: each real one
followed by a gap over its unused rows (slot -1, which they skip), so one set of shapes serves
any lengths, and the captured graphs (cuda_graph.CheckGraphs) any step. Attention sees one
query row per token (`ForwardBatch.rows`): row j of a sequence at position p attends to the
cache up to p + j, its own K/V stored just before.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

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


# ---- on the device: a greedy step's acceptance and its commit's layout, without a read back --
def greedy_lengths(a: torch.Tensor, toks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """speculative.greedy_kept's lengths for n sequences at once: a [n, L] the model's argmax
    after each row, toks [n, L] each row's token (t_0, d_1, ..), q [n] the rows checked (0: a
    padding sequence). Returns [n]: 1 + the leading guesses d_j == a_{j-1} (j < q), 0 where
    q == 0."""
    j = torch.arange(1, a.shape[1], device=a.device)
    match = (a[:, :-1] == toks[:, 1:]) & (j < q[:, None])
    return torch.where(q > 0, 1 + match.long().cumprod(1).sum(1), 0)


def counted_lengths(a: torch.Tensor, lens: torch.Tensor, caps: torch.Tensor,
                    stops: torch.Tensor) -> torch.Tensor:
    """The engine's stop and length rules (LLMEngine._counted) on the device: of sequence i's
    lens[i] kept tokens a[i, :lens[i]] ([n, L]), those up to and including the first of its stop
    ids (stops [n, S], padded with -1) and at most caps[i] [n]."""
    L = a.shape[1]
    hit = (a[:, :, None] == stops[:, None, :]).any(-1)
    first = torch.where(hit, torch.arange(1, L + 1, device=a.device), L).amin(1)
    return torch.minimum(torch.minimum(lens, first), caps)


def kept_cu(lens: torch.Tensor, L: int) -> torch.Tensor:
    """check_layout's cu [2n + 1] for sequence i's first lens[i] rows (a commit's, or the MTP
    block's over the kept rows; lens 0: a padding sequence, its gap over all L rows)."""
    base = torch.arange(lens.shape[0], device=lens.device) * L
    return torch.cat([lens.new_zeros(1), torch.stack([base + lens, base + L], 1).flatten()])


def next_check(a: torch.Tensor, lens: torch.Tensor, guesses: torch.Tensor, caps: torch.Tensor,
               stops: torch.Tensor, ngrams: torch.Tensor, ctx: torch.Tensor,
               tables: torch.Tensor, block_size: int, pad_id: int
               ) -> tuple[torch.Tensor, ...]:
    """The next greedy check of n sequences after one whose rows are known only on the device
    (a multi-step speculative step: no read back between steps). Inputs: a [n, L] the argmax
    after each row, lens [n] the tokens counted (counted_lengths), guesses [n, L - 1] the MTP
    head's next drafts, caps [n] / stops [n, S] the counting's limits, ngrams [n, L, M] /
    ctx [n, L] the step's rows (check_layout's), tables [n, width] the block tables. Each
    sequence still live (it counted tokens, none of them a stop, and may take more) checks
    [a[i, lens - 1], guesses[i]] at the positions after its counted tokens; the others become
    padding (q 0). Returns (q [n]: L or 0, caps [n] less the counted tokens (0 after a stop),
    ngrams [n, L, M], slot_mapping [n, L], ctx [n, L]) as check_layout lays them out."""
    n, L = a.shape
    i = torch.arange(n, device=a.device)
    last = (lens - 1).clamp(min=0)
    tok = a[i, last]
    stopped = (lens > 0) & (tok[:, None] == stops).any(1)
    caps = torch.where(stopped, 0, caps - lens)
    live = (lens > 0) & (caps > 0)
    # row j's window: the M - 1 tokens before it (the last counted row's window ends in the
    # token before a[lens - 1]) and its own
    rows = torch.cat([ngrams[i, last, 1:], tok[:, None], guesses], 1)
    win = rows.unfold(1, ngrams.shape[2], 1)  # [n, L, M]
    pos = (ctx[:, 0] - 1 + lens)[:, None] + torch.arange(L, device=a.device)  # [n, L]
    pos = torch.where(live[:, None], pos, 0)
    slot = (tables[i[:, None], pos // block_size].long() * block_size + pos % block_size)
    return (torch.where(live, L, 0), caps,
            torch.where(live[:, None, None], win, pad_id),
            torch.where(live[:, None], slot, -1),
            torch.where(live[:, None], pos + 1, 1).to(ctx.dtype))
