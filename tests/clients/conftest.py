from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from tests.clients.certs import Pki, make_pki
from tests.clients.fakeserver import FakeInference, serve


@pytest.fixture
def fake() -> FakeInference:
    """The default scripted servicer; tests may edit its script before the first call."""
    return FakeInference()


@pytest.fixture
def target(fake: FakeInference) -> Iterator[str]:
    with serve(fake) as address:
        yield address


@pytest.fixture
def sleeps() -> list[float]:
    """Waits the clients asked for; pass `sleep=sleeps.append` so tests never really sleep."""
    return []


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer's own KVFENCE_API_KEY / KVFENCE_TARGET must not leak into these tests.
    monkeypatch.delenv("KVFENCE_API_KEY", raising=False)
    monkeypatch.delenv("KVFENCE_TARGET", raising=False)


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    # The CLI configures structlog when nobody has; undo that so other suites see the default.
    was_configured = structlog.is_configured()
    yield
    if not was_configured:
        structlog.reset_defaults()


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]
