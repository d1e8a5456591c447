"""The offline suite's greedy check: batched tokens against each system's one-request run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import greedy_check, offline
from bench.common import Throughput, Work

WORK = [Work((1, 2), 10), Work((3,), 12), Work((4, 5, 6), 10), Work((7,), 9)]


def test_sample_spreads_over_the_work_and_keeps_the_first() -> None:
    assert greedy_check.sample([Work((1,), 1)] * 64, 4) == [0, 16, 32, 48]
    assert greedy_check.sample(WORK[:2], 4) == [0, 1]
    assert greedy_check.sample([], 4) == []


def test_identical_outputs_pass() -> None:
    batched = [list(range(w.max_tokens)) for w in WORK]
    a = greedy_check.agreement("s", WORK, [0, 2], batched, [batched[0], batched[2]])
    assert (a.identical, a.prefix, a.prefix_fraction, a.first_ok) == (2, (10, 10), 1.0, True)
    t = greedy_check.target([a])
    assert t is not None and t.passed and t.value == 1.0


def test_a_late_divergence_is_reported_but_passes_and_an_early_one_fails() -> None:
    batched = [list(range(w.max_tokens)) for w in WORK]
    late = list(batched[1])
    late[9] = -1  # a near tie after the first 8 tokens
    early = list(batched[3])
    early[2] = -1  # rows mixed up, a wrong position: the output parts at once
    ok = greedy_check.agreement("late", WORK, [1], batched, [late])
    bad = greedy_check.agreement("early", WORK, [1, 3], batched, [batched[1], early])
    assert (ok.identical, ok.prefix, ok.first_ok) == (0, (9,), True)
    assert (bad.identical, bad.prefix, bad.first_ok) == (1, (12, 2), False)
    t = greedy_check.target([ok, bad])
    assert t is not None and not t.passed and t.value == 0.5 and "early" in t.name


def test_a_short_output_is_an_error_not_a_match() -> None:
    batched = [list(range(w.max_tokens)) for w in WORK]
    with pytest.raises(RuntimeError, match="request 0 gave 10 batched / 3 reference"):
        greedy_check.agreement("s", WORK, [0], batched, [[0, 1, 2]])
    with pytest.raises(ValueError, match="1 references for 2 samples"):
        greedy_check.agreement("s", WORK, [0, 1], batched, [batched[0]])


def test_offline_report_carries_the_check_as_a_target_and_a_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(offline, "results_dir", lambda quick: tmp_path)
    monkeypatch.setattr(offline, "bar_plot", lambda *a, **k: "plot.png")
    monkeypatch.setattr(offline, "machine_info", lambda threads: {})
    batched = [list(range(w.max_tokens)) for w in WORK]
    bad_ref = list(batched[0])
    bad_ref[0] = -1
    checks = [
        greedy_check.agreement(offline.ENGINE, WORK, [0, 2], batched, [batched[0], batched[2]]),
        greedy_check.agreement("llama.cpp best", WORK, [0], batched, [bad_ref]),
    ]
    runs = [Throughput(offline.ENGINE, 1.0, 1, 10, 100)]
    data = offline.report(runs, {}, True, 2, torch.bfloat16, WORK, {}, None, checks)
    target = next(t for t in data["targets"] if t.name.startswith("batched greedy"))
    assert (target.value, target.passed) == (0.0, False)
    assert [c["system"] for c in data["greedy_check"]] == [offline.ENGINE, "llama.cpp best"]
    md = (tmp_path / "offline.md").read_text()
    assert f"| {offline.ENGINE} | 2/2 | 1.000 | 10/10 10/10 | yes |" in md
    assert "| llama.cpp best | 0/1 | 0.000 | 0/10 | NO |" in md
