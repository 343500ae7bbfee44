"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Sampling uses the exponential-race form of the Gumbel trick: token = argmax(p_i / E_i) with
E_i ~ Exp(1). A seeded request draws its E from its own generator, one row per step, so its
tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from volundr.sequence import Sequence


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


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits [M, V] fp32, one row per sequence -> one token id each."""
        return self.sample(logits, seqs).tolist()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """As __call__, but the ids stay on the device ([M] long): multi-step decode feeds
        them to the next step without a host round trip. Each seeded sequence draws one row
        of noise per call from its own generator, so its tokens do not depend on how the
        steps were grouped."""
        greedy = logits.argmax(dim=1)
        if all(s.params.greedy for s in seqs):
            return greedy
        dev = logits.device
        p = [s.params for s in seqs]
        temp = torch.tensor([x.temperature if x.temperature > 0 else 1.0 for x in p], device=dev)
        probs = apply_filters(
            logits, temp,
            torch.tensor([x.top_k for x in p], device=dev, dtype=torch.long),
            torch.tensor([x.top_p for x in p], device=dev),
            torch.tensor([x.min_p for x in p], device=dev))
        noise = torch.empty_like(probs)
        for i, s in enumerate(seqs):
            if s.params.seed is None:
                continue
            if s.generator is None:
                s.generator = torch.Generator(device=dev).manual_seed(s.params.seed)
            noise[i].exponential_(generator=s.generator)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            idx = torch.tensor(unseeded, device=dev)
            noise[idx] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_(
                generator=self.generator)
        sampled = (probs / noise).argmax(dim=1)
        is_greedy = torch.tensor([x.greedy for x in p], device=dev)
        return torch.where(is_greedy, greedy, sampled)
