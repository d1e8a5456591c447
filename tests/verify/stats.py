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


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("df must be >= 1")
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def student_t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t (bisection on the CDF; p in (0, 1))."""
    if not 0.0 < p < 1.0:
        raise ValueError("p must be in (0, 1)")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) by its continued fraction (Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _betainc(b, a, 1.0 - x)
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log(1.0 - x))
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return math.exp(log_front) * f / a


def paired_log_ratio_ci(
    x: Sequence[float], y: Sequence[float], alpha: float
) -> tuple[float, float, float]:
    """(ratio x/y, lower, upper) from the paired log differences ``log x_i - log y_i``: the
    Hodges-Lehmann estimate and its distribution-free two-sided ``1 - 2*alpha`` confidence
    interval (Wilcoxon signed rank: order statistics of the Walsh averages), so one
    scheduling outlier cannot sink or rescue it. TOST at level ``alpha`` declares x and y
    equivalent within a factor ``m`` iff [lower, upper] lies inside [1/m, m]."""
    if len(x) != len(y):
        raise ValueError("x and y must pair up")
    d = [math.log(a) - math.log(b) for a, b in zip(x, y, strict=True)]
    n = len(d)
    walsh = sorted((d[i] + d[j]) / 2.0 for i in range(n) for j in range(i, n))
    k = signed_rank_critical(n, alpha)  # P(T <= k - 1) <= alpha
    if k < 1:
        raise ValueError(f"{n} pairs are too few for a {1 - 2 * alpha:.0%} interval")
    mid = len(walsh) // 2
    estimate = walsh[mid] if len(walsh) % 2 else (walsh[mid - 1] + walsh[mid]) / 2.0
    return math.exp(estimate), math.exp(walsh[k - 1]), math.exp(walsh[-k])


def signed_rank_critical(n: int, alpha: float) -> int:
    """The largest k with P(T < k) <= alpha for the signed-rank statistic T of n pairs
    (exact null distribution, counted by dynamic programming over rank subsets)."""
    top = n * (n + 1) // 2
    counts = [1] + [0] * top
    for rank in range(1, n + 1):
        for total in range(top, rank - 1, -1):
            counts[total] += counts[total - rank]
    k, cumulative = 0, 0
    while cumulative + counts[k] <= alpha * 2**n:
        cumulative += counts[k]
        k += 1
    return k
