"""Token sampling: penalties and logit bias, grammar masks, greedy, temperature, top-k, top-p,
min-p, seeds.

Sampling uses the exponential-race form of the Gumbel trick: token = argmax(p_i / E_i) with
E_i ~ Exp(1). A seeded request draws its E from its own generator, one row per step, so its
tokens do not depend on which other requests share the batch. Penalties and logit_bias change
the logits first, greedy requests' too, and min_tokens masks the stop ids while too few tokens
are out (RowAdjuster, one form for a step, a run of multi-step decode's steps and a speculative
check's rows); then a structured request's grammar masks every id that would break its form
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


class RowAdjuster:
    """Penalties, then logit_bias, then min_tokens' mask, on the device, for the rows [size, L]
    of `seqs` (the first n of size sequences, L rows each): a step's rows (L = 1), or a
    speculative check's (input t_0, then the guesses d_1 .. d_k), row j adjusted as if
    d_1 .. d_j had been generated. The tokens counted so far are the sequences' outputs when it
    is made (counted on the host once) plus those `advance` adds on the device after each step
    of a run (multi-step decode, the MTP head's runs of checks): no host round trip between
    the steps. Its tensors are made at the first call."""

    def __init__(self, seqs: list[Sequence], L: int = 1):
        """Made before the step's (or run's) tokens are appended to the sequences: their
        outputs are then the tokens generated so far."""
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

    @classmethod
    def of(cls, seqs: list[Sequence], L: int = 1) -> RowAdjuster | None:
        """None where no sequence's logits need adjusting."""
        return cls(seqs, L) if any(s.params.adjusts_logits for s in seqs) else None

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

    def __call__(self, logits: torch.Tensor, ids: torch.Tensor | None = None,
                 emitted: torch.Tensor | int = 0) -> torch.Tensor:
        """logits [size L, V] raw rows; ids [size, L] their input tokens (t_0 and the guesses;
        None for L = 1); emitted: the tokens each sequence counted earlier in the run ([size]
        on the device, or one number for all): the adjusted logits (a copy; the raw ones stay
        for logprobs)."""
        V, L = logits.shape[1], self.L
        m = self.made
        if not m:
            self._make(V, logits.device)
        idx = m["idx"]
        P = idx.shape[0]
        sub = logits.view(-1, L, V)[idx].float()  # [P, L, V]
        if "counts" in m:  # row j: the counts so far and the guesses d_1 .. d_j
            counts = m["counts"].unsqueeze(1)
            if L > 1:
                guessed = torch.zeros(P, L, V, device=logits.device)
                guessed[:, 1:].scatter_(2, ids[idx, 1:].unsqueeze(2), 1.0)
                counts = guessed.cumsum_(1).add_(counts)  # (one [P, L, V] buffer: at 16
                # sequences x 8 rows of a 262K vocabulary 134 MB)
            counts = counts.reshape(P * L, V)
            seen = counts > 0
            if self.repetition:
                seen = seen | m["prompt_seen"].repeat_interleave(L, dim=0)
            sub = apply_penalties(sub.view(P * L, V), counts, seen, m["presence_penalty"],
                                  m["frequency_penalty"],
                                  m["repetition_penalty"]).view(P, L, V)
        if "bias" in m:
            sub = sub + m["bias"].unsqueeze(1)
        if "stops" in m:  # (after the bias: a +100 on a stop token must not undo it)
            done = emitted[idx].unsqueeze(1) if torch.is_tensor(emitted) else emitted
            gen = m["generated"].unsqueeze(1) + done + m["j"]  # [P, L]
            early = (gen < m["min_tokens"].unsqueeze(1)).unsqueeze(2) & m["stops"].unsqueeze(1)
            sub = sub.masked_fill(early, float("-inf"))
        out = logits.clone()
        out.view(-1, L, V)[idx] = sub.to(logits.dtype)
        return out

    def advance(self, chosen: torch.Tensor, lens: torch.Tensor | None = None) -> None:
        """After a step (its acceptance): chosen [size, L] its rows' tokens, lens [size] how
        many of them each sequence counted (None: all); they join the counts (the
        penalties' history)."""
        if "counts" not in self.made:
            return
        idx = self.made["idx"]
        c = chosen[idx]
        keep = (torch.ones(c.shape, device=c.device) if lens is None else
                (torch.arange(self.L, device=c.device) < lens[idx].unsqueeze(1)).float())
        self.made["counts"].scatter_add_(1, c, keep)


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
        return self.sample(logits, seqs, RowAdjuster.of(seqs)).tolist()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], adjust: RowAdjuster | None,
               emitted: int = 0, later: list | None = None) -> torch.Tensor:
        """As __call__, but the ids stay on the device ([M] long): multi-step decode feeds
        them to the next step without a host round trip. adjust: the sequences' RowAdjuster
        (None where none needs one), made before the run's first step and advanced here by
        each step's ids; emitted: the tokens each sequence made earlier in the run (which it
        does not hold yet); later: the logprobs stay on the device too, `record_logprobs`.
        Each seeded sequence draws one row of noise per call from its own generator, so its
        tokens do not depend on how the steps were grouped."""
        raw = logits
        if adjust is not None:
            logits = adjust(logits, emitted=emitted)
        ids = self._choose(mask_seqs(logits, seqs), seqs)
        if adjust is not None:
            adjust.advance(ids.unsqueeze(1))
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
