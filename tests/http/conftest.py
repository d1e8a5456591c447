"""One tiny-model server per module with the HTTP front on, and ``openai`` SDK clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.serve.kvfence_server import ServerOptions
from tests.serverutil import ServerHandle, TenantSpec, running_server

TENANTS = {
    "acme": TenantSpec(),
    "globex": TenantSpec(),
    "slow_rate": TenantSpec(tokens_per_minute=60),
    "other_model": TenantSpec(models=("some-other-model",)),
}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-http"))


@pytest.fixture(scope="session")
def tiny_model(tiny_llama_dir: Path) -> Any:
    from service.model import load_model

    return load_model(tiny_llama_dir, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def srv(tiny_model: Any) -> Iterator[ServerHandle]:
    with running_server(tiny_model, TENANTS, options=ServerOptions(http_port=0)) as handle:
        yield handle


def base_url(srv: ServerHandle) -> str:
    assert srv.server.http is not None
    return f"http://127.0.0.1:{srv.server.http.port}/v1"


def client(srv: ServerHandle, tenant: str | None = "acme", key: str | None = None) -> Any:
    import openai

    api_key = key if key is not None else srv.keys[tenant] if tenant else "unused"
    return openai.OpenAI(base_url=base_url(srv), api_key=api_key, max_retries=0, timeout=60)
