"""The single-stream suite's arithmetic: per-run samples, median [min–max], worst-run targets."""

from __future__ import annotations

import pytest

from bench.single_stream import (
    GRPC,
    GRPC_2,
    INPROC,
    LLAMA,
    LLAMA_2,
    Sample,
    fmt,
    median_sample,
    ratios,
    run_order,
    sample,
    spread,
)
from bench.summary import summary_markdown


def test_sample_takes_ttft_to_first_token_and_rate_over_the_rest() -> None:
    s = sample(10.0, [10.5, 10.6, 10.7, 10.9])
    assert s.ttft_s == pytest.approx(0.5)
    assert s.decode_tok_s == pytest.approx(3 / 0.4)
    with pytest.raises(RuntimeError, match="only 1 tokens"):
        sample(0.0, [1.0])


def test_run_order_pairs_the_targets_systems_back_to_back_and_alternates() -> None:
    names = ["bf16", INPROC, GRPC, "same", LLAMA, "hf"]
    first, second = run_order(names, 1), run_order(names, 2)
    assert first == [INPROC, GRPC, LLAMA, "bf16", "same", "hf"]
    assert second == [LLAMA, GRPC, INPROC, "bf16", "same", "hf"]
    assert run_order(names, 3) == first
    assert sorted(first) == sorted(names)


def test_the_second_model_s_pair_runs_back_to_back_and_alternates_too() -> None:
    names = [INPROC, GRPC, LLAMA, "hf", GRPC_2, LLAMA_2]
    assert run_order(names, 1) == [INPROC, GRPC, LLAMA, GRPC_2, LLAMA_2, "hf"]
    assert run_order(names, 2) == [LLAMA, GRPC, INPROC, LLAMA_2, GRPC_2, "hf"]


def test_a_ratio_is_taken_run_by_run() -> None:
    grpc = [Sample(0.1, 90.0), Sample(0.1, 120.0)]
    llama = [Sample(0.1, 100.0), Sample(0.1, 100.0)]
    assert ratios(grpc, llama) == [pytest.approx(0.9), pytest.approx(1.2)]
    with pytest.raises(ValueError):
        ratios(grpc, llama[:1])


def test_a_run_is_the_median_of_its_repetitions() -> None:
    reps = [Sample(0.1, 90.0), Sample(0.3, 120.0), Sample(0.2, 100.0), Sample(0.9, 10.0)]
    assert median_sample(reps) == Sample(pytest.approx(0.25), pytest.approx(95.0))
    with pytest.raises(RuntimeError, match="no repetitions"):
        median_sample([])


def test_spread_is_median_min_max() -> None:
    s = spread([3.0, 1.0, 10.0])
    assert s == {"median": 3.0, "min": 1.0, "max": 10.0}
    assert fmt(s) == "3 [1–10]"


def test_summary_shows_single_stream_spread() -> None:
    machine = {
        "cpu_model": "cpu",
        "usable_cores": 2,
        "threads": 2,
        "cpu_flags": {"avx2": True},
        "versions": {"torch": "1"},
    }
    single = {
        "suite": "single_stream",
        "machine": machine,
        "targets": [],
        "systems": {
            "llama.cpp n_seq=1": {
                "ttft_ms": {"median": 20.0, "min": 18.0, "max": 25.0},
                "decode_tok_s": {"median": 90.0, "min": 80.0, "max": 95.0},
            }
        },
    }
    text = summary_markdown({"single_stream": single})
    assert "| llama.cpp n_seq=1 | 20 [18–25] | 90 [80–95] |" in text
