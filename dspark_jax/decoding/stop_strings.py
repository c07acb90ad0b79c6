"""Stop strings (as vLLM applies them by default): the output text ends just before the first
occurrence of any of them, the string itself excluded, and the token ids are cut to the tokens
needed to produce the kept text. The engine stops on ids on the device; strings are found on the
host as tokens stream in (`Engine.generate(..., should_stop=...)`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string starts in `text` (the earliest of all), None if none occurs."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def cut_at_stop(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                stops: Sequence[str]) -> tuple[list[int], str, bool]:
    """(token ids, text, whether a stop string was found): the text cut before the first stop
    string and the shortest prefix of the ids whose decoded text starts with it (a token that
    straddles the cut stays: it is needed for the kept text)."""
    ids = list(token_ids)
    text = decode(ids)
    cut = find_stop(text, stops)
    if cut is None:
        return ids, text, False
    kept = text[:cut]
    lo, hi = 0, len(ids)  # the smallest m with decode(ids[:m]) starting with `kept`
    while lo < hi:
        m = (lo + hi) // 2
        if decode(ids[:m]).startswith(kept):
            hi = m
        else:
            lo = m + 1
    return ids[:lo], kept, True
