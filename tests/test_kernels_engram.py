"""The GPU lookup kernels (embedding rows, Engram's hash + gather) == the naive reference on fresh
random tables and ids; on CUDA the tables are pinned host memory, read in place by the GPU.

CPU: TRITON_INTERPRET=1 in a subprocess (this file run as a script)."""

from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_interpreted  # (tests/ is on the path)

from volundr.config import EngramConfig
from volundr.kernels.engram.naive import engram_rows, naive_lookup
from volundr.model.engram import pinned_tables

CUDA = torch.cuda.is_available()


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def check(device: str, seed: int, T: int, orders=(2, 3), heads=4, rows=1000, dim=64,
          vocab=5000, hidden=300, dtype=torch.bfloat16) -> None:
    from volundr.kernels.engram.lookup import embedding_lookup, engram_lookup

    g = torch.Generator().manual_seed(seed)
    hash_seeds = tuple(int(x) * 2 + 1 for x in torch.randint(0, 2**30, (len(orders) * heads,),
                                                               generator=g))
    e = EngramConfig(layers=(0,), ngram_orders=orders, heads_per_order=heads,
                     rows_per_head=rows, dim=dim, hash_seeds=hash_seeds)
    m = e.max_order
    ids = torch.randint(0, vocab, (T, m), generator=g)
    tables = [torch.randn(p, dim, generator=g).to(torch.bfloat16) for p in e.table_sizes]
    emb = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
    if device == "cuda":  # the serving layout: pinned host tables, ids and outputs on the GPU
        views, meta = pinned_tables(tables, e, torch.device("cuda"))
        emb_host = emb.pin_memory()
        table, offsets, sizes, ords, seeds = (meta.table, meta.offsets, meta.sizes, meta.orders,
                                              meta.seeds)
    else:
        table = torch.cat(tables)
        emb_host = emb
        offsets = torch.tensor([0] + list(e.table_sizes[:-1])).cumsum(0)
        sizes = torch.tensor(e.table_sizes)
        ords = torch.tensor([n for n in orders for _ in range(heads)], dtype=torch.int32)
        seeds = torch.tensor(hash_seeds)
    d_ids = ids.to(device)
    out = torch.empty(T, e.num_tables * dim, device=device, dtype=dtype)
    got = engram_lookup(d_ids, table, offsets, sizes, ords, seeds, out)
    ref = naive_lookup(engram_rows(ids, e), tables).to(dtype)
    msg = f"seed={seed} T={T} orders={orders}"
    assert torch.equal(got.cpu(), ref), msg
    out = torch.empty(T, hidden, device=device, dtype=dtype)
    got = embedding_lookup(d_ids, emb_host, out)
    assert torch.equal(got.cpu(), emb[ids[:, -1]].to(dtype)), msg


def run_cpu() -> None:
    for T in (1, 7, 33):
        check("cpu", _seed(), T)
    check("cpu", _seed(), 5, orders=(2,), heads=3, dtype=torch.float32)
    check("cpu", _seed(), 0)


def test_interpreter():
    run_interpreted(__file__)


def test_hash_matches_the_contract():
    """engram_rows against the formula of VOLUNDR.md spelled out for one token."""
    e = EngramConfig(layers=(0,), ngram_orders=(2, 3), heads_per_order=1, rows_per_head=97,
                     hash_seeds=(12345, 777))
    ids = torch.tensor([[3, 70000, 5]])
    rows = engram_rows(ids, e)[0].tolist()
    for j, (n, seed) in enumerate(zip((2, 3), (12345, 777))):
        h = seed
        for t in ids[0, 3 - n:].tolist():
            h = ((h ^ t) * 0x5BD1E995) % 2**32
        assert rows[j] == h % e.table_sizes[j]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 16, 2048])
def test_cuda_lookup_from_pinned_host_memory(T):
    check("cuda", _seed(), T, rows=524288, dim=256, vocab=262144, hidden=5120)


if __name__ == "__main__":
    run_cpu()
