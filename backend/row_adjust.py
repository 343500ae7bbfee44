"""Penalties, logit_bias and min_tokens (sampler.adjust_logits) on the rows of a run of
speculative checks, on the device (CheckGraphs.run_greedy_mtp's `adjust`), so that requests with
them take the MTP head's runs of graph steps with one read back like plain ones.

Row j of a sequence's check (input t_0, then its guesses d_1 .. d_k) is adjusted as the host's
speculative path adjusts it (speculative._counted_kept -> sampler.adjust_seqs): as if d_1 .. d_j
had been generated after the tokens counted so far. Those are the sequence's output tokens when
the run starts (counted on the host once) plus the tokens each earlier step of the run counted
(`advance`, on the device): no host round trip between the steps.
"""

from __future__ import annotations

import torch

from volundr.sampler import apply_penalties, count_rows, to_device
from volundr.sequence import Sequence


class RowAdjuster:
    """adjust_logits for the rows [size, L] of a run's checks of `seqs` (the first n of the
    graph's size sequences, L rows each). Its tensors are made at the first call."""

    def __init__(self, seqs: list[Sequence], L: int):
        """Made before the run's guesses are appended to the sequences: their outputs and
        counts are then the tokens generated so far."""
        self.L = L
        self.idx = [i for i, s in enumerate(seqs) if s.params.adjusts_logits]
        sel = [seqs[i] for i in self.idx]
        self.params = [s.params for s in sel]
        self.outputs = [list(s.output_token_ids) if s.params.penalized else [] for s in sel]
        self.prompts = [s.token_ids[:s.num_prompt_tokens]
                        if s.params.repetition_penalty != 1.0 else [] for s in sel]
        self.generated = [s.num_output_tokens for s in sel]
        self.stop_ids = [s.stop_ids for s in sel]
        # (decided here: a device value's test inside the run would wait for the GPU)
        self.repetition = any(p.repetition_penalty != 1.0 for p in self.params)
        self.made: dict[str, torch.Tensor] = {}

    def _make(self, V: int, dev: torch.device) -> None:
        ps, m = self.params, self.made
        m["idx"] = to_device(self.idx, torch.long, dev)
        if any(p.penalized for p in ps):
            # [P, V] each sequence's output counts; seen: tokens of its prompt (repetition)
            m["counts"] = count_rows(self.outputs, V, dev)[:, :V].contiguous()
            m["prompt_seen"] = count_rows(self.prompts, V, dev)[:, :V] > 0
            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
                m[name] = to_device([getattr(p, name) for p in ps], torch.float32,
                                    dev).repeat_interleave(self.L)
        bias = [(k, t, b) for k, p in enumerate(ps) for t, b in p.logit_bias]
        if bias:  # dense [P, V]: adding 0 elsewhere leaves a logit as it is
            r, t, b = zip(*bias)
            m["bias"] = torch.zeros(len(ps), V, device=dev).index_put_(
                (to_device(r, torch.long, dev), to_device(t, torch.long, dev)),
                to_device(b, torch.float32, dev), accumulate=True)
        early = [(k, t) for k, p in enumerate(ps) if p.min_tokens > 0
                 for t in self.stop_ids[k] if 0 <= t < V]
        if early:  # stop ids masked while a row has generated fewer than min_tokens
            r, t = zip(*early)
            mask = torch.zeros(len(ps), V, dtype=torch.bool, device=dev)
            mask[to_device(r, torch.long, dev), to_device(t, torch.long, dev)] = True
            m["stops"] = mask
            m["min_tokens"] = to_device([p.min_tokens for p in ps], torch.long, dev)
            m["generated"] = to_device(self.generated, torch.long, dev)
            m["j"] = torch.arange(self.L, device=dev)

    def __call__(self, logits: torch.Tensor, ids: torch.Tensor,
                 emitted: torch.Tensor) -> torch.Tensor:
        """logits [size L, V] a check's raw rows, ids [size, L] their input tokens (t_0 and
        the guesses), emitted [size] the tokens each sequence counted earlier in the run:
        the adjusted logits (a copy; the raw ones stay for logprobs)."""
        V, L = logits.shape[1], self.L
        m = self.made
        if not m:
            self._make(V, logits.device)
        idx = m["idx"]
        P = idx.shape[0]
        sub = logits.view(-1, L, V)[idx].float()  # [P, L, V]
        if "counts" in m:  # row j: the counts so far and the guesses d_1 .. d_j
            guessed = torch.zeros(P, L, V, device=logits.device)
            guessed[:, 1:].scatter_(2, ids[idx, 1:].unsqueeze(2), 1.0)
            counts = guessed.cumsum_(1).add_(m["counts"].unsqueeze(1)).view(P * L, V)  # (one
            # [P, L, V] buffer: at 16 sequences x 8 rows of a 262K vocabulary 134 MB)
            seen = counts > 0
            if self.repetition:
                seen = seen | m["prompt_seen"].repeat_interleave(L, dim=0)
            sub = apply_penalties(sub.view(P * L, V), counts, seen, m["presence_penalty"],
                                  m["frequency_penalty"],
                                  m["repetition_penalty"]).view(P, L, V)
        if "bias" in m:
            sub = sub + m["bias"].unsqueeze(1)
        if "stops" in m:  # (after the bias: a +100 on a stop token must not undo it)
            gen = m["generated"].unsqueeze(1) + emitted[idx].unsqueeze(1) + m["j"]  # [P, L]
            early = (gen < m["min_tokens"].unsqueeze(1)).unsqueeze(2) & m["stops"].unsqueeze(1)
            sub = sub.masked_fill(early, float("-inf"))
        out = logits.clone()
        out.view(-1, L, V)[idx] = sub.to(logits.dtype)
        return out

    def advance(self, chosen: torch.Tensor, lens: torch.Tensor) -> None:
        """After a step's acceptance: chosen [size, L] its rows' tokens, lens [size] how many
        of them each sequence counted; they join the counts (the penalties' history)."""
        if "counts" not in self.made:
            return
        idx = self.made["idx"]
        keep = (torch.arange(self.L, device=chosen.device) < lens[idx].unsqueeze(1)).float()
        self.made["counts"].scatter_add_(1, chosen[idx], keep)
