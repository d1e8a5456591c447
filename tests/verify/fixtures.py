"""Session fixtures for the verify suite; ``tests/isolation`` and ``tests/reliability``
import them into their conftests.

Model directories live under the session's base temp dir, so both packages share one copy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.verify.recorder import Recorder, make_recorder


def _shared_dir(factory: pytest.TempPathFactory, name: str, write: Callable[[Path], Path]) -> Path:
    directory = factory.getbasetemp() / "kvfence-verify-models" / name
    done = directory / ".written"
    if not done.exists():
        write(directory)
        done.touch()
    return directory


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-layer random Llama of ``tests/fixtures/tiny_models.py`` (context 1,024)."""
    from tests.fixtures.tiny_models import write_tiny_llama

    return _shared_dir(tmp_path_factory, "tiny", write_tiny_llama)


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> Any:
    from service.model import load_model

    return load_model(tiny_dir, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def medium_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4-layer random Llama of ``tests/verify/models.py`` (context 2,048)."""
    from tests.verify.models import write_medium_llama

    return _shared_dir(tmp_path_factory, "medium", write_medium_llama)


@pytest.fixture(scope="session")
def medium(medium_dir: Path) -> Any:
    from service.model import load_model

    return load_model(medium_dir, dtype="float32", progress=False)


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Recorder:
    """``assert record(name, value, expected, passed)``; see ``tests/verify/recorder.py``."""
    return make_recorder(request)
