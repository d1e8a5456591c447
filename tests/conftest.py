"""Session-wide fixtures shared by every test package.

Expensive things (the default model, the transformers oracle) load once per session.
Imports of torch/transformers stay inside the fixtures so suites that need neither stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from service.model import LoadedModel


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``cuda`` on machines without a CUDA GPU."""
    if not any("cuda" in item.keywords for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default GGUF, pulled (and sha256-verified) if absent."""
    from service.model.default import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def served_model(default_model_path: Path) -> LoadedModel:
    """The default model loaded as ``kvfence serve`` loads it (every flag at its default:
    batch-invariant on CPU)."""
    from service.model import load_model

    return load_model(default_model_path, progress=False)


@pytest.fixture(scope="session")
def invariant_model(default_model_path: Path, served_model: LoadedModel) -> LoadedModel:
    """The default model as ``kvfence serve --batch-invariant on`` loads it: the served model
    itself where the default (auto) made it invariant, else a load with ``on``, which
    refuses in one line naming what is missing."""
    from service.model import load_model

    if served_model.batch_invariant:
        return served_model
    return load_model(default_model_path, progress=False, batch_invariant="on")


@pytest.fixture(scope="session")
def default_model(default_model_path: Path) -> LoadedModel:
    """The default model loaded by our runtime, dense fp32 on CPU: the oracle's weights and
    math, so parity holds to 1e-3. (In float32 ``--weights auto`` serves decode-sized batches
    through the 4-bit GEMV, within its own bound: tests/model/test_native_gemv.py.)"""
    from service.model import load_model

    return load_model(default_model_path, dtype="float32", weights="bf16", progress=False)


@pytest.fixture(scope="session")
def hf_oracle(default_model_path: Path) -> tuple[Any, Any]:
    """(transformers model, transformers tokenizer) for the default GGUF, fp32 on CPU."""
    from tools.parity.checks import load_hf_oracle

    return load_hf_oracle(default_model_path)


#: A test that takes longer than this (setup + call + teardown, on 2 cores) belongs to the
#: slow tier: ``make test`` runs ``-m "not slow"``, ``make test-slow`` (and CI) ``-m slow``.
SLOW_SECONDS = 20.0
_unmarked_slow: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" in report.keywords:
        return
    _unmarked_slow[report.nodeid] = _unmarked_slow.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the tests outside the slow tier that took longer than ``SLOW_SECONDS``."""
    over = sorted(((s, t) for t, s in _unmarked_slow.items() if s > SLOW_SECONDS), reverse=True)
    if over:
        terminalreporter.write_sep("-", f"over {SLOW_SECONDS:.0f} s without @pytest.mark.slow")
        for seconds, test in over:
            terminalreporter.write_line(f"{seconds:6.1f}s {test}")
