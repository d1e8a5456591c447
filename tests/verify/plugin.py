"""The ``make verify`` report: collects every recorded check and figure and every test outcome,
prints the checks and the figures as two tables, and writes ``verify.json`` and the page
``verify.md`` (``docs/`` for a full run).

Only checks (a value held to a bound) count: figures are measurements shown for context and
never counted as passes. A test that failed or errored without a failing check of its own
still gets a failing check row, so the report can never show all-pass for a run that failed.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.verify.recorder import Figure, session_figures
from tests.verify.scale import mode


@dataclass(slots=True)
class Outcome:
    outcome: str = "passed"  # passed | failed | skipped
    seconds: float = 0.0
    message: str = ""


@dataclass(slots=True, eq=False)  # plugins must be hashable
class VerifyReport:
    """A pytest plugin object: pass it in ``pytest.main(..., plugins=[report])``."""

    results_dir: Path
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    figures: list[Figure] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = _short(report.nodeid)
        state = self.outcomes.setdefault(test, Outcome())
        state.seconds += report.duration
        if report.failed:
            state.outcome = "failed"
            state.message = _first_line(report.longreprtext)
        elif report.skipped and state.outcome == "passed":
            state.outcome = "skipped"
            state.message = _first_line(report.longreprtext)

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        self.figures = list(session_figures(config))
        rows = self.rows()
        write = terminalreporter.write_line
        checks, figures = split(rows)
        write("")
        write("Checks")
        for line in render_table(checks, with_result=True):
            write(line)
        write("")
        write("Figures (measured, no bound; not counted as checks)")
        for line in render_table(figures, with_result=False):
            write(line)
        write("")
        write(f"kvfence verify ({mode()}): {'PASS' if self.passed() else 'FAIL'}; "
              f"{summary(rows)}; wrote {self.results_dir / 'verify.json'} and verify.md")
        self.write(rows)

    def rows(self) -> list[dict[str, Any]]:
        rows = [f.as_dict() for f in self.figures]
        failing = {f.test for f in self.figures if f.passed is False}
        for test, state in self.outcomes.items():
            if state.outcome == "failed" and test not in failing:
                rows.append(
                    {
                        "test": test,
                        "name": f"{test.split('::')[-1]} outcome",
                        "value": "failed",
                        "expected": "passed",
                        "passed": False,
                        "note": state.message,
                    }
                )
            elif state.outcome == "skipped":
                rows.append(
                    {
                        "test": test,
                        "name": f"{test.split('::')[-1]} outcome",
                        "value": "skipped",
                        "expected": "run",
                        "passed": False,
                        "note": state.message,
                    }
                )
        return rows

    def passed(self) -> bool:
        checks, _ = split(self.rows())
        return bool(checks) and all(r["passed"] for r in checks)

    def write(self, rows: list[dict[str, Any]]) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        doc = {
            "mode": mode(),
            "passed": self.passed(),
            "seconds": round(time.monotonic() - self.started, 1),
            "machine": {"python": platform.python_version(), "platform": platform.platform(),
                        "kernel_build": os.environ.get("KVFENCE_KERNEL_ISA") or "native"},
            "tests": {
                t: {"outcome": o.outcome, "seconds": round(o.seconds, 2)}
                for t, o in self.outcomes.items()
            },
            "summary": summary(rows),
            "checks": split(rows)[0],
            "figures": split(rows)[1],
        }
        (self.results_dir / "verify.json").write_text(json.dumps(doc, indent=2) + "\n")
        (self.results_dir / "verify.md").write_text(render_page(rows, doc, self.results_dir))


def _short(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    return f"{path.rsplit('/', 1)[-1].removesuffix('.py')}::{name}"


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("E ")]
    return (lines[0] if lines else text.strip().splitlines()[-1] if text.strip() else "")[:160]


def _area(test: str) -> str:
    """``test_soak::test_x`` -> ``soak``: the table groups figures by test file."""
    return test.split("::", 1)[0].removeprefix("test_")


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def split(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(checks, figures)."""
    return ([r for r in rows if r["passed"] is not None], [r for r in rows if r["passed"] is None])


def summary(rows: list[dict[str, Any]]) -> str:
    checks, figures = split(rows)
    good = sum(1 for r in checks if r["passed"])
    failed = f" ({len(checks) - good} FAILED of {len(checks)})" if good < len(checks) else ""
    return f"{good} checks passed{failed}, {len(figures)} figures recorded"


def render_table(rows: list[dict[str, Any]], *, with_result: bool) -> list[str]:
    header: tuple[str, ...] = ("area", "check" if with_result else "figure", "value")
    if with_result:
        header += ("expected", "result")
    body = [
        (_area(r["test"]), r["name"], _value(r["value"]),
         *((r["expected"], "pass" if r["passed"] else "FAIL") if with_result else ()))
        for r in rows
    ]
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)
    ]
    widths = [min(w, 60) for w in widths]

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(c[:w].ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [fmt(header), fmt(tuple("-" * w for w in widths)), *(fmt(b) for b in body)]


def render_markdown(rows: list[dict[str, Any]], doc: dict[str, Any]) -> str:
    checks, figures = split(rows)
    lines = [
        f"Isolation and reliability report (`make verify`, {doc['mode']} sizes, "
        f"{doc['seconds']:.0f} s on {doc['machine']['platform']}, the "
        f"{doc['machine'].get('kernel_build', 'native')} kernel build): "
        f"**{'all checks pass' if doc['passed'] else 'FAILURES'}**; {summary(rows)}.",
        "",
        "Checks (each value held to a bound):",
        "",
        "| area | check | value | expected | result |",
        "|---|---|---|---|---|",
    ]
    for r in checks:
        cells = (_area(r["test"]), r["name"], _value(r["value"]), r["expected"],
                 "pass" if r["passed"] else "**FAIL**")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "Figures (measured for context, no bound, not counted):", "",
              "| area | figure | value |", "|---|---|---|"]
    for r in figures:
        cells = (_area(r["test"]), r["name"], _value(r["value"]))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


PAGE_HEAD = """# Isolation and reliability report

Generated by `make verify` (`python -m tests.verify_report`), which runs `tests/isolation` and
`tests/reliability` at full size over gRPC against a real server; do not edit by hand.
`make test` runs the same code at short sizes. The raw figures are in `verify.json` beside
this page.

**Checks** hold a value to a bound and are the only rows that count: the run passes when
every check passes, and a failed test without a failing check of its own gets a failing check
row. **Figures** are measurements shown for context, with no bound; they are never counted as
passes.

Three checks are judged in ways worth stating:
- *Pool at baseline* counts every page by state: free, referenced by a sequence, or an entry
  of a tenant's prefix index. A page in none of them (an orphan that would never be reused)
  fails it, and so does an open sequence in the cache.
- *Cache timing* is a two-sided equivalence test (TOST at 5% per side, paired by trial on log
  TTFT, the distribution-free signed-rank interval): the confidence interval of tenant B's
  TTFT ratio on A's cached prompt against a novel one must lie inside [0.8, 1.25]. The
  interval is judged at a few looks (Bonferroni over the looks) and the run stops at the first
  look that decides. A real hit cuts ~95% of the prefill; the last check of the row requires
  A's own warm/cold interval to lie below 0.8, so the test shows it can see one.
- *Cancellation storm*: a cancel that loses the race to the stream's end (the RPC ends OK) is
  read to its end and must be complete (one Finished, every token).

Every check was seen failing under a switch-off: [verify-checks.md](verify-checks.md) lists
each with the mutant or probe that made it fail, and [mutants.md](mutants.md) (`make mutants`)
lists the guarantees switched off in a scratch copy and the test that caught each.

"""


DOCS = Path(__file__).resolve().parents[2] / "docs"


def render_page(rows: list[dict[str, Any]], doc: dict[str, Any], where: Path = DOCS) -> str:
    """``verify.md``: what the report means, then the run's two tables; the links to the
    pages beside it in ``docs/`` hold from the folder ``where`` it is written."""
    up = Path(os.path.relpath(DOCS, where.resolve()))
    head = PAGE_HEAD
    if up != Path("."):
        for page in ("verify-checks.md", "mutants.md"):
            head = head.replace(f"]({page})", f"]({(up / page).as_posix()})")
    return head + render_markdown(rows, doc) + "\n"


def page_from_json(path: Path) -> str:
    """Re-render ``verify.md`` from a run's ``verify.json`` (same tables, no rerun)."""
    doc = json.loads(path.read_text())
    return render_page([*doc["checks"], *doc["figures"]], doc, path.parent)
