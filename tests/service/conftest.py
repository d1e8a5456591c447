"""Shared fixtures for the service tests: one tiny random-weight Llama per session, and one
running server per module with tenants for every quota case."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.serve.kvfence_server import ServerOptions
from tests.serverutil import ServerHandle, TenantSpec, running_server


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model(tiny_llama_dir: Path) -> Any:
    from service.model import load_model

    return load_model(tiny_llama_dir, dtype="float32", progress=False)


TENANTS = {
    "acme": TenantSpec(weight=2.0),
    "globex": TenantSpec(),
    "one_stream": TenantSpec(max_concurrent_streams=1),
    "slow_rate": TenantSpec(tokens_per_minute=60),
    "two_pages": TenantSpec(max_kv_pages=2),
    "short": TenantSpec(max_prompt_tokens=8),
    "other_model": TenantSpec(models=("some-other-model",)),
}


@pytest.fixture(scope="module")
def srv(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    log = io.StringIO()
    with running_server(
        tiny_model,
        TENANTS,
        options=ServerOptions(
            metrics_port=0, alert_request_kv_pages=3, alert_tenant_kv_pages=4, stats_interval_s=0.1
        ),
        log_stream=log,
        tenants_dir=tmp_path_factory.mktemp("tenants"),
    ) as handle:
        yield handle
