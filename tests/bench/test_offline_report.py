"""Offline report: repeats grouped per system, ratio targets judged on the worst kvfence run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bench import offline
from bench.common import Throughput, Work
from bench.offline_llama import BatchedRow


@pytest.fixture
def quiet_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """report() writes into tmp_path, draws no plot and probes no machine."""
    monkeypatch.setattr(offline, "results_dir", lambda quick: tmp_path)
    monkeypatch.setattr(offline, "bar_plot", lambda *a, **k: "plot.png")
    monkeypatch.setattr(offline, "machine_info", lambda threads: {})


def _run(system: str, wall_s: float) -> Throughput:
    return Throughput(system, wall_s, 1, 10, 100)


def test_report_uses_worst_kvfence_run_against_best_peer_run(tmp_path: Path, quiet_report: None) -> None:
    runs = [
        *(_run("kvfence engine", w) for w in (0.4, 0.5, 0.25)),  # 250, 200, 400 tok/s
        *(_run("kvfence gRPC", w) for w in (0.5, 0.5, 0.5)),
        *(_run("kvfence HTTP", w) for w in (1.0, 1.0, 0.8)),  # 100, 100, 125 tok/s
        *(_run("llama-server np=8 ub=512", w) for w in (1.0, 0.8, 1.25)),  # best 125 tok/s
        *(_run("transformers generate b=32", w) for w in (2.0, 2.0, 2.0)),
    ]
    data = offline.report(runs, {}, True, 2, torch.bfloat16, [Work((1,), 100)], {})
    assert data["systems"]["kvfence engine"]["output_tok_s"] == {
        "median": 250.0,
        "min": 200.0,
        "max": 400.0,
    }
    targets = {t.name.split(" (")[0]: t.value for t in data["targets"]}
    assert targets["offline output tok/s vs llama-server best"] == pytest.approx(200 / 125)
    same_client = "kvfence HTTP / llama-server np=8 ub=512 output tok/s, same client"
    assert targets[same_client] == pytest.approx(100 / 125)
    assert targets["offline output tok/s vs transformers best"] == pytest.approx(200 / 50)
    assert targets["gRPC / in-process output tok/s"] == pytest.approx(200 / 250)
    assert "250 [200–400]" in (tmp_path / "offline.md").read_text()


def test_report_shows_the_llama_sweep_with_the_fastest_configuration_chosen(tmp_path: Path, quiet_report: None) -> None:
    sweep = {
        "llama-server np=8 ub=512": 90.0,
        "llama-server np=32 ub=512": 120.0,
        "llama-server np=16 ub=512": 110.0,
    }
    runs = [_run("kvfence engine", 0.5), _run("llama-server np=32 ub=512", 1.0)]
    data = offline.report(runs, {}, True, 2, torch.bfloat16, [Work((1,), 100)] * 8, {}, sweep)
    assert data["llama_server_sweep"] == sweep
    md = (tmp_path / "offline.md").read_text()
    lines = [line for line in md.splitlines()
             if line.startswith("| llama-server np=") and line.count("|") == 4]
    assert lines == [
        "| llama-server np=32 ub=512 | 120 | best |",
        "| llama-server np=16 ub=512 | 110 |  |",
        "| llama-server np=8 ub=512 | 90 |  |",
    ]
    assert "first 2 requests" in md


def test_report_sets_kvfence_against_each_batched_bench_point(tmp_path: Path, quiet_report: None) -> None:
    batched = [BatchedRow(1, 128, 64, 0.1, 0.4, 160.0), BatchedRow(4, 128, 64, 0.4, 0.6, 426.0)]
    runs = [_run("kvfence engine", w) for w in (0.25, 0.5)]  # worst 200 tok/s
    data = offline.report(runs, {}, True, 2, torch.bfloat16, [Work((1,), 100)], {},
                          batched=batched)
    assert [b["output_tok_s"] for b in data["llama_batched_bench"]] == [128.0, 256.0]
    md = (tmp_path / "offline.md").read_text()
    assert "| 1 | 160 | 128 | 1.56 |" in md
    assert "| 4 | 426 | 256 | 0.78 |" in md


def test_served_budget_rows_are_judged_against_the_untimed_engine_and_per_round(tmp_path: Path, quiet_report: None) -> None:
    runs = [
        *(_run(offline.ENGINE, w) for w in (1.0, 0.5, 0.4)),  # 100, 200, 250 tok/s
        *(_run(offline.FAIR, w) for w in (0.8, 0.4, 0.5)),  # 125, 250, 200
        *(_run(offline.FAIR2, w) for w in (0.8, 100 / 150, 0.5)),  # 125, 150, 200
    ]
    data = offline.report(runs, {}, True, 2, torch.bfloat16, [Work((1,), 100)], {})
    # The served rows are systems of their own, not runs of the untimed engine.
    assert data["systems"][offline.ENGINE]["output_tok_s"]["min"] == 100.0
    targets = {t.name: t.value for t in data["targets"]}
    # Each round's timed run over the same round's untimed run: 1.25, 1.25, 0.8 (not the
    # worst timed run over the untimed median, 125 / 200).
    one = "served step budget (one tenant) / untimed engine output tok/s (worst round)"
    assert targets[one] == pytest.approx(200 / 250)
    # Each round's two-tenant run over the same round's one-tenant run: 1.0, 0.6, 1.0 (not
    # the worst two-tenant run over the worst one-tenant run, 1.0).
    two = "served step budget, two tenants / one tenant output tok/s (worst round)"
    assert targets[two] == pytest.approx(0.6)


def test_invariance_cost_is_the_default_engines_median_against_the_fast_paths(tmp_path: Path, quiet_report: None) -> None:
    runs = [
        *(_run(offline.ENGINE, w) for w in (0.5, 0.4, 1.0)),  # 200, 250, 100 tok/s
        *(_run(offline.VARIANT, w) for w in (0.4, 0.25, 0.5)),  # 250, 400, 200
    ]
    data = offline.report(runs, {}, True, 2, torch.bfloat16, [Work((1,), 100)], {})
    target = next(t for t in data["targets"] if t.name.startswith("batch invariance"))
    assert target.value == pytest.approx(200 / 250) and target.threshold == 0.90
    # without the batch-variant row (auto fell back to it) no cost is claimed
    data = offline.report(runs[:3], {}, True, 2, torch.bfloat16, [Work((1,), 100)], {})
    assert not any(t.name.startswith("batch invariance") for t in data["targets"])


def test_rounds_run_neighbours_in_both_orders(quiet_report: None) -> None:
    order: list[str] = []

    def system(name: str) -> tuple[str, Callable[[], Throughput]]:
        def run() -> Throughput:
            order.append(name)
            return _run(name, 1.0)

        return name, run

    runs: list[Throughput] = []
    offline.attempt_rounds([system("a"), system("b"), system("c")], runs, {})
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"][: 3 * offline.REPEATS]
    assert [r.system for r in runs] == order
