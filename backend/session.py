"""Parked sessions: a finished request's model state kept in host memory, resumed by its next turn.

An agent's turns share their history: turn n + 1's prompt is turn n's prompt and output plus the
tool result or the user's reply. A request with a `session_id` that finishes is parked: its
recurrent state (KDA state, conv and Engram tails: one fixed-size slot) and the attention KV of
its computed tokens are copied to host memory (pinned on CUDA), and its GPU blocks and slot are
freed at once, so a session waiting on a tool holds no GPU memory. When the session's next
request arrives and its prompt starts with the parked tokens, the engine copies the state back
into a slot and the KV into fresh blocks, and prefills only the new tokens. Any other prompt
falls back to the state at the end of the parked turn's own prompt, also parked, when the new
prompt extends that: chat clients send the assistant's reply back without its reasoning (or
re-tokenized), so the history matches up to the reply and differs within it. Any other prompt
drops the parked state (KDA's state cannot be rewound to an arbitrary prefix) and runs from
scratch.

The store keeps at most `capacity_bytes` of host memory, evicting the least recently parked
session first. Bookkeeping here is plain Python; the runner does the copies.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class ParkedSession:
    """tokens: the ids whose effect the state holds (tokens[i] at position i); states: one host
    tensor per runner state tensor (that tensor's row of the slot); kv: per attention cache
    (runner order), the rows of the blocks that cover `tokens`, [blocks, block_size, KVH, D];
    prompt_states: the states after tokens[:prompt_len], the turn's prompt (empty: none)."""

    tokens: list[int]
    states: list[torch.Tensor]
    kv: list[torch.Tensor] = field(default_factory=list)
    prompt_len: int = 0
    prompt_states: list[torch.Tensor] = field(default_factory=list)
    # position -> digest of the input embedding used there (an image patch): equal token ids
    # (every patch is <|image_pad|>) with another image must not resume
    embeds: dict[int, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in self.states + self.kv + self.prompt_states)

    def at_prompt_end(self) -> ParkedSession:
        """The state after the turn's prompt, with the KV blocks that cover it (views)."""
        n = self.prompt_len
        nb = -(-n // self.kv[0].shape[1]) if self.kv else 0
        return ParkedSession(self.tokens[:n], self.prompt_states, [c[:nb] for c in self.kv],
                             embeds={p: d for p, d in self.embeds.items() if p < n})


class SessionStore:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError("the session store's capacity must be >= 0 bytes")
        self.capacity_bytes = capacity_bytes
        self._parked: OrderedDict[str, ParkedSession] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.num_resumed = 0  # requests that started from a parked state
        self.num_evicted = 0  # parked states dropped for room
        self.num_mismatched = 0  # parked states dropped because the next prompt diverged

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._parked

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity_bytes

    def put(self, session_id: str, parked: ParkedSession) -> None:
        """Park (replacing the session's earlier state), evicting the oldest others for room;
        a state larger than the whole store is not kept."""
        self.drop(session_id)
        if not self.fits(parked.nbytes):
            return
        while self.nbytes + parked.nbytes > self.capacity_bytes:
            _, old = self._parked.popitem(last=False)
            self.nbytes -= old.nbytes
            self.num_evicted += 1
        self._parked[session_id] = parked
        self.nbytes += parked.nbytes

    def take(self, session_id: str, prompt: list[int],
             embeds: dict[int, str] | None = None) -> ParkedSession | None:
        """The session's parked state if `prompt` extends its tokens by at least one token, else
        its state at the end of its turn's prompt if `prompt` extends that (it leaves the store:
        the request now owns it); else None, and the parked state is dropped. embeds: the
        prompt's input embedding digests (position -> digest), which must match the parked
        ones over the resumed tokens."""
        embeds = embeds or {}
        parked = self._parked.get(session_id)
        if parked is None:
            return None
        self.drop(session_id)
        for cand in (parked, parked.at_prompt_end() if parked.prompt_states else None):
            n = len(cand.tokens) if cand is not None else 0
            if (cand is not None and n and len(prompt) > n and prompt[:n] == cand.tokens
                    and {p: d for p, d in embeds.items() if p < n} == cand.embeds):
                self.num_resumed += 1
                return cand
        self.num_mismatched += 1
        return None

    def drop(self, session_id: str) -> bool:
        parked = self._parked.pop(session_id, None)
        if parked is not None:
            self.nbytes -= parked.nbytes
        return parked is not None

    def stats(self) -> dict[str, int]:
        return {"sessions_parked": len(self._parked), "sessions_host_bytes": self.nbytes,
                "sessions_resumed": self.num_resumed, "sessions_evicted": self.num_evicted,
                "sessions_mismatched": self.num_mismatched}
