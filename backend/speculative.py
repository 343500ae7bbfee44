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
     q = the one-hot greedy guess). Penalties (presence, frequency, repetition) apply to row j
     as if d_1 .. d_j had been generated, as they would have been by then, and logit_bias to
     every row (greedy and sampled alike), and a structured request's grammar masks row j as
     after d_1 .. d_j (volundr.structured; the tokens it forces are the first guesses). Seeded
     sampled requests (`accept_seeded`): their
     tokens must depend on the seed alone (the sampler's promise: not on the batch, nor on k),
     so row j's token is drawn with the sequence's own next noise row as plain sampling would,
     and guesses are kept while they equal it, as for greedy. Then `m` <= n + 1 of the emitted
     tokens count when a stop token or a length limit comes first;
  4. states: step 2 read the model's KDA / conv / Engram states without writing them
     (ModelRunner.check) and kept each layer's inputs; the sequence owns the first m tokens
     (t_0, a_0 .. a_{m-2}), and ModelRunner.commit runs the recurrences over just those. Their
     attention KV is step 2's; KV past them is simply overwritten later. The drafter took in
     t_0, d_1 .. d_{k-1}: it keeps that when m >= k (at m = k + 1 the catch-up of the next step
     runs d_k), else (or where a grammar's forced tokens replaced its guesses) its saved state
     comes back and it catches up (a check + commit).

Stays out (the engine's normal steps run instead): prompts with input embeddings (the drafter
has its own hidden size), tensor parallelism.

The MTP head as the draft source (`speculate_mtp`): the model's MTP block reads the hidden
state h_i of position i (before the final norm) and the embedding of token i + 1, and guesses
token i + 2; its attention layer keeps its own KV at every position it has run. So after each
forward whose next tokens are known (a prefill chunk or an eager decode: `mtp_after_run`; a
check: its kept rows), the MTP block runs over those positions and its last row's greedy guess
is the sequence's draft d_1 for the next step, which checks [t_0, d_1, ..] (or [t_0] alone
where no draft is at hand: after a decode step replayed as a CUDA graph, whose hidden states
are not kept). Positions the MTP block never ran (such graph steps) leave holes in its KV:
later guesses see less context, the tokens stay exactly the model's. With k > 1 guesses a step
the block then runs on its own output (`mtp_chain`, as DeepSeek-V3's MTP modules chain, one
block reused): its output h'_i at the last kept row and the embedding of d_1 give d_2 at the
next position, and so on; those rows' KV is rewritten when the kept rows get there.
Batches without grammars run a step as one series of graph replays with
the acceptance on the GPU (a sampled row's guess is kept while it equals the row's own draw:
kept with its probability, the first one dropped replaced by a draw from the rest,
accept_sampled's rule; a seeded sequence draws row j with its noise row for the token it
emits there, accept_seeded's rule), and several such steps back to back (the engine's
decode_steps): each checks the last counted token and the head's new guesses, its rows made on
the GPU (check_layout.next_check), one read back for all; a sequence that stops becomes
padding; penalties, logit_bias and min_tokens adjust the rows there too (sampler.RowAdjuster). The
small work between the graphs runs as three Triton kernels
(volundr.kernels.spec). On the H100, with every guess right, k = 2 / 3: 314 -> 333 / 373 ->
400 tok/s with both (perf/RESULTS.md, session 35).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from volundr.model_runner import ModelRunner
from volundr.sampler import (
    RowAdjuster,
    append_logprobs,
    filtered_probs,
    record_logprobs,
    seeded_noise,
    to_device,
)
from volundr.scheduler import ScheduledSeq
from volundr.sequence import Sequence
from volundr.structured import forced_drafts, mask_rows


@contextmanager
def _computed(seqs: list[Sequence], counts: list[int]):
    """The sequences with num_computed_tokens = counts for one forward (a drafter's view: its
    own; a row further on), then as before."""
    saved = [s.num_computed_tokens for s in seqs]
    for s, n in zip(seqs, counts):
        s.num_computed_tokens = n
    try:
        yield
    finally:
        for s, n in zip(seqs, saved):
            s.num_computed_tokens = n


def _drafter_view(seqs: list[Sequence]):
    """The sequences as the drafter's runner must see them: num_computed_tokens = its own."""
    return _computed(seqs, [s.num_draft_computed for s in seqs])


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
    dev = logits.device
    probs = filtered_probs(logits, [seq.params] * logits.shape[0])
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


def accept_seeded(logits: torch.Tensor, guesses: list[int], seq: Sequence) -> list[int]:
    """A seeded sampled request (module doc, step 3): logits [k + 1, V] of the model after
    t_0, d_1 .. d_k; row j's token is argmax(p_j / E) with E the sequence's next noise row,
    exactly as plain sampling draws its next token (Sampler.sample), the rows drawn one at a
    time while the guesses match: the generator advances by the tokens emitted, and they are
    plain seeded sampling's whatever the guesses."""
    rows = len(guesses) + 1
    probs = filtered_probs(logits[:rows], [seq.params] * rows)
    out = []
    for j in range(rows):
        out.append(int((probs[j] / seeded_noise(seq, probs.shape[1], logits.device)).argmax()))
        if j == len(guesses) or guesses[j] != out[-1]:
            break
    return out


def _counted_kept(target: ModelRunner, seqs: list[Sequence], drafts: list[list[int]],
                  logits: torch.Tensor, counted: Callable[[Sequence, list[int]], int]
                  ) -> list[list[int]]:
    """Step 3 of the module doc for each sequence: its kept guesses and the token after them
    (greedy: `greedy_kept`; sampled: `accept_sampled`, logits [n, >= 1 + its guesses, V]),
    cut to the tokens that count (`counted`). Penalties: row j of a sequence is penalized as
    if its guesses before j were generated, as plain decoding would have them then; a grammar
    masks it as after them (volundr.structured.mask_rows). Logprobs (params.logprobs) are
    recorded for the tokens that count, from their rows' raw logits."""
    raw = logits
    adjust = RowAdjuster.of(seqs, logits.shape[1])
    if adjust is not None:  # (row j's ids: t_0 then the guesses, padded past a short one)
        n, rows, V = logits.shape
        ids = to_device([[0, *d, *[0] * (rows - 1 - len(d))] for d in drafts], torch.long,
                        logits.device)
        logits = adjust(logits.reshape(n * rows, V), ids).view(n, rows, V)
    logits = mask_rows(logits, seqs, drafts)  # (grammars: row j after guesses d_1 .. d_j)
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, (s, d) in enumerate(zip(seqs, drafts)):
        if s.params.greedy:
            toks = greedy_kept(greedy[i], d)
        elif s.params.seed is not None:
            toks = accept_seeded(logits[i, :1 + len(d)], d, s)
        else:
            toks = accept_sampled(logits[i, :1 + len(d)], d, s, target.sampler.generator)
        out.append(toks[:counted(s, toks)])
    kept_logprobs(raw, seqs, out)
    return out


def kept_logprobs(raw: torch.Tensor, seqs: list[Sequence], out: list[list[int]]) -> None:
    """Records the logprobs (params.logprobs) of the tokens that count, out[i][j] from its row
    raw[i, j] of the check's logits [n, >= len(out[i]), V] (as Sampler.sample does)."""
    lp_rows = [(i, j) for i, s in enumerate(seqs) if s.params.logprobs is not None
               for j in range(len(out[i]))]
    if lp_rows:
        seq_at, row_at = (torch.tensor(x, device=raw.device) for x in zip(*lp_rows))
        record_logprobs(raw[seq_at, row_at],
                        torch.tensor([out[a][b] for a, b in lp_rows], device=raw.device),
                        [seqs[a] for a, _ in lp_rows])


def _row_logprobs(seqs: list[Sequence], L: int, device: torch.device):
    """(record, recorded) for the graphs' steps (CheckGraphs.run_greedy_mtp's `record`): each
    step's logprobs of every checked row of the sequences asking (params.logprobs), from the
    check's raw logits, left on the device in `recorded` (one entry a step); (None, []) when
    none asks."""
    asking = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not asking:
        return None, []
    rows = [i * L + j for i in asking for j in range(L)]
    idx = to_device(rows, torch.long, device)  # (made once: no host round trip between steps)
    row_seqs = [seqs[i] for i in asking for _ in range(L)]
    recorded: list = []

    def record(logits: torch.Tensor, chosen: torch.Tensor) -> None:
        record_logprobs(logits[idx], chosen.flatten()[idx], row_seqs, recorded)

    return record, recorded


def _append_counted(rec: tuple, seqs: list[Sequence], lens: list[int], L: int) -> None:
    """One step's recorded row logprobs (_row_logprobs) onto the sequences asking, for their
    first lens[i] rows (the tokens that count)."""
    asking = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    keep = [q * L + j for q, i in enumerate(asking) for j in range(lens[i])]
    _, chosen, top_lp, top_id = rec
    k = torch.tensor(keep, dtype=torch.long, device=chosen.device)
    append_logprobs([(list(range(len(keep))), chosen[k], top_lp[k], top_id[k])],
                    [seqs[asking[r // L]] for r in keep])


def speculate(target: ModelRunner, drafter: ModelRunner, batch: list[ScheduledSeq], k: int,
              L: int, chunk: int, counted: Callable[[Sequence, list[int]], int]
              ) -> list[list[int]]:
    """One speculative step (module doc) over `batch` (sequences decoding one token each, KV
    blocks grown for k + 1 positions; k + 1 <= L, the check length).
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
    own = [[row[i] for row in guesses] for i in range(len(seqs))]
    drafts = forced_drafts(seqs, own, k)  # (grammars: the tokens they force first)
    # 2. the model's distributions after t_0, d_1 .. d_k (states read only)
    with _appended(seqs, drafts):
        logits = target.check([ScheduledSeq(s, k + 1) for s in seqs], L)[:, :k + 1]
    # 3. accepted guesses and the token after them; the tokens that count
    out = _counted_kept(target, seqs, drafts, logits, counted)
    # 4. states: the model's take in t_0 and the counted tokens but the last
    target.commit([len(toks) for toks in out])
    back = [i for i, toks in enumerate(out) if len(toks) < k or drafts[i] != own[i]]
    if back:
        drafter.load_states([slots[i] for i in back], saved_draft, back)
    for i, s in enumerate(seqs):
        s.num_draft_computed = p[i] if i in back else p[i] + k
    return out


def mtp_chain(target: ModelRunner, seqs: list[Sequence], out: list[list[int]],
              first: tuple[list[int], torch.Tensor], k: int) -> list[list[int]]:
    """The guesses d_2 .. d_k after d_1 (module doc: the MTP block applied to its own output):
    sequence i kept out[i] (m tokens after t_0 at p: its next t_0 sits at p + m); first = the
    block's guesses d_1 (of the token at p + m + 1) and its outputs h' at the kept rows' last.
    d_{j+1} = the block's row at p + m + j - 1 with hidden h' of the row before and next id
    d_j; the row's KV is stored there (position p + 2k - 1 at most: the engine grew the blocks)
    and rewritten by the next step's kept rows. Returns each sequence's [d_1 .. d_k]."""
    guesses, h = first
    drafts = [[g] for g in guesses]
    for j in range(1, k):
        at = [s.num_computed_tokens + len(toks) + j - 1 for s, toks in zip(seqs, out)]
        with _appended(seqs, [toks + d[:-1] for toks, d in zip(out, drafts)]), \
                _computed(seqs, at):
            guesses, h = target.mtp([ScheduledSeq(s, 1) for s in seqs], h,
                                    [d[-1] for d in drafts])
        for d, g in zip(drafts, guesses):
            d.append(g)
    return drafts


def speculate_mtp(target: ModelRunner, batch: list[ScheduledSeq], k: int,
                  counted: Callable[[Sequence, list[int]], int],
                  limits: Callable[[Sequence], tuple[int, tuple[int, ...]]] | None = None,
                  steps: int = 1) -> list[list[list[int]]]:
    """Speculative steps with the MTP head's drafts (module doc; checks of k + 1 rows: the
    model runner's check_len) over `batch` (decoding sequences as `speculate` takes them, KV
    blocks grown for 2k positions and k + 1, and (steps - 1)(k + 1) more). Returns each
    sequence's counted tokens per step (one step, or up to `steps` where the graphs' one
    replay takes the batch: each step checks the last one's guesses on the device, one read
    back for all; a sequence's list ends with its last step that counted tokens); the states
    then hold t_0 and the counted tokens but the last, and seq.mtp_drafts the k guesses for the
    next step. limits(seq) -> (the most tokens it may still take, its stop ids), `counted`'s
    rules as data: with it, batches without grammars take the graphs' one replay
    (ModelRunner.check_greedy_mtp), which applies them on the GPU (penalties, bias and
    min_tokens too: sampler.RowAdjuster)."""
    seqs = [it.seq for it in batch]
    drafts = forced_drafts(seqs, [s.mtp_drafts[:k] for s in seqs], k)
    items = [ScheduledSeq(s, 1 + len(d)) for s, d in zip(seqs, drafts)]
    L = k + 1
    if limits is not None and all(s.grammar is None for s in seqs):
        caps, stops = zip(*map(limits, seqs))  # (before the drafts are appended)
        record, recorded = _row_logprobs(seqs, L, target.device)
        choose = target.sampler.row_chooser(seqs, L, steps)
        adjust = RowAdjuster.of(seqs, L)
        with _appended(seqs, drafts):
            fused = target.check_greedy_mtp(items, L, list(caps), list(stops), k, steps,
                                            choose, record, adjust)
        if fused is not None:
            if choose is not None:  # (seeded generators: a row per emitted token)
                choose.finish([sum(lens[i] for _, lens, _ in fused) for i in range(len(seqs))])
            for s, guesses in zip(seqs, fused[-1][2]):
                s.mtp_drafts = guesses
            out = [[a[:m] for a, m in zip(rows, lens)] for rows, lens, _ in fused]
            for (_, lens, _), rec in zip(fused, recorded):  # the counted rows' logprobs
                _append_counted(rec, seqs, lens, L)
            return [[step[i] for step in out if step[i]] for i in range(len(seqs))]
    with _appended(seqs, drafts):
        logits = target.check(items, L)
    hidden = target.last_hidden  # [len(seqs) L, d]: sequence i's rows from i L on
    out = _counted_kept(target, seqs, drafts, logits, counted)
    target.commit([len(toks) for toks in out])
    # the MTP block over the kept rows: row j (position p + j) is followed by out[i][j]
    idx = torch.tensor([i * L + j for i, toks in enumerate(out) for j in range(len(toks))],
                       device=hidden.device)
    with _appended(seqs, [toks[:-1] for toks in out]):
        first = target.mtp([ScheduledSeq(s, len(t)) for s, t in zip(seqs, out)], hidden[idx],
                           [x for toks in out for x in toks])
    for s, d in zip(seqs, mtp_chain(target, seqs, out, first, k)):
        s.mtp_drafts = d
    return [[toks] for toks in out]


def mtp_after_run(target: ModelRunner, batch: list[ScheduledSeq], tokens: list[int]) -> None:
    """After a forward of `batch` (ModelRunner.run, before the engine advances the sequences)
    that sampled `tokens` for its sampling items: the MTP block over every position it ran,
    each followed by the next prompt token or the sampled one, and the first draft d_1 of the
    sampling items (the next step checks it alone; no room is held for a chain's rows here).
    A forward replayed as a CUDA graph keeps no hidden states: no drafts."""
    hidden = target.last_hidden
    if hidden is None:
        for it in batch:
            it.seq.mtp_drafts = []
        return
    sampled, nxt = iter(tokens), []
    for it in batch:
        s, e = it.seq.num_computed_tokens, it.seq.num_computed_tokens + it.num_new_tokens
        nxt += it.seq.token_ids[s + 1:e] + [next(sampled) if it.samples else it.seq.token_ids[e]]
    guesses, _ = target.mtp(batch, hidden, nxt)
    for it, g in zip(batch, guesses):
        it.seq.mtp_drafts = [g] if it.samples else []
