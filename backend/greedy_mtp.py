"""The one-replay greedy MTP step (ModelRunner.check_greedy_mtp): speculate_mtp's step for
greedy sequences as graph replays with one read back at the end.

    check graph -> acceptance -> commit graph -> MTP graph -> (chain rows -> MTP graph) x (k - 1)

The acceptance (argmax rows, greedy and counted lengths, the commit's cu, the MTP block's rows)
and each chain step's rows (the block's next position, its slot, its output and guess) are a
few dozen tiny device ops between the big replays. Launched one by one from Python they cost
more than the data they move (H200, run 139: ~0.8 ms of a k = 1 step beside the graphs, ~0.2 ms
more per further guess), so on CUDA each can be captured as a graph of its own at its first
use and replayed after (`GLUE_GRAPHS`, VOLUNDR_GLUE_GRAPHS=1; opt-in until measured on a GPU). They read and
write static buffers only (the check / MTP graphs' and this object's), and running one twice
writes the same values, so the first use runs eagerly and the capture replays from the next.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

import volundr.check_layout as cl  # (by module: diag_speculative's +accept replaces one)
from volundr.cuda_graph import CheckGraphs, no_gc

GLUE_GRAPHS = os.environ.get("VOLUNDR_GLUE_GRAPHS", "0") == "1"
MAX_STOPS = 16  # stop ids per sequence the captured acceptance takes (more: launched eagerly)


class GreedyMTPStep:
    def __init__(self, checks: CheckGraphs, mtp: CheckGraphs, block_size: int):
        self.checks, self.mtp, self.block_size = checks, mtp, block_size
        n, L, dev = checks.max_n, checks.L, checks.device
        z = dict(dtype=torch.long, device=dev)
        # caps [n] then stop ids [n, S] (padded with -1) of a step
        self.lim = torch.zeros(n * (1 + MAX_STOPS), **z)
        self.pos = torch.zeros(n, **z)  # each sequence's first chain row's position
        self.has = torch.zeros(n, dtype=torch.bool, device=dev)  # a real sequence
        self.one = torch.zeros(2 * n + 1, dtype=torch.int32, device=dev)  # one row each
        self.res = torch.zeros(n * (2 * L), **z)  # argmax rows [n L], lengths [n], guesses
        self.first = torch.arange(n, **z) * L  # each sequence's row 0
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _glue(self, key: tuple, fn: Callable[[], None]) -> None:
        """Runs fn (static buffers in and out, the same writes when run twice): replays its
        graph where one was captured, else runs it and, on CUDA, captures it for next time."""
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return
        fn()
        if GLUE_GRAPHS and self.checks.device.type == "cuda":
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with no_gc(), torch.cuda.graph(g, pool=self.pool):
                fn()
            self.graphs[key] = g

    @torch.inference_mode()
    def run(self, lay: dict[str, list], caps: list[int], stops: list[tuple[int, ...]],
            k: int = 1) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """The check of a layout (ModelRunner.check_layout), the acceptance on the device
        (check_layout.greedy_lengths, then counted_lengths with each sequence's length cap and
        stop ids), the commit of the counted rows, the MTP block over them (its buffers take
        this layout's rows masked to the counted ones), then k - 1 times over one row a
        sequence: its output at the last row and the guess from there, one position further
        (speculate_mtp's `mtp_chain`). Returns each sequence's argmax rows [L], counted lengths
        and k MTP guesses."""
        c, mtp, bs = self.checks, self.mtp, self.block_size
        n, L = len(lay["slots"]) // 2, c.L
        size = c._fill(lay)
        Tn, S = size * L, max(1, *map(len, stops))
        pad = [-1] * S  # (padding sequences: cap 0, no stop ids)
        lim = (caps + [0] * (size - n) + [i for t in stops for i in (list(t) + pad)[:S]]
               + pad * (size - n))
        eager = S > MAX_STOPS
        if eager:
            lim_d = torch.tensor(lim).to(c.device)
        else:
            lim_d = self.lim[:len(lim)]
            lim_d.copy_(torch.tensor(lim).pin_memory(), non_blocking=True)
        g, gcm, logits, _, hidden = c.graphs[size]
        mg, _, guesses, _, h = mtp.graphs[size]
        first = self.first[:size]
        res = self.res[:size * (L + 1 + k)]

        def accept() -> None:
            a = logits[:Tn].argmax(dim=-1).view(size, L)
            toks = c.ngram_ids[:Tn, -1].view(size, L)  # (a row's n-gram window ends in it)
            lens = cl.greedy_lengths(a, toks, c.cu[1:2 * size:2] - c.cu[0:2 * size:2])
            lens = cl.counted_lengths(a, lens, lim_d[:size], lim_d[size:].view(size, S))
            cu = cl.kept_cu(lens, L)
            c.cu_commit[:2 * size + 1] = cu
            live = (torch.arange(L, device=c.device) < lens[:, None]).flatten()
            mtp.cu[:2 * size + 1] = cu
            mtp.slot_mapping[:Tn] = torch.where(live, c.slot_mapping[:Tn], -1)
            mtp.ctx[:Tn] = torch.where(live, c.ctx[:Tn], 1)
            mtp.seq_tables[:size] = c.seq_tables[:size]
            mtp.mtp_hidden[:Tn] = hidden[:Tn]
            mtp.mtp_ids[:Tn] = a.flatten()  # row j is followed by the kept token j
            mtp.mtp_last[:size] = (cu[1::2][:size] - 1).clamp(min=0)
            # the chain's rows: row 0 of each sequence at position p + m + j - 1 (p = its
            # first row's context - 1, m its counted tokens), padding sequences masked
            self.has[:size] = lens > 0
            self.pos[:size] = torch.where(lens > 0, c.ctx[first] - 1 + lens, 0)
            self.one[:2 * size + 1] = cl.kept_cu((lens > 0).to(lens.dtype), L)
            res[:Tn] = a.flatten()
            res[Tn:Tn + size] = lens

        def chain(j: int) -> None:  # guess j + 1 from guess j's row
            res[Tn + size * j:Tn + size * (j + 1)] = guesses[:size]  # (the last replay's)
            h_last = h[mtp.mtp_last[:size]]  # (before the buffers change)
            has, pos = self.has[:size], self.pos[:size] + (j - 1)
            slot = c.seq_tables[torch.arange(size, device=c.device), pos // bs] * bs + pos % bs
            mtp.cu[:2 * size + 1] = self.one[:2 * size + 1]
            mtp.slot_mapping[:Tn] = -1
            mtp.slot_mapping[first] = torch.where(has, slot.long(), -1)
            mtp.ctx[:Tn] = 1
            mtp.ctx[first] = torch.where(has, pos + 1, 1).to(mtp.ctx.dtype)
            mtp.mtp_hidden[first] = h_last
            mtp.mtp_ids[first] = guesses[:size]
            mtp.mtp_last[:size] = first

        run = (lambda key, fn: fn()) if eager else self._glue
        g.replay()
        run(("accept", size, S), accept)
        gcm.replay()
        mg.replay()
        for j in range(1, k):
            run(("chain", size, j), lambda j=j: chain(j))
            mg.replay()
        res[Tn + size * k:] = guesses[:size]
        out = res.tolist()
        drafts = out[Tn + size:]  # guess j of sequence i at j size + i
        return ([out[i * L:(i + 1) * L] for i in range(n)], out[Tn:Tn + n],
                [[drafts[j * size + i] for j in range(k)] for i in range(n)])
