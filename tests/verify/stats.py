"""Small statistics without scipy: percentiles and the Mann-Whitney U test."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def mann_whitney_u(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(U of ``x``, two-sided p-value). Exact for small samples without ties (enumerating
    the null distribution by dynamic programming); a tie-corrected normal approximation
    otherwise."""
    n, m = len(x), len(y)
    if n == 0 or m == 0:
        raise ValueError("both samples need at least one value")
    ranked = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks = [0.0] * len(ranked)
    i = 0
    tie_term = 0.0
    while i < len(ranked):
        j = i
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2.0 + 1.0
        t = j - i + 1
        tie_term += t**3 - t
        i = j + 1
    r_x = sum(r for r, (_, g) in zip(ranks, ranked, strict=True) if g == 0)
    u = r_x - n * (n + 1) / 2.0
    u_low = min(u, n * m - u)
    if tie_term == 0 and n * m <= 10_000:
        counts = _u_distribution(n, m)
        total = math.comb(n + m, n)
        tail = sum(counts[: math.floor(u_low) + 1]) / total
        return u, min(1.0, 2.0 * tail)
    mean = n * m / 2.0
    var = n * m / 12.0 * ((n + m + 1) - tie_term / ((n + m) * (n + m - 1)))
    if var <= 0:
        return u, 1.0
    z = (abs(u - mean) - 0.5) / math.sqrt(var)
    return u, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0)))


def _u_distribution(n: int, m: int) -> list[int]:
    """counts[u] = number of arrangements of n x's and m y's with U == u."""
    # f[i][j][u]: ways with i x's and j y's; built up one observation at a time.
    prev = [[[1]] + [[1] for _ in range(m)]]
    for i in range(1, n + 1):
        row: list[list[int]] = []
        for j in range(m + 1):
            size = i * j + 1
            cur = [0] * size
            # last element is an x: it beats all j y's -> adds j to U
            for u, c in enumerate(prev[i - 1][j]):
                cur[u + j] += c
            if j > 0:
                for u, c in enumerate(row[j - 1]):
                    cur[u] += c
            row.append(cur)
        prev.append(row)
    return prev[n][m]
