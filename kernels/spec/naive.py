"""A speculative step's small device work between its graph replays
(volundr.check_graphs.CheckGraphs.run_greedy_mtp), in PyTorch: the reference of engine.py's
Triton kernels, and what the CPU runs.

Rows as volundr.check_layout lays them out: n sequences x L rows (row i L + j: sequence i's
token j; L = k + 1 for k guesses), cu [2n + 1] (each sequence's rows, then its gap), slots
[2n] ((slot, -1) per sequence), slot_mapping / ngram_ids / ctx per row. Per step:
  accept_rows  after the check: its chosen rows a [n, L] (the argmax, or sampled sequences'
               draws) -> the counted lengths (guesses kept while equal to them), the commit's
               cu and the MTP block's inputs over the counted rows;
  chain_rows   before each further MTP guess: the block's one row a sequence at the next
               position, over its own output there;
  next_rows    the next check's rows ([the last counted token, the k new guesses]).
"""

from __future__ import annotations

import torch


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


def accept_rows(a: torch.Tensor, toks: torch.Tensor, cu: torch.Tensor, cap: torch.Tensor,
                stop: torch.Tensor, slot_mapping: torch.Tensor, ctx: torch.Tensor,
                lens: torch.Tensor, cu_commit: torch.Tensor, m_cu: torch.Tensor,
                m_slot: torch.Tensor, m_ctx: torch.Tensor, m_ids: torch.Tensor,
                m_last: torch.Tensor, pos: torch.Tensor, accept_all: bool = False) -> None:
    """After a check of n sequences: a [n, L] its chosen rows, toks [n, L] the rows' tokens,
    cu [2n + 1] its layout, cap [n] / stop [n, S] the counting's limits, slot_mapping / ctx
    [n L] its rows'. Writes lens [n] (the tokens counted: greedy acceptance, then
    counted_lengths; accept_all: every checked row kept, a perfect head's diagnostic),
    cu_commit (the commit's cu), the MTP block's inputs over the counted rows (m_cu, m_slot and
    m_ctx masked to them, m_ids = a: row j is followed by the kept token j, m_last [n] each
    sequence's last counted row) and pos [n] (the first chain row's position: p + m - 1 + 1 for
    m counted tokens at p = ctx[row 0] - 1; 0 for a sequence counting none)."""
    n, L = a.shape
    q = (cu[1:2 * n:2] - cu[0:2 * n:2]).long()
    kept = q if accept_all else greedy_lengths(a, toks, q)
    lens.copy_(counted_lengths(a, kept, cap, stop))
    c = kept_cu(lens, L)
    cu_commit.copy_(c)
    m_cu.copy_(c)
    live = (torch.arange(L, device=a.device) < lens[:, None]).flatten()
    m_slot.copy_(torch.where(live, slot_mapping, -1))
    m_ctx.copy_(torch.where(live, ctx, 1))
    m_ids.copy_(a.flatten())
    m_last.copy_((c[1::2] - 1).clamp(min=0))
    pos.copy_(torch.where(lens > 0, ctx[::L] - 1 + lens, 0))


def chain_rows(lens: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor, block_size: int,
               h: torch.Tensor, guess: torch.Tensor, m_cu: torch.Tensor, m_slot: torch.Tensor,
               m_ctx: torch.Tensor, m_hidden: torch.Tensor, m_ids: torch.Tensor,
               m_last: torch.Tensor, out: torch.Tensor) -> None:
    """Before the MTP block's next guess of n sequences (L rows each): lens [n] the counted
    tokens (0: padding), pos [n] the position of the row to run (then advanced by one), tables
    [n, width] the block tables, h [n L, d] the block's last output, guess [n] its last guess.
    Stores guess into out [n]; the block then runs row 0 of each counting sequence at pos over
    h at its last row (m_last) followed by the guess: m_cu one row a sequence, m_slot / m_ctx
    that row's slot and context (-1 / 1 elsewhere), m_hidden / m_ids its inputs, m_last row 0."""
    n = lens.shape[0]
    L = m_slot.shape[0] // n
    first = torch.arange(n, device=lens.device) * L
    out.copy_(guess)
    h_last = h[m_last]
    slot = tables[torch.arange(n, device=lens.device), pos // block_size].long() * block_size \
        + pos % block_size
    m_cu.copy_(kept_cu((lens > 0).to(lens.dtype), L))
    m_slot.fill_(-1)
    m_slot[first] = torch.where(lens > 0, slot, -1)
    m_ctx.fill_(1)
    m_ctx[first] = torch.where(lens > 0, pos + 1, 1).to(m_ctx.dtype)
    m_hidden[first] = h_last
    m_ids[first] = guess
    m_last.copy_(first)
    pos.add_(1)


def next_rows(a: torch.Tensor, lens: torch.Tensor, guesses: torch.Tensor, cap: torch.Tensor,
              stop: torch.Tensor, ngram_ids: torch.Tensor, ctx: torch.Tensor,
              tables: torch.Tensor, block_size: int, pad_id: int, slots0: torch.Tensor,
              cu: torch.Tensor, slots: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """next_check in place: the check buffers (cu [2n + 1], slots [2n], ngram_ids [n L, M],
    slot_mapping / ctx [n L]) and cap [n] become the next step's; slots0 [n] each sequence's
    state slot (padding: -1)."""
    n, L = a.shape
    q, c, win, sm, cx = next_check(a, lens, guesses, cap, stop, ngram_ids.view(n, L, -1),
                                   ctx.view(n, L), tables, block_size, pad_id)
    cap.copy_(c)
    cu.copy_(kept_cu(q, L))
    slots[0::2] = torch.where(q > 0, slots0, -1)
    ngram_ids.copy_(win.flatten(0, 1))
    slot_mapping.copy_(sm.flatten())
    ctx.copy_(cx.flatten())
