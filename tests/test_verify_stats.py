"""The small statistics the verify suite judges with, against published values."""

from __future__ import annotations

import math

import pytest

from tests.verify.stats import paired_log_ratio_ci, signed_rank_critical


@pytest.mark.parametrize(("n", "k"), [(6, 3), (10, 11), (20, 61), (40, 287)])
def test_signed_rank_critical_values_match_the_table(n: int, k: int) -> None:
    # One-sided 5% critical values of Wilcoxon's T (reject when T <= k - 1).
    assert signed_rank_critical(n, 0.05) == k


def test_ratio_interval_brackets_the_shift_and_shrugs_off_one_outlier() -> None:
    shifts = [0.10, 0.12, 0.08, 0.11, 0.09, 0.10, 0.13, 0.07, 0.10, 0.10]
    y = [1.0] * len(shifts)
    ratio, lo, hi = paired_log_ratio_ci([math.exp(s) for s in shifts], y, alpha=0.05)
    assert ratio == pytest.approx(math.exp(0.10))
    assert math.exp(0.07) < lo < ratio < hi < math.exp(0.13)
    spiked = [*shifts[:-1], 1.7]  # one request 5x slower than its pair
    _, lo2, hi2 = paired_log_ratio_ci([math.exp(s) for s in spiked], y, alpha=0.05)
    assert math.exp(0.07) < lo2 and hi2 < math.exp(0.2)


def test_too_few_pairs_are_refused() -> None:
    with pytest.raises(ValueError, match="too few"):
        paired_log_ratio_ci([1.0, 1.1, 1.2], [1.0, 1.0, 1.0], alpha=0.05)
