"""The benchmark harness pieces that need no peer and no model: workloads, traces, targets,
result files, summaries and the request driver."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path

import pytest
import torch

from bench.common import (
    FIRST_PLAIN_TOKEN,
    Target,
    Work,
    md_table,
    random_work,
    throughput,
    write_suite,
)
from bench.continuous import workload as continuous_workload
from bench.hf_peer import _pad_left
from bench.online import poisson_arrivals
from bench.summary import summary_markdown
from bench.traces import RequestTrace, by_tenant, summarize


def test_random_work_is_seeded_and_in_range() -> None:
    a = random_work(0, 50, (16, 256), (16, 128), vocab=49152)
    assert a == random_work(0, 50, (16, 256), (16, 128), vocab=49152)
    assert a != random_work(1, 50, (16, 256), (16, 128), vocab=49152)
    assert all(16 <= len(w.prompt_ids) <= 256 and 16 <= w.max_tokens <= 128 for w in a)
    assert all(FIRST_PLAIN_TOKEN <= t < 49152 for w in a for t in w.prompt_ids)
    # Inclusive bounds: a degenerate range gives exactly that length.
    assert {len(w.prompt_ids) for w in random_work(0, 5, (7, 7), (3, 3), 2000)} == {7}


def test_continuous_workload_is_capped_exponential() -> None:
    work = continuous_workload(False, 49152)
    assert len(work) == 64 and {len(w.prompt_ids) for w in work} == {128}
    assert all(1 <= w.max_tokens <= 256 for w in work)
    assert work == continuous_workload(False, 49152)


def test_throughput_counts_only_requested_output() -> None:
    work = [Work((1, 2, 3), 10), Work((4,), 30)]
    r = throughput("x", work, 2.0)
    assert (r.prompt_tokens, r.output_tokens) == (4, 40)
    assert r.output_tok_s == 20.0 and r.total_tok_s == 22.0


def test_target_margin_sign_follows_direction() -> None:
    assert Target("t", 2.5, 2.0).margin == 0.5 and Target("t", 2.5, 2.0).passed
    assert not Target("t", 1.5, 2.0).passed
    low = Target("t", 0.05, 0.03, higher_is_better=False)
    assert low.margin == pytest.approx(-0.02) and not low.passed
    assert Target("t", 0.1, 0.2, higher_is_better=False).passed


def test_md_table_shape() -> None:
    assert md_table(("a", "b"), [(1, 0.12345), ("x", 12345.6)]).splitlines() == [
        "| a | b |",
        "|---|---|",
        "| 1 | 0.123 |",
        "| x | 12346 |",
    ]


def _trace(tenant: str, start: float, chunks: list[tuple[float, int]]) -> RequestTrace:
    t = RequestTrace(tenant, prompt_tokens=10, start=start)
    for when, n in chunks:
        t.on_chunk(when, n)
    return t


def test_trace_metrics_follow_vllm_definitions() -> None:
    t = _trace("a", 0.0, [(0.5, 1), (0.6, 0), (0.7, 2), (1.0, 1)])
    assert t.output_tokens == 4 and len(t.chunk_times) == 3  # empty chunks are not arrivals
    assert t.ttft == 0.5
    assert t.tpot == pytest.approx((1.0 - 0.5) / 3)
    assert t.itls == pytest.approx([0.2, 0.3])


def test_summarize_overall_and_per_tenant() -> None:
    traces = [_trace("a", 0.0, [(0.1, 1), (0.3, 1)]), _trace("b", 0.0, [(0.2, 1), (0.6, 1)])]
    s = summarize(traces, wall_s=2.0)
    assert s["req_s"] == 1.0 and s["output_tok_s"] == 2.0 and s["total_tok_s"] == 12.0
    assert s["ttft_p50_ms"] == pytest.approx(150.0)
    assert s["itl_mean_ms"] == pytest.approx(300.0)
    tenants = by_tenant(traces, 2.0)
    assert list(tenants) == ["a", "b"]
    assert tenants["b"]["ttft_p99_ms"] == pytest.approx(200.0)


def test_poisson_arrivals_start_at_zero_and_increase() -> None:
    arrivals = poisson_arrivals(4.0, 2000, seed=0)
    assert arrivals[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(arrivals))
    assert arrivals[-1] / 1999 == pytest.approx(0.25, rel=0.1)
    assert arrivals == poisson_arrivals(4.0, 2000, seed=0)


def test_pad_left_right_aligns_prompts() -> None:
    ids, mask = _pad_left([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == torch.long


def test_write_suite_and_summary(tmp_path: Path) -> None:
    data = {
        "suite": "prefix",
        "targets": [
            Target("warm / cold", 0.1, 0.2, higher_is_better=False),
            Target("ratio", 1.5, 2.0),
        ],
        "machine": {
            "cpu_model": "cpu",
            "usable_cores": 2,
            "threads": 2,
            "cpu_flags": {"avx2": True, "avx512_bf16": False},
            "versions": {"torch": "1"},
        },
    }
    path = write_suite(tmp_path, "prefix", data, "# t")
    loaded = json.loads(path.read_text())
    assert loaded["targets"][0]["passed"] is True and loaded["targets"][1]["passed"] is False
    assert (tmp_path / "prefix.md").read_text() == "# t\n"
    text = summary_markdown({"prefix": loaded})
    assert "| prefix | warm / cold | 0.100 | ≤ 0.2 | pass | +0.100 |" in text
    assert "| prefix | ratio | 1.500 | ≥ 2 | MISS | -0.500 |" in text
    assert "flags: avx2;" in text


def test_drive_respects_arrivals_and_concurrency_cap() -> None:
    from bench.kvfence_runner import drive

    in_flight = 0
    peak = 0
    launched: list[float] = []

    async def one(i: int) -> RequestTrace:
        nonlocal in_flight, peak
        launched.append(time.perf_counter())
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return RequestTrace(str(i), 1, launched[-1])

    wall, traces = asyncio.run(drive(6, one, max_concurrency=2))
    assert peak == 2 and [t.tenant for t in traces] == [str(i) for i in range(6)]
    assert wall >= 0.06

    launched.clear()
    start = time.perf_counter()
    asyncio.run(drive(3, one, arrivals=[0.0, 0.05, 0.1]))
    offsets = [t - start for t in launched]
    assert offsets[1] >= 0.05 and offsets[2] >= 0.1
