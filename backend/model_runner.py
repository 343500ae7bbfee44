"""Runs the model on one device: owns the weights, the caches, and turns a schedule into tensors.

Caches, allocated once:
  attention KV   per attention layer (and the MTP layer): [num_blocks, block_size, Hkv, D] in
                 kv_dtype (the model dtype, bf16 or fp8 e4m3: EngineConfig.kv_cache_dtype)
  KDA state      per KDA layer: [slots, H, K, V] fp32; conv tails [slots, 3 * H * K, conv - 1]
  Engram conv    per Engram layer: [slots, hidden, conv - 1]
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch
import torch.distributed as dist

from volundr.block_manager import TableMirror
from volundr.check_layout import check_batch, check_layout
from volundr.config import VolundrConfig
from volundr.model import ForwardBatch, VolundrForCausalLM
from volundr.model.parallel import TP, enable_one_shot, local_kv_heads
from volundr.sampler import RowAdjuster, Sampler, append_logprobs, to_device
from volundr.scheduler import ScheduledSeq

# Speculative checks captured as CUDA graphs for up to this many sequences (speculative decoding
# pays at small batch; the engine speculates for at most this many sequences a step).
MAX_CHECK_SEQS = 8
# Tokens per sequence of a check at most: its recurrences read the states without writing them,
# which the token-by-token KDA kernel does up to kernels/kda/engine.py's DECODE_MAX_LEN.
MAX_CHECK_LEN = 16


def _expandable_segments() -> None:
    """Under a budget, let the caching allocator grow and shrink its segments: with fixed
    segments, prefill's transient dequantisation buffers (~170 MiB) split segments that later
    hold long-lived tensors, and 2 GiB of a 16 GiB cap sat reserved but unusable (H100 run 95,
    an fp8 cache). PYTORCH_CUDA_ALLOC_CONF naming expandable_segments takes precedence."""
    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    setter = setter or torch._C._cuda_cudaCachingAllocator_set_allocator_settings
    setter("expandable_segments:True")


class ModelRunner:
    def __init__(self, cfg: VolundrConfig, state_dict: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, num_slots: int, num_blocks: int,
                 block_size: int, seed: int = 0, max_model_len: int = 2048,
                 cuda_graphs: bool = True, tp_rank: int = 0, tp_size: int = 1,
                 gpu_budget_gib: float | None = None, tp_all_reduce: str = "nccl",
                 kv_dtype: torch.dtype | None = None, check_len: int = 0,
                 check_logits: bool = True, mtp_graphs: bool = False):
        """With tp_size > 1 (volundr.distributed) `state_dict` is this rank's shard
        (`shard_state_dict`) and the caches hold this rank's heads; only rank 0 samples;
        tp_all_reduce "symm": decode-sized all-reduces through symmetric memory
        (parallel.enable_one_shot) on CUDA.
        gpu_budget_gib: a hard cap on what this process's CUDA allocator may hold.
        kv_dtype: the attention KV caches' dtype (None: `dtype`).
        check_len: speculative checks of this many tokens per sequence run as CUDA graphs
        (`check`; up to MAX_CHECK_SEQS sequences; 0: none captured), ending in logits or, without
        check_logits, in hidden states (a drafter); with mtp_graphs the MTP block over up to
        check_len rows per sequence too (`mtp`, the drafts of speculate_mtp)."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.kv_dtype = kv_dtype or dtype
        budget_bytes = None
        if gpu_budget_gib is not None and device.type == "cuda":
            # The plan sized weights + caches + workspace to the budget; the allocator cap makes
            # it hard: anything past it fails with an out-of-memory error instead of growing.
            index = torch.cuda.current_device() if device.index is None else device.index
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, gpu_budget_gib * 2**30 / total), index)
            _expandable_segments()
            budget_bytes = int(min(1.0, gpu_budget_gib * 2**30 / total) * total)
        self.tp = TP(tp_rank, tp_size)
        self.block_size, self.num_blocks, self.num_slots = block_size, num_blocks, num_slots
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)  # a block table's longest
        # the block tables' host rows (the scratch slot's too), appended to as they grow
        self.tables = TableMirror(num_slots + 1, max_blocks)
        with torch.device("meta"):
            model = VolundrForCausalLM(cfg, self.tp)
        if cfg.quantization is not None:
            from volundr.model.quant_linear import apply_quantization

            state_dict = dict(state_dict)
            apply_quantization(model, cfg, state_dict, device)
        # TP ranks share the host tables (one copy in shared memory), each locks them in place.
        model.load_weights(state_dict, device, dtype)
        self.model = model.eval()
        self.sampler = Sampler(device, seed)
        self._allocate_caches()
        self.snaps: dict[int, list[torch.Tensor]] = {}  # sessions: see snap / park
        self.parked: dict[int, tuple[list, list, list]] = {}
        if tp_size > 1 and device.type == "cuda" and tp_all_reduce == "symm":
            enable_one_shot(device, num_slots * cfg.hidden_size, dtype)  # decode batches
        self.graphs = None
        if cuda_graphs and device.type == "cuda":
            # With TP every rank captures the same sizes in the same order at the same time:
            # the graphs hold the NCCL collectives, and the ranks replay them in step.
            from volundr.cuda_graph import CUDAGraphRunner

            try:
                self.graphs = CUDAGraphRunner(
                    self.model, device, dtype, num_slots, max_blocks,
                    max_model_len, scratch_slot=num_slots, tp=tp_size > 1,
                    budget_bytes=budget_bytes)
            except RuntimeError as e:  # no capturable kernel for an op, or no room: run eagerly
                warnings.warn(f"CUDA graphs disabled, decode runs eagerly: {e}", stacklevel=2)
                torch.cuda.empty_cache()  # the graphs captured before are gone
                for t in self.states:
                    t.zero_()
        self.checks = None
        self._pending = None  # the last check: (batch, L, its eager ForwardBatch or None)
        # MTP drafts (volundr.speculative.speculate_mtp) read the hidden states of the last
        # eager forward (`run`) and of the last check: kept only while keep_hidden is set
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.max_check_seqs = num_slots  # eager checks take any batch; graphs up to their size
        if self.graphs is not None and check_len > 1:
            from volundr.check_graphs import CheckGraphs

            try:
                self.checks = CheckGraphs(
                    self.model, device, check_len, min(num_slots, MAX_CHECK_SEQS),
                    max_blocks, max_model_len, check_logits, budget_bytes)
                self.max_check_seqs = self.checks.max_n
            except RuntimeError as e:
                warnings.warn(f"speculative checks run eagerly: {e}", stacklevel=2)
                torch.cuda.empty_cache()
        self.mtp_graphs = None
        if self.checks is not None and mtp_graphs and self.model.mtp is not None:
            try:
                self.mtp_graphs = CheckGraphs(
                    self.model, device, check_len, self.checks.max_n,
                    max_blocks, max_model_len, True, budget_bytes,
                    mtp=dtype)
                self.checks.warm_spec_ops(self.mtp_graphs, self.block_size)
            except RuntimeError as e:
                warnings.warn(f"the MTP block runs eagerly: {e}", stacklevel=2)
                torch.cuda.empty_cache()

    def _allocate_caches(self) -> None:
        # One slot more than the scheduler hands out: the scratch slot of CUDA-graph padding.
        cfg, dev, n = self.cfg, self.device, self.num_slots + 1
        kv_shape = (self.num_blocks, self.block_size,
                    local_kv_heads(cfg.num_key_value_heads, self.tp.size), cfg.head_dim)
        k, kda_heads = cfg.kda, cfg.kda.num_heads // self.tp.size  # this rank's heads
        self.states: list[torch.Tensor] = []  # every per-slot tensor, zeroed on admission
        self.kv_caches: list[torch.Tensor] = []  # every attention K and V cache
        for layer in self.model.model.layers:
            if layer.engram is not None:
                layer.engram.conv_state = torch.zeros(
                    n, cfg.hidden_size, cfg.engram.conv_size - 1, device=dev, dtype=self.dtype)
                self.states.append(layer.engram.conv_state)
            if hasattr(layer, "self_attn"):
                layer.self_attn.k_cache = torch.zeros(kv_shape, device=dev, dtype=self.kv_dtype)
                layer.self_attn.v_cache = torch.zeros(kv_shape, device=dev, dtype=self.kv_dtype)
                self.kv_caches += [layer.self_attn.k_cache, layer.self_attn.v_cache]
            else:
                layer.kda.state = torch.zeros(n, kda_heads, k.head_dim, k.head_dim,
                                              device=dev, dtype=torch.float32)
                layer.kda.conv_state = torch.zeros(n, 3 * kda_heads * k.head_dim,
                                                   k.conv_size - 1, device=dev, dtype=self.dtype)
                self.states += [layer.kda.state, layer.kda.conv_state]
        if self.model.mtp is not None:
            attn = self.model.mtp.layer.self_attn
            attn.k_cache = torch.zeros(kv_shape, device=dev, dtype=self.kv_dtype)
            attn.v_cache = torch.zeros(kv_shape, device=dev, dtype=self.kv_dtype)
            self.kv_caches += [attn.k_cache, attn.v_cache]

    # ---- sessions (volundr.session) -----------------------------------------------------
    # Host copies keyed by what the engine names them: snaps[seq key] = a running sequence's
    # state after its prompt; parked[ticket] = (states, kv blocks, prompt states).
    def session_nbytes(self, num_blocks: int, prompt_state: bool = False) -> int:
        """Host bytes of a parked state whose KV spans num_blocks blocks (+ a prompt state)."""
        state = sum(t[0].numel() * t.element_size() for t in self.states)
        return (state * (2 if prompt_state else 1)
                + num_blocks * sum(c[0].numel() * c.element_size() for c in self.kv_caches))

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t.clone()
        # pinned and asynchronous: later kernels that reuse the slot or the blocks are ordered
        # after the copy on the stream, and only a restore (also on the stream) reads it
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return h.copy_(t, non_blocking=True)

    def snap(self, key: int, slot: int) -> None:
        """Keep the state of `slot` now (a sequence whose prompt just ran) under `key`."""
        self.snaps[key] = [self._to_host(t[slot]) for t in self.states]

    def unsnap(self, key: int) -> None:
        self.snaps.pop(key, None)

    def park(self, ticket: int, slot: int, blocks: list[int], snap_key: int | None) -> int:
        """Copy `slot`'s state, the KV of `blocks` and the snap under snap_key (taken off) to
        host memory as parked[ticket]; returns its host bytes."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        prompt = self.snaps.pop(snap_key, []) if snap_key is not None else []
        parked = ([self._to_host(t[slot]) for t in self.states],
                  [self._to_host(c[idx]) for c in self.kv_caches], prompt)
        self.parked[ticket] = parked
        return sum(t.numel() * t.element_size() for part in parked for t in part)

    def forget(self, ticket: int) -> None:
        self.parked.pop(ticket, None)

    def restore(self, slot: int, block_table: list[int], r, num_tokens: int | None = None
                ) -> None:
        """The parked state of Resume `r` (volundr.session) into `slot` and the first blocks of
        `block_table` covering num_tokens (default r.num_tokens) tokens."""
        states, kv, prompt = self.parked.pop(r.ticket)
        for t, h in zip(self.states, prompt if r.at_prompt_end else states):
            t[slot].copy_(h, non_blocking=True)
        nb = -(-(r.num_tokens if num_tokens is None else num_tokens) // self.block_size)
        idx = torch.tensor(block_table[:nb], dtype=torch.long, device=self.device)
        for c, h in zip(self.kv_caches, kv):
            c[idx] = h[:nb].to(self.device, non_blocking=True)

    @torch.inference_mode()
    def save_states(self, slots: list[int]) -> list[torch.Tensor]:
        """Copies (on the device) of the KDA / conv / Engram states of `slots`."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        return [t[idx] for t in self.states]  # (advanced indexing copies)

    @torch.inference_mode()
    def load_states(self, slots: list[int], saved: list[torch.Tensor],
                    rows: list[int] | None = None) -> None:
        """`save_states`' copies (or their `rows`) back into `slots`."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        sel = None if rows is None else torch.tensor(rows, dtype=torch.long, device=self.device)
        for t, s in zip(self.states, saved):
            t[idx] = s if sel is None else s[sel]

    def _init_states(self, batch: list[ScheduledSeq]) -> None:
        """Slots of sequences that start this step: zeroed, or a resumed session's state."""
        fresh = []
        for item in batch:
            if item.seq.resume is not None:
                r, item.seq.resume = item.seq.resume, None
                self.restore(item.seq.slot, item.seq.block_table, r)
            elif item.seq.num_computed_tokens == 0:
                fresh.append(item.seq.slot)
        if fresh:
            idx = torch.tensor(fresh, device=self.device)
            for t in self.states:
                t[idx] = 0

    # ---- schedule -> tensors ------------------------------------------------------------
    def prepare(self, batch: list[ScheduledSeq]) -> ForwardBatch:
        """Index tensors of the step (the forward does the lookups from ngram_ids)."""
        bs, m = self.block_size, self.cfg.engram.max_order
        pad = self.cfg.engram.pad_id
        slot_mapping, ngrams, logits_idx = [], [], []
        cu, ctx, embed_rows, embeds = [0], [], [], []
        for item in batch:
            seq, s = item.seq, item.seq.num_computed_tokens
            e = s + item.num_new_tokens
            slot_mapping.extend(seq.block_table[p // bs] * bs + p % bs for p in range(s, e))
            window = seq.token_ids[max(0, s - m + 1):e]
            window = [pad] * (e - s + m - 1 - len(window)) + window
            ngrams.extend(window[i:i + m] for i in range(e - s))
            for p, vec in seq.input_embeds.items():
                if s <= p < e:  # a precomputed embedding replaces this token's row
                    embed_rows.append(cu[-1] + p - s)
                    embeds.append(vec)
            cu.append(cu[-1] + e - s)
            ctx.append(e)
            if item.samples:
                logits_idx.append(cu[-1] - 1)
        table = self.tables.rows([item.seq for item in batch])
        N, T, M = len(batch), cu[-1], len(logits_idx)
        ngram_on_device = self.model.lookups_on_gpu or self.device.type == "cpu"
        # Every index tensor of the step in two host buffers (int64, int32), one copy each.
        i64 = [item.seq.slot for item in batch] + slot_mapping + logits_idx
        if ngram_on_device:
            i64 += [i for row in ngrams for i in row]
        i32 = np.concatenate([np.asarray(cu + ctx, dtype=np.int32), table.ravel()])
        a64, a32 = self._to_device(i64, torch.long), self._to_device(i32, torch.int32)
        slot_ids, slot_map, logits_indices, ngram_ids = a64.split([N, T, M, len(i64) - N - T - M])
        cu_seqlens, context_lens, table = a32.split([N + 1, N, table.size])
        if ngram_on_device:
            ngram_ids = ngram_ids.view(T, m)
        else:  # tensor-parallel ranks look the rows up on the host
            ngram_ids = torch.tensor(ngrams, dtype=torch.long).view(T, m)

        b = ForwardBatch(
            cu_seqlens=cu_seqlens,
            cu_list=cu,
            slot_ids=slot_ids,
            slot_mapping=slot_map,
            block_tables=table.view(N, -1),
            context_lens=context_lens,
            max_q_len=max(item.num_new_tokens for item in batch),
            max_context_len=max(ctx),
            ngram_ids=ngram_ids,
            logits_indices=logits_indices,
        )
        if embeds:
            b.embed_positions = self._to_device(embed_rows, torch.long)
            b.embeds = torch.stack(embeds).to(self.device, non_blocking=True)
        return b

    def _to_device(self, values: list[int] | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    @torch.inference_mode()
    def run_decode_steps(self, batch: list[ScheduledSeq], steps: int,
                         stop_ids: list[tuple[int, ...]] | None = None,
                         greedy: bool = False) -> list[list[int]]:
        """`steps` decode steps of a batch of decoding sequences (one token each, KV blocks
        already grown for every position): step j's input token is step j - 1's sampled token,
        fed on the device (the n-gram window shifts, positions advance), so the host enqueues
        all steps (graph replays when captured) and syncs once. Returns token ids
        [steps][len(batch)]; tokens after a sequence's stop are discarded by the engine
        (their logprobs, for sequences asking, are appended as every step's).
        stop_ids (per sequence, its stop tokens): once a sequence samples one, its later steps
        read and write the scratch slot, so its own slot keeps the state of exactly the tokens
        the engine counts as computed (a session parks it). greedy: argmax whatever the
        sequences' sampling parameters (a drafter's guesses)."""
        self._init_states(batch)  # (a one-token prompt may start in a decode-only batch)
        b = self.prepare(batch)
        n, bs = len(batch), self.block_size
        if stop_ids is not None:
            width = max(1, *(len(s) for s in stop_ids))
            table = self._to_device([t for s in stop_ids for t in (*s, *[-1] * (width - len(s)))],
                                    torch.long).view(n, width)
            slots, stopped = b.slot_ids.clone(), torch.zeros(n, dtype=torch.bool,
                                                             device=self.device)
        seqs = [item.seq for item in batch]
        p0 = [s.num_computed_tokens for s in seqs]  # position of step 0's token
        pos = [[p + j for p in p0] for j in range(1, steps)]
        slot_map = self._to_device([s.block_table[p // bs] * bs + p % bs
                                    for row in pos for p, s in zip(row, seqs)], torch.long)
        ctx = self._to_device([p + 1 for row in pos for p in row], torch.int32)
        toks = torch.empty(steps, n, dtype=torch.long, device=self.device)
        later: list = []  # logprobs, read back with the tokens
        adjust: RowAdjuster | None = None  # (made where the logits are: rank 0)
        for j in range(steps):
            if j:
                b.slot_mapping = slot_map[(j - 1) * n:j * n]
                b.context_lens = ctx[(j - 1) * n:j * n]
                b.max_context_len += 1
                b.ngram_ids = torch.cat([b.ngram_ids[:, 1:], toks[j - 1].unsqueeze(1)], dim=1)
                if stop_ids is not None:
                    stopped |= (toks[j - 1, :, None] == table).any(1)
                    b.slot_ids = torch.where(stopped, self.num_slots, slots)  # scratch slot
            if self.graphs is not None and self.graphs.can_run(b):
                logits = self.graphs.run(b)
            else:
                logits = self.model.compute_logits(self.model(b)[b.logits_indices])
            if logits is not None:  # rank 0 (tensor parallel: the others got None)
                if j == 0 and not greedy:  # (each step's tokens then join its counts)
                    adjust = RowAdjuster.of(seqs)
                toks[j] = (logits.argmax(dim=1) if greedy
                           else self.sampler.sample(logits, seqs, adjust, j, later))
            if self.tp.size > 1:  # the next step's input, which every rank's lookups read
                dist.broadcast(toks[j], src=0)
        out = toks.tolist()
        append_logprobs(later, seqs)  # (a sequence's entries past its stop: never emitted)
        return out

    # ---- speculative checks (volundr.speculative; rows: volundr.check_layout) -------------
    def check_layout(self, batch: list[ScheduledSeq], L: int,
                     lengths: list[int] | None = None) -> dict[str, list]:
        """Host lists of a check (or, with `lengths`, its commit) of `batch`, L rows each; a
        check's also "tables": the sequences' block tables [n, width] (TableMirror.rows)."""
        e = self.cfg.engram
        lay = check_layout(batch, L, self.block_size, e.max_order, e.pad_id, lengths)
        if lengths is None:
            lay["tables"] = self.tables.rows([item.seq for item in batch])
        return lay

    def _check_batch(self, lay: dict[str, list], L: int) -> ForwardBatch:
        """Eager ForwardBatch of a check layout (the graphs fill static buffers instead)."""
        return check_batch(lay, L, self.cfg.engram.max_order, self._to_device)

    @torch.inference_mode()
    def check(self, batch: list[ScheduledSeq], L: int, logits: bool = True
              ) -> torch.Tensor | None:
        """The forward of `batch`'s tokens (item i: its num_new_tokens <= L tokens from
        num_computed_tokens on, decoding sequences without input embeddings) with every
        recurrent state read, not written; their attention KV is stored. Returns logits
        [len(batch), L, vocab] fp32 (rows past an item's tokens: garbage), or None without
        `logits`. Then `commit` says how many of each item's tokens the states take in."""
        self._init_states(batch)
        lay = self.check_layout(batch, L)
        if self.checks is not None and self.checks.can_run(len(batch), L, logits):
            self._pending = (batch, L, None)
            out = self.checks.run_check(lay)
            self.last_hidden = self.checks.hidden if self.keep_hidden else None
            return None if out is None else out.view(len(batch), L, -1)
        b = self._check_batch(lay, L)
        b.stash = []
        hidden = self.model(b)
        self.last_hidden = hidden if self.keep_hidden else None
        self._pending = (batch, L, b)
        if not logits:
            return None
        return self.model.compute_logits(hidden).view(len(batch), L, -1)

    @torch.inference_mode()
    def commit(self, lengths: list[int]) -> None:
        """The last check's sequences take in their first lengths[i] tokens (>= 1): their
        KDA, conv and Engram states advance over them, from the inputs the check kept."""
        batch, L, b = self._pending
        self._pending = None
        lay = self.check_layout(batch, L, lengths)
        if b is None:  # the check ran as a graph: so does its commit
            self.checks.run_commit(len(batch), lay)
            return
        cu = self._to_device(lay["cu"], torch.int32)
        slots = self._to_device(lay["slots"], torch.long)
        bc = ForwardBatch(cu_seqlens=cu, cu_list=lay["cu"], slot_ids=slots,
                          slot_mapping=b.slot_mapping, block_tables=b.block_tables,
                          context_lens=b.context_lens, max_q_len=L,
                          max_context_len=b.max_context_len, ngram_ids=b.ngram_ids,
                          logits_indices=b.logits_indices, rows=b.rows)
        for module, inputs in b.stash:
            module.commit(inputs, bc)

    @torch.inference_mode()
    def mtp(self, batch: list[ScheduledSeq], hidden: torch.Tensor, next_ids: list[int]
            ) -> tuple[list[int], torch.Tensor]:
        """The MTP block over `batch`'s positions (item i: num_new_tokens positions from
        num_computed_tokens on; token_ids covering them): hidden [T, d] the model's hidden
        states there (before the final norm), or the block's own output (a recursive guess),
        next_ids [T] each position's next token. Its attention KV is stored at those positions;
        returns each item's greedy guess of the token after its last next id (its last row's
        MTP logits) and the block's output there [len(batch), d] (before its final norm)."""
        g = self.mtp_graphs
        if (g is not None and len(batch) <= g.max_n
                and all(it.num_new_tokens <= g.L for it in batch)):
            return g.run_mtp(self.check_layout(batch, g.L), hidden, next_ids)
        b = self.prepare(batch)
        e = self.model.embed(torch.tensor(next_ids), hidden.device, hidden.dtype)
        h = self.model.mtp(hidden, e, b)
        h = h[torch.tensor(b.cu_list[1:], device=h.device) - 1]
        return self.model.compute_logits(h).argmax(dim=-1).tolist(), h

    @torch.inference_mode()
    def check_greedy_mtp(self, batch: list[ScheduledSeq], L: int, caps: list[int],
                         stops: list[tuple[int, ...]], k: int = 1, steps: int = 1,
                         choose=None, record=None, adjust=None
                         ) -> list[tuple[list[list[int]], list[int], list[list[int]]]] | None:
        """`check`, `commit` of the kept tokens that count (caps[i] at most, up to the first of
        stops[i]) and `mtp` over them, then k - 1 times over its own output (the guesses after
        the first: speculate_mtp), as one replay of graphs; `steps` such steps back to back,
        each checking the last's guesses, with one read back (CheckGraphs.run_greedy_mtp: per
        step each item's chosen rows, counted lengths, k MTP guesses); None where the graphs do
        not take the batch. Items keep the guesses equal to their rows' tokens: the argmax, or
        choose's (sampler.RowChooser: sampled items' draws) from the logits adjust gives
        (sampler.RowAdjuster: penalties, bias, min_tokens). record(logits, chosen): called
        after each step's check (its raw logits rows, chosen rows), e.g. for logprobs."""
        c, m = self.checks, self.mtp_graphs
        if c is None or m is None or not c.can_run(len(batch), L, True) or len(batch) > m.max_n:
            return None
        self._init_states(batch)
        self.last_hidden = None
        return c.run_greedy_mtp(self.check_layout(batch, L), m, caps, stops, k, self.block_size,
                                steps, choose, record, adjust)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> list[int]:
        """One forward over the batch; returns a sampled token for each item that samples."""
        self._init_states(batch)
        b = self.prepare(batch)
        sampling = [item.seq for item in batch if item.samples]
        self.last_hidden = None
        if self.graphs is not None and self.graphs.can_run(b):
            logits = self.graphs.run(b)
        else:
            hidden = self.model(b)
            self.last_hidden = hidden if self.keep_hidden else None
            if not sampling:
                return []
            logits = self.model.compute_logits(hidden[b.logits_indices])
        if logits is None:  # a tensor-parallel worker: rank 0 gathered the logits and samples
            return []
        return self.sampler(logits, sampling)
