"""The shared-prefix suite's figures: ratios of medians within each run, spread over runs, and
targets judged on the worst run; the summary renders them from the JSON form."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench import shared_prefix
from bench.common import _jsonable
from bench.summary import summary_markdown


def _shared(opted_ms: float, unshared_ms: float, outsider: int = 0) -> dict[str, Any]:
    return {
        "first_ttft_opted": [opted_ms / 1000] * 3, "first_ttft_unshared": [unshared_ms / 1000] * 3,
        "first_cached_opted": [2000] * 3, "first_cached_unshared": [0] * 3,
        "prefix_pages": 125, "operator_pages": 125, "opted_own_pages": 16,
        "unshared_pages": 16 * 126, "outsider_ttft_prefix": [1.0, 1.1], "outsider_ttft_novel":
        [1.0, 1.0], "outsider_cached": [outsider, 0], "outsider_shared_hit_tokens": 0,
    }


def _tier(repeat_ms: float, least_cached: int = 496) -> dict[str, Any]:
    return {
        "prefix_tokens": 496, "ttft_novel": [0.3, 0.3, 0.4], "ttft_repeat": [repeat_ms / 1000] * 3,
        "repeat_cached": [496, least_cached, 496], "other_cached": [0, 0, 0],
        "other_hit_tokens": 0, "tampered_tier_tokens": 0, "tier_rejected": 1,
    }


def test_figures_are_ratios_within_a_run_and_targets_judge_the_worst_run() -> None:
    f = shared_prefix.figures([_shared(30, 600), _shared(40, 500), _shared(200, 500)],
                              [_tier(30), _tier(60), _tier(90, least_cached=432)])
    assert f["first_ttft_ratio"].runs == pytest.approx((0.05, 0.08, 0.4))
    assert f["prefix_copies_unshared"].median == pytest.approx(16.0)
    assert f["prefix_copies_shared"].median == 1.0
    assert f["outsider_ttft_ratio"].median == pytest.approx(1.05)
    assert f["tier_ttft_ratio"].max == pytest.approx(0.3)
    targets = {t.name.split(" (worst")[0]: t for t in shared_prefix.judge(f)}
    first = targets["first-request TTFT, opted in / unshared tenant"]
    assert (first.value, first.passed) == (pytest.approx(0.4), False)  # the worst run decides
    least = targets["tier: repeat cached tokens / prefix (least of a run)"]
    assert least.value == pytest.approx(432 / 496) and not least.passed
    assert targets["tier: TTFT repeat / novel"].passed
    assert targets["cached tokens of a tenant not opted in"].passed


def test_a_tenant_not_opted_in_with_a_cached_token_misses_its_target() -> None:
    f = shared_prefix.figures([_shared(30, 600, outsider=16)], [_tier(30)])
    targets = {t.name.split(" (worst")[0]: t for t in shared_prefix.judge(f)}
    assert not targets["cached tokens of a tenant not opted in"].passed


def test_the_summary_renders_the_suite_from_its_json() -> None:
    f = shared_prefix.figures([_shared(30, 600)] * 3, [_tier(30)] * 3)
    data = json.loads(json.dumps({
        "suite": "shared_prefix", "figures": f, "targets": shared_prefix.judge(f),
        "machine": {"cpu_model": "x", "usable_cores": 2, "threads": 2, "cpu_flags": {},
                    "versions": {}},
    }, default=_jsonable))
    text = summary_markdown({"shared_prefix": data})
    assert "| opted in / unshared | 0.05 [0.05–0.05] |" in text
    assert "| copies of the prefix's pages, unshared | 16 [16–16] |" in text
    assert "| repeat / novel | 0.1 [0.1–0.1] |" in text
