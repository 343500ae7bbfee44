"""CUDA graphs of speculative checks (volundr.check_layout's rows), their commits and the MTP
block, and a greedy or sampled speculative step replayed from them with its acceptance on the
device (`run_greedy_mtp`, the work between the replays: volundr.kernels.spec), one read back for
a run of steps. Padding as in volundr.cuda_graph's decode graphs.
"""

from __future__ import annotations

import numpy as np
import torch

from volundr.cuda_graph import capture_sizes, check_room, no_gc
from volundr.sampler import to_device


class CheckGraphs:
    """Graphs of speculative checks and their commits (ModelRunner.check / commit): for each
    captured n, a check of n sequences x L rows and the commit that reads what it stashed.
    Padding sequences have slot -1 (the recurrent kernels skip them) and rows that store no KV
    and see a context of 1, like the decode graphs' padding."""

    def __init__(self, model, device: torch.device, L: int, max_n: int, max_blocks: int,
                 max_model_len: int, logits: bool, budget_bytes: int | None = None,
                 mtp: torch.dtype | None = None):
        """logits: the checks end in the logits of every row (the model's check), or in the
        hidden states only (a drafter catching up). mtp (the compute dtype): the graphs run the
        MTP block instead (`run_mtp`), no commits. Raises RuntimeError where a size cannot be
        captured (the runner then checks eagerly)."""
        from volundr.model import ForwardBatch

        self.model, self.L, self.max_n, self.logits = model, L, max_n, logits
        self.device, self.budget_bytes, self.mtp = device, budget_bytes, mtp is not None
        T, z = max_n * L, dict(device=device)
        if self.mtp:  # the rows' hidden states and next ids; each sequence's last row
            self.mtp_hidden = torch.zeros(T, model.cfg.hidden_size, dtype=mtp, **z)
            self.mtp_ids = torch.zeros(T, dtype=torch.long, **z)
            self.mtp_last = torch.zeros(max_n, dtype=torch.long, **z)
        m, pad = model.cfg.engram.max_order, model.cfg.engram.pad_id
        self.cu = torch.zeros(2 * max_n + 1, dtype=torch.int32, **z)
        self.cu_commit = torch.zeros(2 * max_n + 1, dtype=torch.int32, **z)
        self.slots = torch.full((2 * max_n,), -1, dtype=torch.long, **z)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.long, **z)
        self.ngram_ids = torch.full((T, m), pad, dtype=torch.long, **z)
        self.seq_tables = torch.zeros(max_n, max_blocks, dtype=torch.int32, **z)
        self.tables = torch.zeros(T, max_blocks, dtype=torch.int32, **z)  # per row, in-graph
        self.ctx = torch.ones(T, dtype=torch.int32, **z)
        self.rows_cu = torch.arange(T + 1, dtype=torch.int32, **z)
        self.graphs: dict[int, tuple] = {}  # n -> (check graph, commit graph, logits)
        # a perfect head's diagnostic (perf/diag_speculative.py +accept): every checked row kept
        self.accept_all = False
        self.pool = torch.cuda.graph_pool_handle()
        for n in reversed(capture_sizes(max_n)):
            # captured with whole rows (no gaps): the host-side dispatch sees L tokens each
            cu_list = [0, *(x for i in range(n) for x in ((i + 1) * L, (i + 1) * L))]
            Tn = n * L

            def batch(cu: torch.Tensor, n=n, Tn=Tn, cu_list=tuple(cu_list)) -> ForwardBatch:
                return ForwardBatch(
                    cu_seqlens=cu[:2 * n + 1], cu_list=list(cu_list), slot_ids=self.slots[:2 * n],
                    slot_mapping=self.slot_mapping[:Tn], block_tables=self.tables[:Tn],
                    context_lens=self.ctx[:Tn], max_q_len=L, max_context_len=max_model_len,
                    ngram_ids=self.ngram_ids[:Tn], logits_indices=self.rows_cu[:Tn].long(),
                    rows=(self.rows_cu[:Tn + 1], self.tables[:Tn], self.ctx[:Tn]))
            self.cu[:2 * n + 1] = torch.tensor(cu_list)
            self.cu_commit.copy_(self.cu)
            self._capture(n, batch(self.cu), batch(self.cu_commit))

    def _check(self, b) -> tuple[torch.Tensor | None, list, torch.Tensor]:
        n = b.num_seqs // 2  # each row takes its sequence's block table
        self.tables[:n * self.L].view(n, self.L, -1).copy_(self.seq_tables[:n, None])
        b.stash = []
        if self.mtp:  # each sequence's greedy guess from its last row: [n]
            Tn = n * self.L
            e = self.model.embed(self.mtp_ids[:Tn], self.device, self.mtp_hidden.dtype)
            h = self.model.mtp(self.mtp_hidden[:Tn], e, b)
            return self.model.compute_logits(h[self.mtp_last[:n]]).argmax(dim=-1), [], h
        hidden = self.model(b)
        return (self.model.compute_logits(hidden) if self.logits else None), b.stash, hidden

    @staticmethod
    def _commit(stash: list, b) -> None:
        for module, inputs in stash:
            module.commit(inputs, b)

    @torch.inference_mode()
    def _capture(self, n: int, b, bc) -> None:
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(2):  # warm-ups: Triton compiles outside the capture (slots all -1)
            _, stash, _ = self._check(b)
            self._commit(stash, bc)
        torch.cuda.synchronize()
        check_room(self.device, self.budget_bytes,
                   torch.cuda.max_memory_allocated(self.device) - base)
        g, gcm = torch.cuda.CUDAGraph(), None if self.mtp else torch.cuda.CUDAGraph()
        with no_gc(), torch.cuda.graph(g, pool=self.pool):
            logits, stash, hidden = self._check(b)
        if gcm is not None:
            with no_gc(), torch.cuda.graph(gcm, pool=self.pool):
                self._commit(stash, bc)
        torch.cuda.synchronize()
        # (the stash stays allocated for the commit, the hidden states for an MTP draft)
        self.graphs[n] = (g, gcm, logits, stash, hidden)

    def can_run(self, n: int, L: int, logits: bool) -> bool:
        return L == self.L and n <= self.max_n and logits <= self.logits and bool(self.graphs)

    def _size(self, n: int) -> int:
        return next(s for s in sorted(self.graphs) if s >= n)

    def _padded_cu(self, lay: dict[str, list], size: int) -> list[int]:
        """The layout's cu for a graph of `size` sequences: each padding sequence empty and its
        gap over its L rows."""
        L, n = self.L, len(lay["slots"]) // 2
        return lay["cu"] + [x for i in range(n, size) for x in (i * L, (i + 1) * L)]

    @torch.inference_mode()
    def run_check(self, lay: dict[str, list]) -> torch.Tensor | None:
        """Replays the check of a layout (ModelRunner.check_layout); logits [n * L, vocab]."""
        g, _, logits, _, hidden = self.graphs[self._fill(lay)]
        g.replay()
        T = len(lay["slots"]) // 2 * self.L
        self.hidden = hidden[:T]  # the rows' hidden states before the final norm (MTP drafts)
        return None if logits is None else logits[:T]

    @torch.inference_mode()
    def run_mtp(self, lay: dict[str, list], hidden: torch.Tensor, ids: list[int]
                ) -> tuple[list[int], torch.Tensor]:
        """Replays the MTP block over a layout's rows (sequence i's first m_i of its L rows):
        hidden [sum m_i, d] the rows' hidden states, ids their next tokens, in row order.
        Returns each sequence's greedy guess after its last row and the block's output there
        [n, d] (a copy)."""
        n, L = len(lay["slots"]) // 2, self.L
        lens = [lay["cu"][2 * i + 1] - lay["cu"][2 * i] for i in range(n)]
        rows = [i * L + j for i, m in enumerate(lens) for j in range(m)]
        last = [i * L + m - 1 for i, m in enumerate(lens)]
        size = self._fill(lay)
        a = to_device(rows + ids + last, torch.long, self.device)
        idx, nxt, a_last = a.split([len(rows), len(ids), n])
        self.mtp_hidden.index_copy_(0, idx, hidden)
        self.mtp_ids.index_copy_(0, idx, nxt)
        self.mtp_last[:n] = a_last
        g, _, guesses, _, h = self.graphs[size]
        g.replay()
        return guesses[:n].tolist(), h[self.mtp_last[:n]]

    @torch.inference_mode()
    def run_greedy_mtp(self, lay: dict[str, list], mtp: CheckGraphs, caps: list[int],
                       stops: list[tuple[int, ...]], k: int = 1, block_size: int = 0,
                       steps: int = 1, choose=None, record=None, adjust=None
                       ) -> list[tuple[list[list[int]], list[int], list[list[int]]]]:
        """`steps` speculate_mtp steps of greedy (or unseeded sampled: `choose`) sequences
        replayed back to back with one read back. A step: the check of a layout; each row's
        token and the acceptance on the device, then each sequence's length cap and stop ids
        (accept_rows); the commit of the counted rows; the MTP block over them (`mtp`: the MTP
        graphs, whose buffers take this layout's rows masked to the counted ones); then k - 1
        times over one row a sequence (chain_rows): its output at the last row and the guess
        from there, one position further (speculate_mtp's `mtp_chain`; block_size: the KV
        blocks', for the rows' slots). The next step checks each sequence's last counted token
        and its k new guesses (next_rows; a sequence that stopped or reached its cap is padding
        from then on; its KV blocks must reach (steps - 1)(k + 1) + 2k positions past the first
        check's). The ops: volundr.ops.spec_ops (Triton on CUDA). choose(logits [R, V], out
        [R], emitted [size]): each row's token given each sequence's tokens counted earlier in
        the run (sampler.RowChooser; None: the argmax). adjust(logits [R, V], ids [size, L],
        emitted [size]) -> the logits that choose / the argmax read (sampler.RowAdjuster:
        penalties, logit_bias, min_tokens), then adjust.advance(chosen, lens) after the
        acceptance. record(logits [R, V], chosen [size, L]): the raw logits, called after each
        check (before the next one overwrites them). Returns per step each sequence's chosen
        rows [L], counted lengths and k MTP guesses."""
        from volundr.ops import spec_ops

        ops = spec_ops(self.cu)
        n, L = len(lay["slots"]) // 2, self.L
        size = self._fill(lay)
        Tn, S = size * L, max(1, *map(len, stops))
        pad = [-1] * S  # (padding sequences: cap 0, no stop ids)
        lim = (caps + [0] * (size - n) + [i for t in stops for i in (list(t) + pad)[:S]]
               + pad * (size - n))
        lim = to_device(lim, torch.long, self.device)
        cap, stop = lim[:size], lim[size:].view(size, S)
        slots = self.slots[0:2 * size:2].clone()
        g, gcm, logits, _, hidden = self.graphs[size]
        mg, _, guesses, _, _ = mtp.graphs[size]
        mtp.seq_tables[:size] = self.seq_tables[:size]
        pos = torch.empty(size, dtype=torch.long, device=self.device)
        # each step's results, read back once: chosen rows [size, L], counted lengths [size],
        # the MTP head's k guesses [size, k]
        w = Tn + size + size * k
        res = torch.empty(steps, w, dtype=torch.long, device=self.device)
        emitted = torch.zeros(size, dtype=torch.long, device=self.device)  # (choose's, adjust's)
        for step in range(steps):
            a, lens, out = res[step].split([Tn, size, size * k])
            a, out = a.view(size, L), out.view(size, k)
            g.replay()
            rows = logits[:Tn] if adjust is None else adjust(
                logits[:Tn], self.ngram_ids[:Tn, -1].view(size, L), emitted)
            if choose is None:
                torch.argmax(rows, dim=-1, out=a.view(Tn))
            else:
                choose(rows, a.view(Tn), emitted)
            if record is not None:
                record(logits[:Tn], a)
            self._accept_rows(ops, mtp, a, cap, stop, lens, pos)
            if adjust is not None:
                adjust.advance(a, lens)
            gcm.replay()
            mtp.mtp_hidden[:Tn] = hidden[:Tn]
            mg.replay()
            for j in range(k - 1):  # the chain: the block over its own output, one row further
                self._chain_rows(ops, mtp, block_size, lens, pos, guesses[:size], out[:, j])
                mg.replay()
            out[:, k - 1] = guesses[:size]
            if step + 1 < steps:  # the next check's rows from this one's, on the device
                self._next_rows(ops, block_size, a, lens, out, cap, stop, slots)
                if choose is not None or adjust is not None:
                    emitted += lens
        flat = res.tolist()
        return [([r[i * L:(i + 1) * L] for i in range(n)], r[Tn:Tn + n],
                 [r[Tn + size + i * k:Tn + size + (i + 1) * k] for i in range(n)])
                for r in flat]

    @torch.inference_mode()
    def warm_spec_ops(self, mtp: CheckGraphs, block_size: int) -> None:
        """Runs run_greedy_mtp's small ops (volundr.kernels.spec) once over padding rows of the
        smallest graphs, so that their kernels compile now rather than in a request's first
        multi-step speculation (what they write is refilled before any use)."""
        from volundr.ops import spec_ops

        ops, size, z = spec_ops(self.cu), min(self.graphs), dict(dtype=torch.long,
                                                                 device=self.device)
        a, out = torch.zeros(size, self.L, **z), torch.zeros(size, self.L - 1, **z)
        lens, pos, cap = (torch.zeros(size, **z) for _ in range(3))
        stop = torch.full((size, 1), -1, **z)
        self._accept_rows(ops, mtp, a, cap, stop, lens, pos)
        self._chain_rows(ops, mtp, block_size, lens, pos, out[:, 0], out[:, 0])
        self._next_rows(ops, block_size, a, lens, out, cap, stop, self.slots[0:2 * size:2].clone())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # run_greedy_mtp's ops (volundr.kernels.spec) over this graph's and the MTP graphs' (`mtp`)
    # buffers for `size` = a.shape[0] sequences; shapes at the ops
    def _accept_rows(self, ops, mtp: CheckGraphs, a, cap, stop, lens, pos) -> None:
        size, L = a.shape
        Tn = size * L
        ops.accept_rows(a, self.ngram_ids[:Tn, -1].view(size, L),  # (a window ends in its token)
                        self.cu[:2 * size + 1], cap, stop, self.slot_mapping[:Tn], self.ctx[:Tn],
                        lens, self.cu_commit[:2 * size + 1], mtp.cu[:2 * size + 1],
                        mtp.slot_mapping[:Tn], mtp.ctx[:Tn], mtp.mtp_ids[:Tn],
                        mtp.mtp_last[:size], pos, self.accept_all)

    def _chain_rows(self, ops, mtp: CheckGraphs, block_size: int, lens, pos, guess, out) -> None:
        size = lens.shape[0]
        Tn = size * self.L
        ops.chain_rows(lens, pos, self.seq_tables[:size], block_size, mtp.graphs[size][4], guess,
                       mtp.cu[:2 * size + 1], mtp.slot_mapping[:Tn], mtp.ctx[:Tn],
                       mtp.mtp_hidden[:Tn], mtp.mtp_ids[:Tn], mtp.mtp_last[:size], out)

    def _next_rows(self, ops, block_size: int, a, lens, out, cap, stop, slots) -> None:
        size, L = a.shape
        Tn = size * L
        ops.next_rows(a, lens, out, cap, stop, self.ngram_ids[:Tn], self.ctx[:Tn],
                      self.seq_tables[:size], block_size, self.model.cfg.engram.pad_id, slots,
                      self.cu[:2 * size + 1], self.slots[:2 * size], self.slot_mapping[:Tn])

    def _fill(self, lay: dict[str, list]) -> int:
        """The static buffers of a layout's graph; returns its size (sequences)."""
        n = len(lay["slots"]) // 2
        size, L, m = self._size(n), self.L, self.ngram_ids.shape[1]
        T, Tn, pad = n * L, size * L, self.model.cfg.engram.pad_id
        width = lay["tables"].shape[1]  # [n, width]: each sequence's block table
        i64 = (lay["slots"] + [-1] * (2 * (size - n)) + lay["slot_mapping"] + [-1] * (Tn - T)
               + [i for row in lay["ngrams"] for i in row] + [pad] * ((Tn - T) * m))
        i32 = np.concatenate([np.asarray(self._padded_cu(lay, size) + lay["ctx"]
                                         + [1] * (Tn - T), np.int32), lay["tables"].ravel()])
        a64, a32 = to_device(i64, torch.long, self.device), to_device(i32, torch.int32,
                                                                      self.device)
        slots, slot_map, ngrams = a64.split([2 * size, Tn, Tn * m])
        cu, ctx, tables = a32.split([2 * size + 1, Tn, n * width])
        self.slots[:2 * size] = slots
        self.slot_mapping[:Tn] = slot_map
        self.ngram_ids[:Tn] = ngrams.view(Tn, m)
        self.cu[:2 * size + 1] = cu
        self.ctx[:Tn] = ctx
        self.seq_tables[:size].zero_()
        self.seq_tables[:n, :width] = tables.view(n, width)
        return size

    @torch.inference_mode()
    def run_commit(self, n: int, lay: dict[str, list]) -> None:
        """Replays the commit after `run_check` of n sequences (lay: its commit layout)."""
        size = self._size(n)
        self.cu_commit[:2 * size + 1] = to_device(self._padded_cu(lay, size), torch.int32,
                                                  self.device)
        self.graphs[size][1].replay()
