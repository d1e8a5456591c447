"""Comparing two greedy generations of the same prompt, with the documented near-tie rule.

Greedy decoding is deterministic up to floating point: a different batch composition, a
chunked prefill or a cached prefix changes the order of additions in the matmuls, which moves
logits by ~1e-6. That can only flip the argmax where the top two candidates are tied to that
precision. The rule: a divergence is excused (a *near tie*) only if, at the first differing
position, the reference run's top-2 logprob gap is below ``NEAR_TIE_GAP``; the tokens after
it are then not compared (the continuations legitimately differ). Any other differing token
counts as a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NEAR_TIE_GAP = 1e-3  # nats


@dataclass(frozen=True, slots=True)
class Comparison:
    mismatched: int  # tokens that differ (or are missing/extra) outside the near-tie rule
    near_tie_at: int | None  # position of an excused divergence


def compare(
    reference: Sequence[int], gaps: Sequence[float | None], other: Sequence[int]
) -> Comparison:
    """``gaps[i]``: the reference's top-2 logprob gap at position ``i`` (None = unknown,
    never excused). ``other`` may be shorter than ``reference`` only by being truncated."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            gap = gaps[i] if i < len(gaps) else None
            if gap is not None and gap < NEAR_TIE_GAP:
                return Comparison(0, i)
            rest = sum(1 for x, y in zip(reference[i:], other[i:], strict=False) if x != y)
            return Comparison(rest + abs(len(reference) - len(other)), None)
    return Comparison(abs(len(reference) - len(other)), None)
