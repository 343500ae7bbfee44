"""Reference math of the host-table lookups: Engram's n-gram hash (VOLUNDR.md) and row gathers.

Engram table j (order-major: n-gram order ngram_orders[j // heads_per_order]) has p_j rows. For
token t with ids[t - m + 1 .. t] (oldest first, m = max order, positions before the start read
the pad id), its row in table j is
    h = seed_j;  for each id of the n-gram (the last n columns), oldest first:
        h = ((h XOR id) * 0x5BD1E995) mod 2**32
    row_j = h mod p_j.
"""

from __future__ import annotations

import torch

HASH_MULT = 0x5BD1E995  # < 2**31, so (h < 2**32) * HASH_MULT never overflows int64
HASH_MASK = 0xFFFFFFFF


def engram_rows(ngram_ids: torch.Tensor, e) -> torch.Tensor:
    """Table rows of every token.  ngram_ids [T, m] (oldest first) -> [T, tables] long.
    `e`: an EngramConfig (ngram_orders, heads_per_order, hash_seeds, table_sizes)."""
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


def naive_lookup(rows: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
    """rows [T, J] long, tables J x [p_j, D] -> [T, J * D]: row rows[t, j] of table j, side by
    side (Engram's e_t; the token embedding is J = 1 with rows = ids)."""
    return torch.cat([t[rows[:, j].to(t.device)] for j, t in enumerate(tables)], dim=-1)
