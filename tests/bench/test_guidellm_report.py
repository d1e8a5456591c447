"""Reading GuideLLM's JSON report (bench/online_guidellm.py): the figures set beside the gRPC
client's, and a run that did not complete every request in full is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.common import Work
from bench.online_guidellm import CpuClock, guidellm_summary

WORK = [Work((1, 2, 3), 4), Work((4, 5), 6)]


def _dist(p50: float, p99: float) -> dict[str, Any]:
    return {"successful": {"percentiles": {"p50": p50, "p99": p99}}}


def _report(outputs: list[int], errored: int = 0) -> dict[str, Any]:
    """Requests i = 0, 1 sent at 100 + i / 2 s, done 1.5 s later, with outputs[i] tokens."""
    requests = [
        {"info": {"timings": {"request_start": 100.0 + i / 2, "request_end": 101.5 + i / 2}},
         "output_tokens": out,
         "request_args": json.dumps({"body": {"max_tokens": WORK[i].max_tokens}})}
        for i, out in enumerate(outputs)
    ]
    metrics = {
        "request_totals": {"successful": len(outputs), "errored": errored, "incomplete": 0,
                           "total": len(outputs) + errored},
        "time_to_first_token_ms": _dist(50.0, 90.0),
        "time_per_output_token_ms": _dist(20.0, 30.0),
        "inter_token_latency_ms": _dist(10.0, 40.0),
    }
    return {"benchmarks": [{"metrics": metrics, "duration": 99.0,
                            "requests": {"successful": requests}}]}


def test_figures_come_from_the_requests_own_timings() -> None:
    s = guidellm_summary(_report([4, 6]), WORK)
    assert s["wall_s"] == 2.0  # first request sent -> last finished, not GuideLLM's duration
    assert s["sent_req_s"] == 2.0  # 2 requests, sent 0.5 s apart
    assert s["window_unix"] == [100.0, 102.0]  # where the server's CPU is read
    assert (s["req_s"], s["output_tok_s"], s["output_tokens"]) == (1.0, 5.0, 10)
    assert (s["ttft_p50_ms"], s["ttft_p99_ms"], s["tpot_p50_ms"]) == (50.0, 90.0, 20.0)
    assert (s["itl_p50_ms"], s["itl_p99_ms"]) == (10.0, 40.0)


def test_one_request_short_of_the_count_is_allowed() -> None:
    """GuideLLM's Poisson profile may stop one request before max_requests."""
    s = guidellm_summary(_report([4]), WORK)
    assert (s["completed"], s["output_tokens"], s["wall_s"]) == (1, 4, 1.5)


@pytest.mark.parametrize(("outputs", "errored"), [([4, 5], 0), ([4], 1), ([], 0)])
def test_a_run_with_errors_or_short_outputs_is_refused(outputs: list[int], errored: int) -> None:
    with pytest.raises(RuntimeError, match="guidellm"):
        guidellm_summary(_report(outputs, errored), WORK)


def test_server_cpu_is_read_for_the_window_only() -> None:
    clock = CpuClock()
    clock.samples = [(10.0, 1.0), (11.0, 1.5), (12.0, 3.5), (13.0, 3.6)]
    assert clock.cpu_between(11.0, 12.0) == 2.0
    assert clock.cpu_between(10.5, 12.5) == pytest.approx(2.3)  # 1.25 -> 3.55, linear between samples
