"""The speculative step's Triton kernels (volundr.kernels.spec.engine: accept_rows, chain_rows,
next_rows) == their naive references (naive.py) on fresh random inputs: every buffer they
write equal, element for element (integers, and the hidden rows they copy), with padding
sequences, sequences counting none, stops, caps, accept_all, strided views as the graphs pass
them. CPU: TRITON_INTERPRET=1 in a subprocess (this file run as a script); CUDA at the
graphs' sizes."""

from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_interpreted  # (tests/ is on the path)

from volundr.kernels.spec import naive

CUDA = torch.cuda.is_available()


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _garbage(g, *shape, dtype=torch.long, device="cpu"):
    return torch.randint(-5, 100, shape, generator=g).to(device=device, dtype=dtype)


def _both(fn_name: str, make, outs: list[str]) -> None:
    """Runs naive's and engine's fn on two makings of the same arguments (views with the
    graphs' strides); every tensor in outs equal after."""
    from volundr.kernels.spec import engine

    got, want = make(), make()
    getattr(engine, fn_name)(**got)
    getattr(naive, fn_name)(**want)
    for name in outs:
        assert torch.equal(got[name], want[name]), (fn_name, name, got[name], want[name])


def check_accept(n: int, L: int, S: int, device: str, seed: int, accept_all: bool) -> None:
    def make() -> dict:
        g = torch.Generator().manual_seed(seed)
        M = 3
        ng = _garbage(g, n * L, M, device=device)  # the rows' windows: toks its last column
        toks = ng[:, -1].view(n, L)
        a = _garbage(g, n, L, device=device)
        for i in range(n):  # a random run of guesses kept: a_{j-1} == d_j
            r = int(torch.randint(0, L, (1,), generator=g))
            a[i, :r] = toks[i, 1:r + 1]
        q = torch.randint(0, L + 1, (n,), generator=g)
        q[torch.randint(0, n, (1,), generator=g)] = 0  # a padding sequence
        base = torch.arange(n) * L
        cu = torch.cat([torch.zeros(1, dtype=torch.long),
                        torch.stack([base + q, base + L], 1).flatten()]).int().to(device)
        cap = torch.randint(0, L + 2, (n,), generator=g).to(device)
        stop = torch.full((n, S), -1, dtype=torch.long)
        for i in range(0, n, 2):  # some stop ids among the argmax rows
            stop[i, 0] = a[i, int(torch.randint(0, L, (1,), generator=g))]
        ctx0 = torch.randint(1, 500, (n, 1), generator=g)
        ctx = (ctx0 + torch.arange(L)).flatten().int().to(device)
        return dict(a=a, toks=toks, cu=cu, cap=cap, stop=stop.to(device),
                    slot_mapping=_garbage(g, n * L, device=device), ctx=ctx,
                    lens=_garbage(g, n, device=device),
                    cu_commit=_garbage(g, 2 * n + 1, dtype=torch.int32, device=device),
                    m_cu=_garbage(g, 2 * n + 1, dtype=torch.int32, device=device),
                    m_slot=_garbage(g, n * L, device=device),
                    m_ctx=_garbage(g, n * L, dtype=torch.int32, device=device),
                    m_ids=_garbage(g, n * L, device=device), m_last=_garbage(g, n, device=device),
                    pos=_garbage(g, n, device=device), accept_all=accept_all)
    _both("accept_rows", make, ["lens", "cu_commit", "m_cu", "m_slot", "m_ctx", "m_ids",
                                "m_last", "pos"])


def check_chain(n: int, L: int, D: int, dtype, device: str, seed: int) -> None:
    def make() -> dict:
        g = torch.Generator().manual_seed(seed)
        bs, W = 4, 9
        lens = torch.randint(0, L + 1, (n,), generator=g).to(device)
        k = max(L - 1, 1)
        res = _garbage(g, n, k, device=device)  # the step's guesses: a strided column of it
        return dict(lens=lens, pos=torch.randint(0, W * bs - 1, (n,), generator=g).to(device),
                    tables=_garbage(g, n, W, dtype=torch.int32, device=device).abs(),
                    block_size=bs,
                    h=torch.randn(n * L, D, generator=g).to(device=device, dtype=dtype),
                    guess=_garbage(g, n, device=device), m_cu=_garbage(g, 2 * n + 1,
                                                                       dtype=torch.int32,
                                                                       device=device),
                    m_slot=_garbage(g, n * L, device=device),
                    m_ctx=_garbage(g, n * L, dtype=torch.int32, device=device),
                    m_hidden=torch.randn(n * L, D, generator=g).to(device=device, dtype=dtype),
                    m_ids=_garbage(g, n * L, device=device),
                    m_last=torch.randint(0, n * L, (n,), generator=g).to(device),
                    out=res[:, k - 1])
    _both("chain_rows", make, ["pos", "m_cu", "m_slot", "m_ctx", "m_hidden", "m_ids", "m_last",
                               "out"])


def check_next(n: int, L: int, M: int, S: int, device: str, seed: int) -> None:
    def make() -> dict:
        g = torch.Generator().manual_seed(seed)
        bs, W = 4, 40
        a = _garbage(g, n, L, device=device)
        lens = torch.randint(0, L + 1, (n,), generator=g)
        cap = torch.randint(0, 2 * L, (n,), generator=g)
        stop = torch.full((n, S), -1, dtype=torch.long)
        for i in range(0, n, 3):  # some sequences counted a stop last
            stop[i, S - 1] = a[i, max(int(lens[i]) - 1, 0)]
        ctx0 = torch.randint(1, W * bs - 2 * L, (n, 1), generator=g)
        ctx = (ctx0 + torch.arange(L)).flatten().int()
        slots = _garbage(g, 2 * n, device=device)
        return dict(a=a, lens=lens.to(device), guesses=_garbage(g, n, L - 1, device=device),
                    cap=cap.to(device), stop=stop.to(device),
                    ngram_ids=_garbage(g, n * L, M, device=device), ctx=ctx.to(device),
                    tables=_garbage(g, n, W, dtype=torch.int32, device=device).abs(),
                    block_size=bs, pad_id=1, slots0=_garbage(g, n, device=device),
                    cu=_garbage(g, 2 * n + 1, dtype=torch.int32, device=device), slots=slots,
                    slot_mapping=_garbage(g, n * L, device=device))
    _both("next_rows", make, ["cap", "ngram_ids", "ctx", "cu", "slots", "slot_mapping"])


def run_cpu() -> None:
    """Interpreter checks (called in a TRITON_INTERPRET=1 subprocess)."""
    for n, L in ((1, 2), (3, 4), (5, 3), (4, 7)):
        for accept_all in (False, True):
            check_accept(n, L, 3, "cpu", _seed(), accept_all)
        check_chain(n, L, 40, torch.float32, "cpu", _seed())
        check_next(n, L, 3, 2, "cpu", _seed())
        check_next(n, L, 1, 1, "cpu", _seed())


def test_interpreter():
    run_interpreted(__file__)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,L", [(1, 2), (1, 4), (16, 4), (8, 7)])
def test_cuda_spec_kernels(n, L):
    for accept_all in (False, True):
        check_accept(n, L, 4, "cuda", _seed(), accept_all)
    check_chain(n, L, 5120, torch.bfloat16, "cuda", _seed())
    check_next(n, L, 3, 4, "cuda", _seed())


if __name__ == "__main__":
    run_cpu()
