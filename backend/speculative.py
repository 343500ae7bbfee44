"""Speculative decoding: a small drafter guesses k tokens, the model checks them in one forward.

One engine step for a batch of decoding sequences, each with its last sampled token t_0 at
position p not yet run through the model (its state holds tokens [0, p)):

  1. the drafter catches up on the tokens it has not seen (prompt chunks, tokens accepted
     earlier: `num_draft_computed`), then runs t_0 and its own greedy guesses one token at a
     time: d_1 .. d_k (ModelRunner.run_decode_steps, drafter's states and KV);
  2. the model runs [t_0, d_1, .., d_k] (positions p .. p + k) as one chunk with logits at
     every position: row j is its distribution of the token after t_0, d_1, .., d_j;
  3. greedy requests: a_j = argmax of row j; accepted, the longest prefix with d_j == a_{j-1},
     n guesses; the step emits a_0 .. a_n (n + 1 tokens): exactly the tokens greedy decoding
     would have produced one by one, whatever the drafter guessed (up to floating-point ties
     between the chunked and one-token forms). Sampled requests (`accept_sampled`): speculative
     sampling with the drafter's guess as a point mass: d_{j+1} is kept with probability
     p_j(d_{j+1}) (p_j: row j after temperature, top-k, top-p, min-p); the first one dropped is
     replaced by a draw from p_j without it, and after k kept guesses a draw from p_k follows:
     every emitted token is distributed as plain sampling's (Leviathan et al. 2023, with
     q = the one-hot greedy guess). Seeded sampled requests stay out: their tokens must not
     depend on the batch (the sampler's promise), and k does. Then `m` <= n + 1 of the emitted
     tokens count when a stop token or a length limit comes first;
  4. states: step 2 read the model's KDA / conv / Engram states without writing them
     (ModelRunner.check) and kept each layer's inputs; the sequence owns the first m tokens
     (t_0, a_0 .. a_{m-2}), and ModelRunner.commit runs the recurrences over just those. Their
     attention KV is step 2's; KV past them is simply overwritten later. The drafter took in
     t_0, d_1 .. d_{k-1}: it keeps that when m >= k (at m = k + 1 the catch-up of the next step
     runs d_k), else its saved state comes back and it catches up (a check + commit).

Stays out (the engine's normal steps run instead): seeded sampled requests, prompts with input
embeddings (the drafter has its own hidden size), tensor parallelism.

The MTP head as the draft source (`speculate_mtp`, k = 1): the model's MTP block reads the
hidden state h_i of position i (before the final norm) and the embedding of token i + 1, and
guesses token i + 2; its attention layer keeps its own KV at every position it has run. So
after each forward whose next tokens are known (a prefill chunk or an eager decode:
`mtp_after_run`; a check: its kept rows), the MTP block runs over those positions and its
last row's greedy guess is the sequence's draft d_1 for the next step, which checks [t_0, d_1]
(or [t_0] alone where no draft is at hand: after a decode step replayed as a CUDA graph, whose
hidden states are not kept). Positions the MTP block never ran (such graph steps) leave holes
in its KV: later guesses see less context, the tokens stay exactly the model's.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from volundr.model_runner import ModelRunner
from volundr.sampler import apply_filters
from volundr.scheduler import ScheduledSeq
from volundr.sequence import Sequence


@contextmanager
def _drafter_view(seqs: list[Sequence]):
    """The sequences as the drafter's runner must see them: num_computed_tokens = its own."""
    saved = [s.num_computed_tokens for s in seqs]
    for s in seqs:
        s.num_computed_tokens = s.num_draft_computed
    try:
        yield
    finally:
        for s, n in zip(seqs, saved):
            s.num_computed_tokens = n


@contextmanager
def _appended(seqs: list[Sequence], extra: list[list[int]]):
    """Tokens appended to each sequence for one forward (the runner reads token_ids), then
    taken off again."""
    for s, e in zip(seqs, extra):
        s.token_ids += e
    try:
        yield
    finally:
        for s, e in zip(seqs, extra):
            if e:
                del s.token_ids[-len(e):]


def catch_up(drafter: ModelRunner, seqs: list[Sequence], chunk: int, L: int) -> None:
    """Runs the drafter over every token it has not seen before each sequence's last one
    ([num_draft_computed, num_computed_tokens)): as a check + commit (a graph on CUDA) where
    each sequence has at most L such tokens (the steady state: 0 to L after a step), else in
    forwards of at most `chunk` tokens (a prompt, a sequence new to speculation)."""
    while True:
        todo = [s for s in seqs if s.num_draft_computed < s.num_computed_tokens]
        if not todo:
            return
        n = [s.num_computed_tokens - s.num_draft_computed for s in todo]
        if max(n) <= L:
            batch = [ScheduledSeq(s, k) for s, k in zip(todo, n)]
            with _drafter_view(todo):
                drafter.check(batch, L, logits=False)
                drafter.commit(n)
        else:
            batch, budget = [], chunk
            for s, k in zip(todo, n):
                k = min(k, budget)
                if k == 0:
                    break
                batch.append(ScheduledSeq(s, k))
                budget -= k
            with _drafter_view([it.seq for it in batch]):
                drafter.run(batch)  # (never samples: the last token stays out)
        for it in batch:
            it.seq.num_draft_computed += it.num_new_tokens


def greedy_kept(a: list[int], guesses: list[int]) -> list[int]:
    """Greedy acceptance (module doc, step 3): the model's argmax a_0 .. after t_0 and each
    guess; the guesses kept while they equal it, then the model's token after them."""
    return a[:next((j for j, d in enumerate(guesses) if d != a[j]), len(guesses)) + 1]


def accept_sampled(logits: torch.Tensor, guesses: list[int], seq: Sequence,
                   gen: torch.Generator) -> list[int]:
    """Speculative sampling against one-hot guesses (module doc, step 3): logits [k + 1, V]
    of the model after t_0, d_1 .. d_k; returns the n kept guesses and one drawn token."""
    p, dev = seq.params, logits.device
    rows = logits.shape[0]
    probs = apply_filters(logits, torch.full((rows,), p.temperature, device=dev),
                          torch.full((rows,), p.top_k, dtype=torch.long, device=dev),
                          torch.full((rows,), p.top_p, device=dev),
                          torch.full((rows,), p.min_p, device=dev))
    u = torch.rand(len(guesses), generator=gen, device=dev).tolist()
    kept = probs[torch.arange(len(guesses), device=dev),
                 torch.tensor(guesses, device=dev)].tolist()  # p_j(d_{j+1})
    out = []
    for j, d in enumerate(guesses):
        if u[j] < kept[j]:
            out.append(d)
            continue
        rest = probs[j].clone()  # p_j - one_hot(d), negative part dropped, renormalised
        rest[d] = 0.0
        return out + [int(torch.multinomial(rest / rest.sum(), 1, generator=gen))]
    return out + [int(torch.multinomial(probs[len(guesses)], 1, generator=gen))]


def _counted_kept(target: ModelRunner, seqs: list[Sequence], drafts: list[list[int]],
                  logits: torch.Tensor, counted: Callable[[Sequence, list[int]], int]
                  ) -> list[list[int]]:
    """Step 3 of the module doc for each sequence: its kept guesses and the token after them
    (greedy: `greedy_kept`; sampled: `accept_sampled`, logits [n, >= 1 + its guesses, V]),
    cut to the tokens that count (`counted`)."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, (s, d) in enumerate(zip(seqs, drafts)):
        if s.params.greedy:
            toks = greedy_kept(greedy[i], d)
        else:
            toks = accept_sampled(logits[i, :1 + len(d)], d, s, target.sampler.generator)
        out.append(toks[:counted(s, toks)])
    return out


def speculate(target: ModelRunner, drafter: ModelRunner, batch: list[ScheduledSeq], k: int,
              L: int, chunk: int, counted: Callable[[Sequence, list[int]], int]
              ) -> list[list[int]]:
    """One speculative step (module doc) over `batch` (sequences decoding one token each, none
    seeded and sampled, KV blocks grown for k + 1 positions; k + 1 <= L, the check length).
    counted(seq, tokens) -> how many of the emitted tokens count (the engine's stop and length
    rules). Returns each sequence's counted tokens; the model's and the drafter's states then
    hold exactly t_0 and the counted tokens but the last."""
    seqs = [it.seq for it in batch]
    slots = [s.slot for s in seqs]
    p = [s.num_computed_tokens for s in seqs]
    # 1. the drafter's guesses d_1 .. d_k
    catch_up(drafter, seqs, chunk, L)
    saved_draft = drafter.save_states(slots)
    with _drafter_view(seqs):
        guesses = drafter.run_decode_steps(batch, k, greedy=True)  # [k][N]
    drafts = [[row[i] for row in guesses] for i in range(len(seqs))]
    # 2. the model's distributions after t_0, d_1 .. d_k (states read only)
    with _appended(seqs, drafts):
        logits = target.check([ScheduledSeq(s, k + 1) for s in seqs], L)[:, :k + 1]
    # 3. accepted guesses and the token after them; the tokens that count
    out = _counted_kept(target, seqs, drafts, logits, counted)
    # 4. states: the model's take in t_0 and the counted tokens but the last
    target.commit([len(toks) for toks in out])
    back = [i for i, toks in enumerate(out) if len(toks) < k]
    if back:
        drafter.load_states([slots[i] for i in back], saved_draft, back)
    for i, s in enumerate(seqs):
        s.num_draft_computed = p[i] if i in back else p[i] + k
    return out


def speculate_mtp(target: ModelRunner, batch: list[ScheduledSeq], L: int,
                  counted: Callable[[Sequence, list[int]], int],
                  limits: Callable[[Sequence], tuple[int, tuple[int, ...]]] | None = None
                  ) -> list[list[int]]:
    """One speculative step with the MTP head's drafts (module doc; k = 1, L >= 2) over `batch`
    (decoding sequences as `speculate` takes them, KV blocks grown for 2 positions). Returns
    each sequence's counted tokens; the states then hold t_0 and the counted tokens but the
    last, and seq.mtp_draft the guess for the next step. limits(seq) -> (the most tokens it
    may still take, its stop ids), `counted`'s rules as data: with it, all-greedy batches take
    the graphs' one replay (ModelRunner.check_greedy_mtp), which applies them on the GPU."""
    seqs = [it.seq for it in batch]
    drafts = [[] if s.mtp_draft is None else [s.mtp_draft] for s in seqs]
    q = [1 + len(d) for d in drafts]
    items = [ScheduledSeq(s, n) for s, n in zip(seqs, q)]
    if limits is not None and all(s.params.greedy for s in seqs):
        caps, stops = zip(*map(limits, seqs))  # (before the drafts are appended)
        with _appended(seqs, drafts):
            fused = target.check_greedy_mtp(items, L, list(caps), list(stops))
        if fused is not None:
            for s, guess in zip(seqs, fused[2]):
                s.mtp_draft = guess
            return [a[:m] for a, m in zip(fused[0], fused[1])]
    with _appended(seqs, drafts):
        logits = target.check(items, L)
    hidden = target.last_hidden  # [len(seqs) L, d]: sequence i's rows from i L on
    out = _counted_kept(target, seqs, drafts, logits, counted)
    target.commit([len(toks) for toks in out])
    # the MTP block over the kept rows: row j (position p + j) is followed by out[i][j]
    idx = torch.tensor([i * L + j for i, toks in enumerate(out) for j in range(len(toks))],
                       device=hidden.device)
    with _appended(seqs, [toks[:-1] for toks in out]):
        guesses = target.mtp([ScheduledSeq(s, len(t)) for s, t in zip(seqs, out)],
                             hidden[idx], [x for toks in out for x in toks])
    for s, g in zip(seqs, guesses):
        s.mtp_draft = g
    return out


def mtp_after_run(target: ModelRunner, batch: list[ScheduledSeq], tokens: list[int]) -> None:
    """After a forward of `batch` (ModelRunner.run, before the engine advances the sequences)
    that sampled `tokens` for its sampling items: the MTP block over every position it ran,
    each followed by the next prompt token or the sampled one, and the drafts of the sampling
    items. A forward replayed as a CUDA graph keeps no hidden states: its drafts are None."""
    hidden = target.last_hidden
    if hidden is None:
        for it in batch:
            it.seq.mtp_draft = None
        return
    sampled, nxt = iter(tokens), []
    for it in batch:
        s, e = it.seq.num_computed_tokens, it.seq.num_computed_tokens + it.num_new_tokens
        nxt += it.seq.token_ids[s + 1:e] + [next(sampled) if it.samples else it.seq.token_ids[e]]
    guesses = target.mtp(batch, hidden, nxt)
    for it, g in zip(batch, guesses):
        it.seq.mtp_draft = g if it.samples else None
