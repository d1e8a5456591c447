"""Exponentially weighted least squares with non-negative coefficients (the cost model's fits)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class LeastSquares:
    """Exponentially weighted least squares of ``y`` on a few non-negative coefficients."""

    size: int
    decay: float = 0.9  # weight of the past per observation
    _xx: list[list[float]] = field(init=False)  # decayed sum of x x^T
    _xy: list[float] = field(init=False)  # decayed sum of x y

    def __post_init__(self) -> None:
        self._xx = [[0.0] * self.size for _ in range(self.size)]
        self._xy = [0.0] * self.size

    @property
    def measured(self) -> bool:
        return any(self._xx[i][i] > 0 for i in range(self.size))

    def observe(self, x: Sequence[float], y: float) -> None:
        for i in range(self.size):
            self._xy[i] = self.decay * self._xy[i] + x[i] * y
            for j in range(self.size):
                self._xx[i][j] = self.decay * self._xx[i][j] + x[i] * x[j]

    def fit(self, tries: Sequence[tuple[int, ...]], mean_of: int) -> list[float]:
        """Coefficients of the first feature subset in ``tries`` whose fit is non-negative
        (steps too alike to tell terms apart drop the later ones); else all of ``y`` charged
        to feature ``mean_of``."""
        for used in tries:
            xx = [[self._xx[i][j] for j in used] for i in used]
            coef = _solve(xx, [self._xy[i] for i in used])
            if coef is not None and all(c >= 0 for c in coef):
                full = [0.0] * self.size
                for i, c in zip(used, coef, strict=True):
                    full[i] = c
                return full
        full = [0.0] * self.size
        if self._xx[mean_of][mean_of] > 0:
            # sum(x y) / sum(x x) over one feature: least squares through the origin
            full[mean_of] = max(0.0, self._xy[mean_of] / self._xx[mean_of][mean_of])
        return full


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Least-squares coefficients from the normal equations ``a c = b``; None when the
    features cannot be told apart. Each feature is scaled to unit size first (keys run to
    millions where the intercept's sum is about 10), so the test for a singular system
    means collinear features, not large numbers."""
    n = len(b)
    d = [math.sqrt(a[i][i]) for i in range(n)]
    if not all(d):
        return None
    m = [[a[i][j] / (d[i] * d[j]) for j in range(n)] + [b[i] / d[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-9:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] / d[i] for i in range(n)]
