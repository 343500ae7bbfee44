"""Stop strings, matched on generated text (not on ids: a stop string may span tokens or end in
the middle of one).

The producer holds back any text whose tail could still grow into a stop string, so nothing past
a stop string is ever emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the earliest stop string starts in `text`, or -1."""
    best = -1
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def validate_stops(stops: Sequence[str]) -> tuple[str, ...]:
    """Non-empty, de-duplicated stop strings; at most 16 of at most 256 characters each."""
    out = tuple(dict.fromkeys(s for s in stops if s))
    if len(out) > 16:
        raise ValueError(f"at most 16 stop strings are supported, got {len(out)}")
    for s in out:
        if len(s) > 256:
            raise ValueError("a stop string may have at most 256 characters")
    return out
