"""The verify probes stay aimed: each applies to today's tree, names a check that a verify test
records, and is judged seen only when its own check is the first to fail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tools.mutants.mutant import mutated_sources
from tools.verify_probes import PROBES, Probe, judge, probe_mutant

ROOT = Path(__file__).resolve().parents[1]
SUITES = ("tests/isolation", "tests/reliability")


@pytest.mark.parametrize("p", PROBES, ids=[p.check for p in PROBES])
def test_probe_applies_and_names_a_recording_test(p: Probe) -> None:
    sources = mutated_sources(ROOT, probe_mutant(p))
    assert sources
    for path, text in sources.items():
        assert text != path.read_text(encoding="utf-8"), f"{p.check} changes nothing in {path}"
    stem = p.check.split("::")[0]
    files = [f for s in SUITES for f in (ROOT / s).glob(f"{stem}.py")]
    assert len(files) == 1, f"no verify test file {stem}.py"
    assert f"def {p.k}" in files[0].read_text(encoding="utf-8"), f"-k {p.k}: no such test"


def test_probes_name_each_check_once() -> None:
    checks = [p.check for p in PROBES]
    assert len(checks) == len(set(checks))


def _doc(*checks: tuple[str, str, bool]) -> dict[str, Any]:
    return {"seconds": 3.0, "checks": [
        {"test": f"{t}::test_x", "name": n, "value": 0, "expected": "== 1", "passed": ok}
        for t, n, ok in checks
    ]}


def test_seen_only_when_the_first_failing_check_is_the_probes_own() -> None:
    p = next(p for p in PROBES if p.check == "test_ttl::pages purged")
    assert judge(p, _doc(("test_ttl", "pages purged", False))).result == "seen"
    earlier = judge(p, _doc(("test_ttl", "cached tokens with TTL 0", False),
                            ("test_ttl", "pages purged", False)))
    assert earlier.result == "OTHER" and "cached tokens with TTL 0" in earlier.value
    assert judge(p, _doc(("test_ttl", "pages purged", True))).result == "PASSED"
