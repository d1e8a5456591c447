"""Figures a test measured, each with the value it was held to.

A test calls ``assert record(name, value, expected, passed)``: a *check*. It goes to the report
whether or not it passes, and the test still fails on it. ``expected`` is a short human rule
(``"== 0"``, ``"< 0.5 s"``). ``record.info(name, value)`` records a *figure*: a measurement
with no bound, shown apart from the checks and never counted as a pass (``passed`` is None).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import pytest

FIGURES_KEY = pytest.StashKey[list["Figure"]]()


@dataclass(frozen=True, slots=True)
class Figure:
    test: str  # the test's node id, without the file path
    name: str
    value: Any
    expected: str
    passed: bool | None  # None: a figure (no bound), not a check

    @property
    def is_check(self) -> bool:
        return self.passed is not None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Recorder:
    """Bound to one test; appends to the session's figure list."""

    def __init__(self, test: str, sink: list[Figure]) -> None:
        self._test = test
        self._sink = sink

    def __call__(self, name: str, value: Any, expected: str, passed: bool) -> bool:
        self._sink.append(Figure(self._test, name, _plain(value), expected, bool(passed)))
        return bool(passed)

    def info(self, name: str, value: Any) -> None:
        self._sink.append(Figure(self._test, name, _plain(value), "", None))


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, bool | int | str) or value is None:
        return value
    return str(value)


def session_figures(config: pytest.Config) -> list[Figure]:
    return config.stash.setdefault(FIGURES_KEY, [])


def make_recorder(request: pytest.FixtureRequest) -> Recorder:
    node = request.node
    name = node.nodeid.split("::", 1)[-1]
    area = node.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return Recorder(f"{area}::{name}", session_figures(request.config))
