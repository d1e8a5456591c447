"""Reading GuideLLM's JSON report (bench/online_guidellm.py): the figures set beside the gRPC
client's, and a run that did not complete every request in full is refused."""

from __future__ import annotations

from typing import Any

import pytest

from bench.common import Work
from bench.online_guidellm import guidellm_summary

WORK = [Work((1, 2, 3), 4), Work((4, 5), 6)]


def _dist(p50: float, p99: float) -> dict[str, Any]:
    return {"successful": {"percentiles": {"p50": p50, "p99": p99}}}


def _report(successful: int, output_tokens: float) -> dict[str, Any]:
    timings = [{"request_start": 100.0, "request_end": 101.5},
               {"request_start": 100.5, "request_end": 102.0}][:successful]
    metrics = {
        "request_totals": {"successful": successful, "errored": 2 - successful,
                           "incomplete": 0, "total": 2},
        "output_token_count": {"successful": {"total_sum": output_tokens}},
        "time_to_first_token_ms": _dist(50.0, 90.0),
        "time_per_output_token_ms": _dist(20.0, 30.0),
        "inter_token_latency_ms": _dist(10.0, 40.0),
    }
    return {"benchmarks": [{
        "metrics": metrics, "duration": 99.0,
        "requests": {"successful": [{"info": {"timings": t}} for t in timings]},
    }]}


def test_figures_come_from_the_requests_own_timings() -> None:
    s = guidellm_summary(_report(2, 9.999999999), WORK)  # GuideLLM sums token counts as floats
    assert s["wall_s"] == 2.0  # first request sent -> last finished, not GuideLLM's duration
    assert (s["req_s"], s["output_tok_s"], s["output_tokens"]) == (1.0, 5.0, 10)
    assert (s["ttft_p50_ms"], s["ttft_p99_ms"], s["tpot_p50_ms"]) == (50.0, 90.0, 20.0)
    assert (s["itl_p50_ms"], s["itl_p99_ms"]) == (10.0, 40.0)


@pytest.mark.parametrize(("successful", "tokens"), [(1, 4.0), (2, 9.0)])
def test_a_run_with_errors_or_short_outputs_is_refused(successful: int, tokens: float) -> None:
    with pytest.raises(RuntimeError, match="guidellm"):
        guidellm_summary(_report(successful, tokens), WORK)
