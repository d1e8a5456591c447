"""A mutant: one stated guarantee switched off by literal edits, and the tests that guard it.

An edit replaces one exact snippet of one file. The snippet must occur exactly once, so a
mutant whose anchor has moved or multiplied is reported as stale instead of silently
mutating nothing (or the wrong place).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Edit:
    path: str  # relative to the repository root
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class Mutant:
    """``tests`` are pytest arguments (files or node ids): the small selection that must fail."""

    name: str
    guarantee: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]
    # Hardware the mutated code runs on (``HARDWARE``); where this machine's kernel lacks it
    # the mutant is not run: its tests would pass whatever the edit.
    needs: str = ""


# What a mutant may need, and the Python expression (run in the scratch copy) that is true
# where this machine's kernels have it: the kernel's own detection, not a list of CPUs.
HARDWARE = {
    "amx": "__import__('service.model.native.kernels', fromlist=['kernel']).kernel().amx",
}


def edit(path: str, old: str, new: str) -> Edit:
    return Edit(path, old, new)


def mutant(
    name: str, guarantee: str, *edits: Edit, tests: tuple[str, ...] | str, needs: str = ""
) -> Mutant:
    """Shorthand for the catalogue: ``mutant(name, guarantee, edit(...), ..., tests=...)``."""
    if needs and needs not in HARDWARE:
        raise ValueError(f"mutant {name}: needs {needs!r} is not one of {sorted(HARDWARE)}")
    return Mutant(name, guarantee, edits, (tests,) if isinstance(tests, str) else tests, needs)


class StaleAnchor(Exception):
    """An edit's ``old`` text is missing or occurs more than once."""


def mutated_sources(root: Path, m: Mutant) -> dict[Path, str]:
    """{file: mutated text} for every file ``m`` edits (several edits may hit one file)."""
    out: dict[Path, str] = {}
    for e in m.edits:
        path = root / e.path
        text = out.get(path)
        if text is None:
            if not path.is_file():
                raise StaleAnchor(f"{m.name}: {e.path} does not exist")
            text = path.read_text(encoding="utf-8")
        count = text.count(e.old)
        if count != 1:
            raise StaleAnchor(f"{m.name}: {e.path}: anchor found {count} times: {e.old[:60]!r}")
        out[path] = text.replace(e.old, e.new)
    return out
