"""Stop-string matching over streamed text, across token boundaries.

The matcher sees the whole text produced so far and how much of it was already emitted.
It finds the earliest stop string that ends in the newly added text, and otherwise says
how much text is safe to emit: everything except the longest tail that could still grow
into a stop string. Held-back text is released when generation ends for another reason.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopMatch:
    """Result of one ``scan``: emit ``text[emitted:safe_end]``; ``stopped`` ends the request."""

    safe_end: int
    stopped: bool


class StopMatcher:
    """Matches a fixed set of stop strings against a growing text."""

    __slots__ = ("_max_len", "_stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = stops
        self._max_len = max((len(s) for s in stops), default=0)

    def scan(self, text: str, prev_len: int, emitted: int) -> StopMatch:
        """``text`` grew from ``prev_len`` characters; ``emitted`` characters are already out."""
        if not self._stops:
            return StopMatch(len(text), False)
        # A match must end in the new text, so it starts at most max_len-1 characters back;
        # matches wholly inside older text were found by an earlier scan.
        window_start = max(0, prev_len - self._max_len + 1, emitted)
        first = -1
        for stop in self._stops:
            at = text.find(stop, window_start)
            if at != -1 and (first == -1 or at < first):
                first = at
        if first != -1:
            return StopMatch(first, True)
        return StopMatch(len(text) - self._held_tail(text, emitted), False)

    def _held_tail(self, text: str, emitted: int) -> int:
        """Length of the longest unemitted suffix of ``text`` that is a proper prefix of a stop."""
        longest = min(self._max_len - 1, len(text) - emitted)
        for n in range(longest, 0, -1):
            tail = text[len(text) - n :]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0
