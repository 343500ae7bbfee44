"""Token sampling: penalties and logit bias, grammar masks, greedy, temperature, top-k, top-p,
min-p, seeds.

Sampling uses the exponential-race form of the Gumbel trick: token = argmax(p_i / E_i) with
E_i ~ Exp(1). A seeded request draws its E from its own generator, one row per step, so its
tokens do not depend on which other requests share the batch. Penalties and logit_bias change
the logits first, greedy requests' too, and min_tokens masks the stop ids while too few tokens
are out; then a structured request's grammar masks every id that would break its form
(volundr.structured).
"""

from __future__ import annotations

import torch

from volundr.sampling_params import SamplingParams
from volundr.sequence import Sequence
from volundr.structured import mask_seqs


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """Penalized logits [M, V] (vLLM's order): a token seen in the prompt or the output has its
    logit divided by `repetition` if positive, else multiplied; then every token loses
    frequency * (its count in the output) + presence * (1 if it is in the output).

    logits [M, V] fp32; counts [M, V] (output counts); seen [M, V] bool; presence, frequency,
    repetition [M] float."""
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0)


def count_rows(rows: list[list[int]], V: int, dev: torch.device) -> torch.Tensor:
    """[len(rows), V + 1] fp32: row i's count of each token id (column V: padding)."""
    width = max(1, *(len(r) for r in rows))
    ids = to_device([r + [V] * (width - len(r)) for r in rows], torch.long, dev)
    return torch.zeros(len(rows), V + 1, device=dev).scatter_add_(
        1, ids, torch.ones(ids.shape, device=dev))


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
                  prompts: list[list[int]], recent: torch.Tensor | None = None,
                  generated: list[int] | None = None,
                  stop_ids: list[tuple[int, ...]] | None = None) -> torch.Tensor:
    """logits [M, V] with each row's penalties (`apply_penalties`) and then its logit_bias
    applied, and its stop_ids[i] masked out (-inf) while it has generated fewer than its
    min_tokens (rows with none of these are returned as they are, and logits itself when no
    row has any). outputs[i]: the tokens row i has generated so far (read for the penalties);
    prompts[i]: its prompt's (read for a repetition penalty only); recent [j, M] long: tokens
    generated on the device after them (multi-step decode); generated[i]: how many tokens
    row i has generated before recent's (read for min_tokens)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    dev, V = logits.device, logits.shape[1]
    idx = torch.tensor(rows, device=dev)
    sub = logits[idx].float()
    if any(params[i].penalized for i in rows):
        counts = count_rows([outputs[i] if params[i].penalized else [] for i in rows], V, dev)
        if recent is not None and recent.shape[0]:
            counts.scatter_add_(1, recent[:, idx].t(), torch.ones(len(rows), recent.shape[0],
                                                                   device=dev))
        counts = counts[:, :V]
        seen = counts > 0
        if any(params[i].repetition_penalty != 1.0 for i in rows):
            seen |= count_rows([prompts[i] for i in rows], V, dev)[:, :V] > 0

        def col(name: str) -> torch.Tensor:
            return torch.tensor([getattr(params[i], name) for i in rows], device=dev)

        # (a row without penalties: presence 0, frequency 0, repetition 1 change nothing)
        sub = apply_penalties(sub, counts, seen, col("presence_penalty"),
                              col("frequency_penalty"), col("repetition_penalty"))
    bias = [(k, t, b) for k, i in enumerate(rows) for t, b in params[i].logit_bias]
    if bias:
        r, t, b = zip(*bias)
        sub.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                       torch.tensor(b, device=dev), accumulate=True)
    j = 0 if recent is None else recent.shape[0]
    early = [(k, t) for k, i in enumerate(rows) if generated is not None
             and generated[i] + j < params[i].min_tokens for t in stop_ids[i]
             if 0 <= t < V]
    if early:  # (after the bias: a +100 on a stop token must not undo it)
        r, t = zip(*early)
        sub[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = float("-inf")
    return logits.index_copy(0, idx, sub.to(logits.dtype))


def adjust_seqs(logits: torch.Tensor, seqs: list[Sequence],
                recent: torch.Tensor | None = None,
                extra: list[list[int]] | None = None) -> torch.Tensor:
    """`adjust_logits` with row i = seqs[i] (its output and prompt tokens as the engine holds
    them, and extra[i] after its output: tokens it is assumed to have generated, a check's
    guesses; its stop ids, seq.stop_ids)."""
    if not any(s.params.adjusts_logits for s in seqs):
        return logits
    outs = [s.output_token_ids + (extra[i] if extra else []) if s.params.penalized else []
            for i, s in enumerate(seqs)]
    prompts = [s.token_ids[:s.num_prompt_tokens] if s.params.repetition_penalty != 1.0 else []
               for s in seqs]
    generated = [s.num_output_tokens + (len(extra[i]) if extra else 0)
                 for i, s in enumerate(seqs)]
    return adjust_logits(logits, [s.params for s in seqs], outs, prompts, recent, generated,
                         [s.stop_ids for s in seqs])


def seeded_noise(seq: Sequence, V: int, dev: torch.device) -> torch.Tensor:
    """The next row of Exp(1) noise [V] from seq's own generator (made from its seed on first
    use): one row per token it samples, whichever path samples it (a step, a speculative
    check), so that its tokens depend on its seed alone."""
    return torch.empty(V, device=dev).exponential_(generator=seq_generator(seq, dev))


def seq_generator(seq: Sequence, dev: torch.device) -> torch.Generator:
    """seq's own generator, made from its seed on first use."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=dev).manual_seed(seq.params.seed)
    return seq.generator


def record_logprobs(logits: torch.Tensor, ids: torch.Tensor, seqs: list[Sequence],
                    later: list | None = None) -> None:
    """Appends to seq.logprobs, for each sequence asking (params.logprobs), the chosen token's
    log-probability under the model (log-softmax of its raw logits [M, V]: before penalties,
    temperature and filters, as vLLM reports them) and its params.logprobs most likely
    tokens'. ids [M]: the chosen tokens. A sequence may have several rows, in order (a
    speculative check's kept tokens). later: a list that takes the values on the device
    instead, for `append_logprobs` after the step's one read back (multi-step decode)."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = lp.gather(1, ids[idx].unsqueeze(1)).squeeze(1)
    k = max(seqs[i].params.logprobs for i in rows)
    top_lp, top_id = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    if later is not None:
        later.append((rows, chosen, top_lp, top_id))
    else:
        append_logprobs([(rows, chosen, top_lp, top_id)], seqs)


def append_logprobs(recorded: list, seqs: list[Sequence]) -> None:
    """The values `record_logprobs` left on the device, in the order they were recorded, onto
    the sequences' logprobs."""
    for rows, chosen, top_lp, top_id in recorded:
        chosen, top_lp, top_id = chosen.tolist(), top_lp.tolist(), top_id.tolist()
        for r, i in enumerate(rows):
            n = seqs[i].params.logprobs
            seqs[i].logprobs.append((chosen[r], list(zip(top_id[r][:n], top_lp[r][:n]))))


def apply_filters(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [M, V] after temperature, top-k, top-p and min-p (rows renormalised).

    temperature, top_p, min_p: [M] float (temperature > 0); top_k: [M] long, <= 0 means off.
    """
    logits = logits / temperature.unsqueeze(1)
    V = logits.shape[1]
    sorted_logits, order = logits.sort(dim=1, descending=True)
    ranks = torch.arange(V, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    before = probs.cumsum(dim=1) - probs
    probs = probs.masked_fill(before >= top_p.unsqueeze(1), 0.0)
    # min-p: drop tokens below min_p times the most likely one
    probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs[:, :1], 0.0)
    probs = probs / probs.sum(dim=1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`apply_filters` with row i's settings from params[i] (a greedy row at temperature 1:
    its token is the argmax anyway)."""
    dev = logits.device
    return apply_filters(
        logits, torch.tensor([x.temperature if x.temperature > 0 else 1.0 for x in params],
                             device=dev),
        torch.tensor([x.top_k for x in params], device=dev, dtype=torch.long),
        torch.tensor([x.top_p for x in params], device=dev),
        torch.tensor([x.min_p for x in params], device=dev))


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array as a tensor on `device`; on CUDA copied from pinned memory, so that
    the copy is asynchronous (no wait for the GPU's queue)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits [M, V] fp32, one row per sequence -> one token id each."""
        return self.sample(logits, seqs).tolist()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               recent: torch.Tensor | None = None, later: list | None = None) -> torch.Tensor:
        """As __call__, but the ids stay on the device ([M] long): multi-step decode feeds
        them to the next step without a host round trip (recent [j, M]: the ids of its
        earlier steps, which the sequences do not hold yet; read by the penalties; later: the
        logprobs stay on the device too, `record_logprobs`). Each seeded sequence draws one
        row of noise per call from its own generator, so its tokens do not depend on how the
        steps were grouped."""
        raw = logits
        logits = mask_seqs(adjust_seqs(logits, seqs, recent), seqs)
        ids = self._choose(logits, seqs)
        record_logprobs(raw, ids, seqs, later)
        return ids

    def row_chooser(self, seqs: list[Sequence], L: int, steps: int = 1) -> RowChooser | None:
        """RowChooser for a run of `steps` speculative checks of seqs x L rows; None when
        every sequence is greedy (the rows' argmax)."""
        if all(s.params.greedy for s in seqs):
            return None
        return RowChooser(self, seqs, L, steps)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        greedy = logits.argmax(dim=1)
        if all(s.params.greedy for s in seqs):
            return greedy
        dev = logits.device
        p = [s.params for s in seqs]
        probs = filtered_probs(logits, p)
        noise = torch.empty_like(probs)
        for i, s in enumerate(seqs):
            if s.params.seed is not None:
                noise[i] = seeded_noise(s, probs.shape[1], dev)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            idx = torch.tensor(unseeded, device=dev)
            noise[idx] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_(
                generator=self.generator)
        sampled = (probs / noise).argmax(dim=1)
        is_greedy = torch.tensor([x.greedy for x in p], device=dev)
        return torch.where(is_greedy, greedy, sampled)


class RowChooser:
    """Each row's token in a run of speculative checks of n sequences x L rows
    (CheckGraphs.run_greedy_mtp's `choose`), on the device: the argmax for greedy sequences'
    rows and padding rows, a draw from the row's filtered distribution (the exponential race)
    for sampled ones. A sequence's guesses are then kept while they equal its rows' tokens,
    which for a draw keeps each guess with its probability and replaces the first one dropped
    by a draw from the rest (accept_sampled's rule; speculative module doc). Unseeded rows
    take fresh noise from the sampler's generator. A seeded sequence's row j draws with its
    own noise row e + j, e = the tokens it emitted earlier in the run, as plain seeded
    sampling would (accept_seeded): its rows for the run (steps x L) come from its generator
    at the first call, and `finish` then leaves the generator as if it had drawn one row per
    token emitted. Its tensors are made at the first call and reused: no host round trip
    between the steps."""

    def __init__(self, sampler: Sampler, seqs: list[Sequence], L: int, steps: int):
        self.sampler, self.seqs, self.L, self.steps = sampler, seqs, L, steps
        self.seeded = [i for i, s in enumerate(seqs)
                       if not s.params.greedy and s.params.seed is not None]
        self.made: dict[str, torch.Tensor] = {}
        self.saved: list[torch.Tensor] | None = None  # the seeded generators' states

    def _make(self, logits: torch.Tensor) -> None:
        R, V, dev, L = logits.shape[0], logits.shape[1], logits.device, self.L
        rows = [self.seqs[i // L].params if i // L < len(self.seqs) else None for i in range(R)]
        for name, v in (("temperature", [1.0 if p is None or p.greedy else p.temperature
                                         for p in rows]),
                        ("top_p", [1.0 if p is None else p.top_p for p in rows]),
                        ("min_p", [0.0 if p is None else p.min_p for p in rows])):
            self.made[name] = to_device(v, torch.float32, dev)
        self.made["top_k"] = to_device([0 if p is None else p.top_k for p in rows], torch.long, dev)
        self.made["greedy"] = to_device([p is None or p.greedy for p in rows], torch.bool, dev)
        if self.seeded:  # each seeded sequence's next steps x L noise rows
            self.saved = []
            noise = []
            for i in self.seeded:
                s = self.seqs[i]
                self.saved.append(seq_generator(s, dev).get_state())
                noise.append(torch.stack([seeded_noise(s, V, dev)
                                          for _ in range(self.steps * L)]))
            self.made["noise"] = torch.stack(noise)  # [seeded, steps L, V]
            self.made["rows"] = to_device([i * L + j for i in self.seeded for j in range(L)],
                                        torch.long, dev)
            self.made["seq"] = to_device([i for i in self.seeded for _ in range(L)], torch.long,
                                       dev)
            self.made["q"] = to_device([q for q in range(len(self.seeded)) for _ in range(L)],
                                     torch.long, dev)
            self.made["j"] = to_device(list(range(L)) * len(self.seeded), torch.long, dev)

    def __call__(self, logits: torch.Tensor, out: torch.Tensor, emitted: torch.Tensor) -> None:
        """logits [R, V] a check's rows, out [R] their tokens, emitted [n] each sequence's
        tokens counted earlier in the run (device)."""
        m = self.made
        if not m:
            self._make(logits)
        probs = apply_filters(logits, m["temperature"], m["top_k"], m["top_p"], m["min_p"])
        noise = torch.empty_like(probs).exponential_(generator=self.sampler.generator)
        if self.seeded:
            at = (emitted[m["seq"]] + m["j"]).clamp(max=m["noise"].shape[1] - 1)
            noise[m["rows"]] = m["noise"][m["q"], at]
        out.copy_(torch.where(m["greedy"], logits.argmax(dim=1), (probs / noise).argmax(dim=1)))

    def finish(self, counted: list[int]) -> None:
        """After the run (counted[i]: the tokens sequence i emitted in it): each seeded
        generator back where a row per emitted token leaves it."""
        if self.saved is None:
            return
        V = self.made["noise"].shape[2]
        for state, i in zip(self.saved, self.seeded):
            s = self.seqs[i]
            s.generator.set_state(state)
            for _ in range(counted[i]):
                seeded_noise(s, V, s.generator.device)
