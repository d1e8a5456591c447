"""The mutation suite stays aimed: every mutant's anchors occur exactly once in today's tree and
every mutant names the tests that guard it. A refactor that moves a guarded line fails here, in
`make test`, instead of leaving `make mutants` to report a stale mutant later."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.mutants.catalog import ALL
from tools.mutants.mutant import Mutant, mutated_sources

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("m", ALL, ids=[m.name for m in ALL])
def test_mutant_applies_to_the_current_tree(m: Mutant) -> None:
    sources = mutated_sources(ROOT, m)
    assert sources, m.name
    for path, text in sources.items():
        assert text != path.read_text(encoding="utf-8"), f"{m.name} changes nothing in {path}"
    assert m.tests, f"{m.name} names no guarding test"
    for target in m.tests:
        assert (ROOT / target.split("::")[0]).exists(), f"{m.name}: {target} does not exist"


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in ALL]
    assert len(names) == len(set(names))
