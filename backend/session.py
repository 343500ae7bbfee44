"""Parked sessions: a finished request's model state kept in host memory, resumed by its next turn.

An agent's turns share their history: turn n + 1's prompt is turn n's prompt and output plus the
tool result or the user's reply. A request with a `session_id` that finishes is parked: its
recurrent state (KDA state, conv and Engram tails: one fixed-size slot) and the attention KV of
its computed tokens are copied to host memory (pinned on CUDA), and its GPU blocks and slot are
freed at once, so a session waiting on a tool holds no GPU memory. When the session's next
request arrives and its prompt starts with the parked tokens, the engine copies the state back
into a slot and the KV into fresh blocks, and prefills only the new tokens. Otherwise it falls
back to the state at the end of the parked turn's own prompt, also parked, when the new prompt
extends that: chat clients send the assistant's reply back without its reasoning (or
re-tokenized), so the history matches up to the reply and differs within it. Any other prompt
drops the parked state (KDA's state cannot be rewound to an arbitrary prefix) and runs from
scratch.

The store keeps at most `capacity_bytes` of host memory (rank 0's copy: with tensor parallelism
each rank holds its own shard as much again), evicting the least recently parked session first.
Bookkeeping here is plain Python; the runner does the copies and keeps the tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

# The longest session id the APIs take (the OpenAI proxy and volundr_llm's input check it).
MAX_SESSION_ID_CHARS = 256
# Host memory for parked sessions unless set (EngineConfig.session_gib, LLM, the profiles).
DEFAULT_SESSION_GIB = 4.0

@dataclass
class ParkedSession:
    """A parked state's bookkeeping; its tensors stay with the runner (with tensor parallelism
    every rank its shard) under `ticket`. tokens: the ids whose effect the state holds
    (tokens[i] at position i); nbytes: host bytes of rank 0's copy; prompt_len > 0: the state
    after tokens[:prompt_len] (the turn's prompt) is parked too; embeds: position -> digest of
    the input embedding used there (an image patch: every patch shares one placeholder id, so
    equal ids with another image must not resume)."""

    tokens: list[int]
    ticket: int
    nbytes: int
    prompt_len: int = 0
    embeds: dict[int, str] = field(default_factory=dict)
    draft_tokens: int = 0  # a drafter's state after tokens[:draft_tokens] parked too (0: none)


@dataclass(frozen=True)
class Resume:
    """What a request restores at admission: the runner's parked `ticket`, its state after the
    first num_tokens tokens (the turn's end, or its prompt's end) and the KV blocks over them."""

    ticket: int
    num_tokens: int
    at_prompt_end: bool = False
    draft_tokens: int = 0  # the drafter's parked state covers this many tokens (0: none)


class SessionStore:
    def __init__(self, capacity_bytes: int, forget: Callable[[int], None] = lambda t: None):
        """forget(ticket): frees a parked state's tensors (the runner's)."""
        if capacity_bytes < 0:
            raise ValueError("the session store's capacity must be >= 0 bytes")
        self.capacity_bytes = capacity_bytes
        self.forget = forget
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
        a state larger than the whole store is forgotten at once."""
        self.drop(session_id)
        if not self.fits(parked.nbytes):
            self.forget(parked.ticket)
            return
        while self.nbytes + parked.nbytes > self.capacity_bytes:
            _, old = self._parked.popitem(last=False)
            self.nbytes -= old.nbytes
            self.forget(old.ticket)
            self.num_evicted += 1
        self._parked[session_id] = parked
        self.nbytes += parked.nbytes

    def take(self, session_id: str, prompt: list[int],
             embeds: dict[int, str] | None = None) -> Resume | None:
        """The session's parked state if `prompt` extends its tokens by at least one token, else
        its state at the end of its turn's prompt if `prompt` extends that; it leaves the store
        (the request now owns the runner's tensors: restored at admission, or forgotten if the
        request ends before). Else None, and the parked state is dropped. embeds: the prompt's
        input embedding digests (position -> digest), equal to the parked ones over the
        resumed tokens."""
        parked = self._parked.pop(session_id, None)
        if parked is None:
            return None
        self.nbytes -= parked.nbytes
        embeds = embeds or {}
        for n, at_prompt_end in ((len(parked.tokens), False), (parked.prompt_len, True)):
            if (n and len(prompt) > n and prompt[:n] == parked.tokens[:n]
                    and {p: d for p, d in embeds.items() if p < n}
                    == {p: d for p, d in parked.embeds.items() if p < n}):
                self.num_resumed += 1
                return Resume(parked.ticket, n, at_prompt_end,
                              0 if at_prompt_end else parked.draft_tokens)
        self.forget(parked.ticket)
        self.num_mismatched += 1
        return None

    def drop(self, session_id: str) -> bool:
        parked = self._parked.pop(session_id, None)
        if parked is not None:
            self.nbytes -= parked.nbytes
            self.forget(parked.ticket)
        return parked is not None

    def stats(self) -> dict[str, int]:
        return {"sessions_parked": len(self._parked), "sessions_host_bytes": self.nbytes,
                "sessions_resumed": self.num_resumed, "sessions_evicted": self.num_evicted,
                "sessions_mismatched": self.num_mismatched}
