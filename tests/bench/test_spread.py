"""Benchmark figures: median [min–max] of the timed runs, targets judged on the worst run.

Each suite's aggregation is tested on made-up runs (no model): the spread of every figure,
ratios paired run by run, and targets that fail when one run fails though the median passes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench import continuous, isolation_cost, online, overhead, prefix
from bench.common import Spread, _jsonable, md_table, spread, worst_target
from bench.summary import summary_markdown


def test_spread_shows_median_min_max_and_judges_the_worst_run() -> None:
    s = spread([0.95, 0.85, 1.0])
    assert (s.median, s.min, s.max) == (0.95, 0.85, 1.0)
    assert str(s) == "0.95 [0.85–1]"
    assert md_table(("x",), [(s,)]).splitlines()[-1] == "| 0.95 [0.85–1] |"
    assert s.as_dict() == {"median": 0.95, "min": 0.85, "max": 1.0, "runs": [0.95, 0.85, 1.0]}
    higher = worst_target("ratio", s, 0.9)
    assert (higher.value, higher.passed, higher.name) == (0.85, False, "ratio (worst of 3 runs)")
    lower = worst_target("latency", s, 0.97, higher_is_better=False)
    assert (lower.value, lower.passed) == (1.0, False)
    assert worst_target("ratio", spread([0.91, 0.95, 1.0]), 0.9).passed
    with pytest.raises(ValueError):
        Spread(())


def test_overhead_point_pairs_engine_and_raw_run_by_run() -> None:
    p = overhead.point(8, 128, [10.0, 20.0, 12.0], [9.0, 10.0, 12.0])
    assert p["ratio_raw_over_engine"].runs == (0.9, 0.5, 1.0)
    assert str(p["engine_step_ms"]) == "12 [10–20]"
    # the worst run (0.5) decides, though the median run (0.9) would pass
    assert not worst_target("step", p["ratio_raw_over_engine"], 0.9).passed


def _cont(mode: str, tok_s: float) -> dict[str, Any]:
    return {
        "mode": mode,
        "output_tok_s": tok_s,
        "wall_s": 100 / tok_s,
        "decode_positions": 7,
        "latency_mean_s": 1.0,
        "latency_p50_s": 1.0,
        "latency_p99_s": tok_s / 100,
    }


def test_continuous_rows_and_speedup_over_interleaved_runs() -> None:
    runs = [
        _cont(m, t)
        for s, c in ((10.0, 30.0), (20.0, 30.0), (10.0, 40.0))
        for m, t in (("static", s), ("continuous (engine)", c))
    ]
    rows, speedup = continuous.aggregate(runs)
    assert [r["mode"] for r in rows] == ["static", "continuous (engine)"]
    assert rows[0]["output_tok_s"].runs == (10.0, 20.0, 10.0)
    assert rows[1]["latency_p99_s"].runs == (0.3, 0.3, 0.4)
    assert rows[1]["decode_positions"] == 7
    assert speedup.runs == (3.0, 1.5, 4.0)
    assert str(speedup) == "3 [1.5–4]"


def _summary(req_s: float) -> dict[str, float]:
    return {k: req_s * (i + 1) for i, k in enumerate(online.FIGURES)}


def test_online_groups_each_rate_over_its_runs() -> None:
    results = [
        {
            "run": run,
            "rate": label,
            "request_rate": rate,
            "overall": _summary(base + run),
            "per_tenant": {"a": _summary(base - run), "b": _summary(base)},
        }
        for run in range(3)
        for label, rate, base in (("inf", None, 10.0), ("0.9x", 5.0 + run, 4.0))
    ]
    rates = online.aggregate(results)
    assert [(r["rate"], r["request_rates"], r["runs"]) for r in rates] == [
        ("inf", [None] * 3, 3),
        ("0.9x", [5.0, 6.0, 7.0], 3),
    ]
    assert rates[0]["overall"]["req_s"].runs == (10.0, 11.0, 12.0)
    assert rates[1]["overall"]["ttft_p50_ms"].runs == (12.0, 15.0, 18.0)
    assert rates[1]["per_tenant"]["a"]["req_s"].runs == (4.0, 3.0, 2.0)
    # the online target: ITL p50 at 0.9x capacity, on the worst run (7 x (4, 5, 6) ms here)
    (itl,) = online.itl_targets(rates)
    assert (itl.value, itl.threshold, itl.higher_is_better, itl.passed) == (42.0, 40.0, False, False)
    assert "worst of 3 runs" in itl.name
    fast = [dict(r, overall=_summary(5.0)) if r["rate"] == "0.9x" else r for r in results]
    (met,) = online.itl_targets(online.aggregate(fast))
    assert (met.value, met.passed) == (35.0, True)


def test_prefix_ratios_paired_by_repetition_and_target_on_the_worst() -> None:
    samples = {
        "cold": [(1.0, 0), (2.0, 0), (1.0, 0)],
        "warm": [(0.1, 992), (0.2, 992), (0.3, 992)],  # 0.1, 0.1, 0.3 of its cold
        "other tenant": [(1.0, 0), (2.0, 0), (1.0, 0)],
    }
    ttft_ms, vs_cold, cached, targets = prefix.judge(samples)
    assert ttft_ms["warm"].runs == pytest.approx((100.0, 200.0, 300.0))
    assert vs_cold["warm"].runs == pytest.approx((0.1, 0.1, 0.3))
    assert cached == {"cold": 0, "warm": 992, "other tenant": 0}
    warm, other = targets
    assert warm.value == pytest.approx(0.3) and not warm.passed  # the median (0.1) would pass
    assert other.passed
    samples["other tenant"][1] = (0.1, 992)  # one leaking repetition fails the target
    assert not prefix.judge(samples)[3][1].passed


def _cost(scrubs: int, scrub_ms: float, prefix_ms: float, wall_s: float) -> isolation_cost.Cost:
    return isolation_cost.Cost(scrubs, scrub_ms / 1e3, prefix_ms / 1e3, wall_s)


def test_isolation_cost_is_the_timed_work_over_the_wall_time_judged_on_the_worst_round() -> None:
    samples = {
        isolation_cost.DEFAULT: [99.0, 90.0, 100.0],
        "scrub off": [100.0, 100.0, 100.0],
        "prefix cache off": [98.0, 80.0, 120.0],
    }
    # round 2 zeroes 400 pages in 400 ms of a 10 s run: 4% of the wall time
    costs = [_cost(200, 20.0, 5.0, 10.0), _cost(400, 400.0, 5.0, 10.0), _cost(100, 10.0, 5.0, 10.0)]
    tok_s, over, seen, targets = isolation_cost.judge(samples, costs)
    assert tok_s[isolation_cost.DEFAULT].runs == (99.0, 90.0, 100.0)
    assert over["scrub reassign vs off"].runs == pytest.approx((0.01, 0.1, 0.0))
    assert over["prefix cache on vs off"].median == pytest.approx(1 - 99 / 98)
    assert seen["µs per zeroed page"].runs == pytest.approx((100.0, 1000.0, 100.0))
    assert seen[isolation_cost.ZEROING].runs == pytest.approx((0.002, 0.04, 0.001))
    zeroing, prefix_cost = targets
    assert zeroing.value == pytest.approx(0.04) and not zeroing.passed  # median round: 0.2%
    assert prefix_cost.value == pytest.approx(0.0005) and prefix_cost.passed
    cheap = [_cost(200, 20.0, 5.0, 10.0)] * 3
    assert all(t.passed for t in isolation_cost.judge(samples, cheap)[3])
    assert isolation_cost.judge(samples, [_cost(0, 0.0, 0.0, 10.0)] * 3)[2][
        "µs per zeroed page"
    ].runs == (0.0, 0.0, 0.0)


def _roundtrip(data: dict[str, Any]) -> dict[str, Any]:
    """What summary.py reads back: the suite's JSON as write_suite writes it."""
    loaded: dict[str, Any] = json.loads(json.dumps(data, default=_jsonable))
    return loaded


def test_summary_renders_every_figure_as_median_min_max() -> None:
    rows, speedup = continuous.aggregate(
        [_cont(m, t) for m, t in (("static", 10.0), ("continuous (engine)", 30.0))] * 3
    )
    iso = isolation_cost.judge(
        {isolation_cost.DEFAULT: [99.0, 90.0, 100.0], "scrub off": [100.0] * 3,
         "prefix cache off": [100.0] * 3},
        [_cost(200, 20.0, 5.0, 10.0), _cost(100, 100.0, 5.0, 10.0), _cost(300, 30.0, 5.0, 10.0)],
    )
    pre = prefix.judge({k: [(1.0, 0), (2.0, 0), (3.0, 0)] for k in ("cold", "warm", "other tenant")})
    machine = {"cpu_model": "cpu", "usable_cores": 2, "threads": 2, "cpu_flags": {}, "versions": {}}
    results = {
        "overhead": {"machine": machine, "targets": [],
                     "points": [overhead.point(1, 128, [10.0, 20.0, 12.0], [9.0, 10.0, 12.0])]},
        "continuous": {"machine": machine, "targets": [], "max_batch": 16, "rows": rows,
                       "speedup": speedup},
        "online": {"machine": machine, "targets": [], "rates": online.aggregate(
            [{"rate": "inf", "request_rate": None, "overall": _summary(1.0 + r),
              "per_tenant": {}} for r in range(3)])},
        "prefix": {"machine": machine, "targets": pre[3], "ttft_ms": pre[0],
                   "ttft_over_cold": pre[1], "cached_tokens": pre[2]},
        "isolation_cost": {"machine": machine, "targets": iso[3], "output_tok_s": iso[0],
                           "overhead": iso[1], "isolation_work": iso[2]},
    }
    text = summary_markdown({k: _roundtrip(v) for k, v in results.items()})
    assert "| 1 | 128 | 12 [10–20] | 10 [9–12] | 0.9 [0.5–1] |" in text
    assert "**3 [3–3]x**" in text
    assert "| inf | 2 [1–3] | 4 [2–6] | 6 [3–9] | 8 [4–12] | 14 [7–21] | 16 [8–24] |" in text
    assert "| warm | 2000 [1000–3000] | 1 [1–1] | 0 |" in text
    assert "| default (reassign, prefix on) | 99 [90–100] |" in text
    assert "| scrub reassign vs off | 0.01 [0–0.1] |" in text
    assert "| µs per zeroed page | 100 [100–1000] |" in text
    assert "isolation cost: page zeroing / run wall time (worst of 3 runs) | 0.010 | ≤ 0.03 | pass" in text


def test_summary_leaves_out_single_run_results_instead_of_showing_them_without_spread() -> None:
    machine = {"cpu_model": "cpu", "usable_cores": 2, "threads": 2, "cpu_flags": {}, "versions": {}}
    old = {
        "online": {"machine": machine, "targets": [], "runs": [{"rate": "inf", "overall": {}}]},
        "continuous": {"machine": machine, "targets": [], "max_batch": 16, "speedup": 2.5},
    }
    text = summary_markdown(old)
    assert "Online serving" not in text and "Continuous batching" not in text
    assert "Machine: cpu" in text


def test_memory_figures_are_per_mode_spreads_and_render_in_the_summary() -> None:
    from bench import memory

    def row(rss: float, tok_s: float) -> dict[str, float]:
        return {"rss_after_load_mb": rss, "peak_rss_mb": rss + 100, "packed_mb": 97.0,
                "decode_tok_s": tok_s}

    figures = memory.aggregate({"auto": [row(500, 40), row(520, 45), row(510, 50)]})
    assert figures["auto"]["rss_after_load_mb"].runs == (500.0, 520.0, 510.0)
    assert figures["auto"]["decode_tok_s"].median == 45.0
    machine = {"cpu_model": "cpu", "usable_cores": 2, "threads": 2, "cpu_flags": {}, "versions": {}}
    text = summary_markdown(
        {"memory": _roundtrip({"machine": machine, "targets": [], "figures": figures})}
    )
    assert "| auto | 510 [500–520] | 610 [600–620] | 97 [97–97] | 45 [40–50] |" in text
