"""The ``make verify`` report counts only checks: figures are shown apart and never pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.verify.plugin import Outcome, VerifyReport, render_markdown, summary
from tests.verify.recorder import Figure, Recorder


def _report(tmp_path: Path, figures: list[Figure], outcomes: dict[str, str]) -> VerifyReport:
    report = VerifyReport(results_dir=tmp_path)
    report.figures = figures
    report.outcomes = {t: Outcome(outcome=o) for t, o in outcomes.items()}
    return report


def test_info_is_a_figure_not_a_passing_check() -> None:
    sink: list[Figure] = []
    record = Recorder("soak::t", sink)
    record.info("tokens per second", 2423.0)
    assert record("errors", 0, "== 0", True)
    assert [f.passed for f in sink] == [None, True]
    assert [f.is_check for f in sink] == [False, True]


def test_only_checks_count_and_a_run_of_figures_alone_fails(tmp_path: Path) -> None:
    figure = Figure("soak::t", "tokens per second", 2423.0, "", None)
    check = Figure("soak::t", "errors", 0, "== 0", True)
    failing = Figure("soak::t", "leaks", 3, "== 0", False)
    assert not _report(tmp_path, [figure], {"soak::t": "passed"}).passed()
    ok = _report(tmp_path, [figure, check], {"soak::t": "passed"})
    assert ok.passed() and summary(ok.rows()) == "1 checks passed, 1 figures recorded"
    bad = _report(tmp_path, [figure, check, failing], {"soak::t": "failed"})
    assert not bad.passed()
    assert summary(bad.rows()) == "1 checks passed (1 FAILED of 2), 1 figures recorded"


def test_a_failed_test_without_a_failing_check_gets_one(tmp_path: Path) -> None:
    figure = Figure("soak::t", "tokens per second", 2423.0, "", None)
    report = _report(tmp_path, [figure], {"soak::t": "failed"})
    rows = report.rows()
    assert [(r["name"], r["passed"]) for r in rows] == [
        ("tokens per second", None), ("t outcome", False)]
    assert not report.passed()


@pytest.mark.parametrize("passed", [True, False])
def test_markdown_puts_figures_in_their_own_table(tmp_path: Path, passed: bool) -> None:
    rows: list[dict[str, Any]] = [
        Figure("soak::t", "errors", 0, "== 0", passed).as_dict(),
        Figure("soak::t", "tokens per second", 2423.0, "", None).as_dict(),
    ]
    doc = {"mode": "short", "seconds": 1.0, "machine": {"platform": "x"}, "passed": passed}
    text = render_markdown(rows, doc)
    checks, figures = text.split("Figures (")
    assert "| soak | errors | 0 | == 0 | " + ("pass" if passed else "**FAIL**") + " |" in checks
    assert "tokens per second" not in checks
    assert "| soak | tokens per second | 2423 |" in figures
