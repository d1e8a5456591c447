"""Does a system's batched greedy output match its own one-request greedy output?

A throughput figure means little if batching changed what the system computes. The offline
suite keeps every system's tokens from its last timed run and, for a sample of the requests,
runs each request alone on the same system (the system's own greedy reference), then compares.
Greedy decoding in reduced precision may legitimately part ways where two logits nearly tie
(batched kernels sum in another order), so the figure is the common prefix, and the check
asks for the first ``FIRST`` tokens of every sampled request to agree: a batching bug (rows
mixed up, a wrong position, a stale KV page) breaks that at once, a near tie rarely does.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.common import Target, Work

FIRST = 8  # tokens of every sampled request that must agree with the reference


@dataclass(frozen=True, slots=True)
class Agreement:
    """One system's batched tokens against its one-request reference on sampled requests."""

    system: str
    sampled: int
    identical: int  # requests whose whole output matched
    prefix: tuple[int, ...]  # per sampled request: tokens equal before the first difference
    lengths: tuple[int, ...]  # per sampled request: its output length

    @property
    def prefix_fraction(self) -> float:
        """Mean share of each sampled output that matched before the first difference."""
        return statistics.fmean(p / n for p, n in zip(self.prefix, self.lengths, strict=True))

    @property
    def first_ok(self) -> bool:
        return all(p >= min(FIRST, n) for p, n in zip(self.prefix, self.lengths, strict=True))

    def as_dict(self) -> dict[str, object]:
        return {
            "system": self.system,
            "sampled": self.sampled,
            "identical": self.identical,
            "prefix": list(self.prefix),
            "lengths": list(self.lengths),
            "prefix_fraction": self.prefix_fraction,
            "first_ok": self.first_ok,
        }


def sample(work: Sequence[Work], k: int) -> list[int]:
    """Indices of ``k`` requests spread over the work list (the first one included)."""
    if not work:
        return []
    step = max(1, len(work) // k)
    return list(range(0, len(work), step))[:k]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(
    system: str,
    work: Sequence[Work],
    indices: Sequence[int],
    batched: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
) -> Agreement:
    """``batched`` holds every request's ids from the timed run, ``reference`` the sampled
    requests' ids run alone (in the order of ``indices``)."""
    if len(reference) != len(indices):
        raise ValueError(f"{system}: {len(reference)} references for {len(indices)} samples")
    lengths, prefix = [], []
    for i, ref in zip(indices, reference, strict=True):
        want = work[i].max_tokens
        got = list(batched[i])
        if len(got) != want or len(ref) != want:
            raise RuntimeError(
                f"{system}: request {i} gave {len(got)} batched / {len(ref)} reference tokens "
                f"for max_tokens {want}"
            )
        lengths.append(want)
        prefix.append(common_prefix(got, ref))
    identical = sum(p == n for p, n in zip(prefix, lengths, strict=True))
    return Agreement(system, len(indices), identical, tuple(prefix), tuple(lengths))


def target(found: Sequence[Agreement]) -> Target | None:
    """Sampled requests whose first FIRST tokens match their reference, worst system."""
    if not found:
        return None

    def share(a: Agreement) -> float:
        ok = sum(p >= min(FIRST, n) for p, n in zip(a.prefix, a.lengths, strict=True))
        return ok / a.sampled

    worst = min(found, key=share)
    return Target(
        f"batched greedy tokens = own one-request run, first {FIRST} tokens "
        f"(share of sampled requests, worst system: {worst.system})",
        share(worst),
        1.0,
    )


def table_rows(found: Sequence[Agreement]) -> list[tuple[object, ...]]:
    return [
        (
            a.system,
            f"{a.identical}/{a.sampled}",
            f"{a.prefix_fraction:.3f}",
            " ".join(f"{p}/{n}" for p, n in zip(a.prefix, a.lengths, strict=True)),
            "yes" if a.first_ok else "NO",
        )
        for a in found
    ]


TABLE_HEAD = (
    "system",
    "identical outputs",
    "mean matching prefix",
    "matching prefix per sampled request",
    f"first {FIRST} agree",
)
