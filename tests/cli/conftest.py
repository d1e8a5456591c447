"""The `kvfence` command as a newcomer meets it: every test runs it as a subprocess.

`kvfence(...)` runs `python -m service.serve.commands ...` from the repository root with no KVFENCE_*
variables of the developer's own. `plain_server` is one real `kvfence serve` (tiny random
Llama, port 0) shared by the module; `fake` servers record exactly what the CLI sent.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.clients.fakeserver import FakeInference, serve
from tests.serverutil import (
    ROOT,
    ServerProcess,
    TenantSpec,
    start_server_process,
    write_tenants_file,
)

# gRPC core's own log lines, e.g. `E1201 10:00:00.000000 123 add_port.cc:83] ...`.
GRPC_CORE_LINE = re.compile(r"^[EWID]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFENCE_", "GRPC_"))}
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **(extra or {})}


def kvfence(*args: str, env: Mapping[str, str] | None = None, input: str | None = None,
            timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service.serve.commands", *args], cwd=ROOT,
                          env=clean_env(env), input=input, capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class RealServer:
    process: ServerProcess
    key: str
    tenants: Path

    @property
    def target(self) -> str:
        return self.process.target


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def plain_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[RealServer]:
    tenants = tmp_path_factory.mktemp("plain") / "tenants.toml"
    keys = write_tenants_file(tenants, {"acme": TenantSpec()})
    process = start_server_process(tiny_llama_dir, tenants, env=clean_env())
    try:
        yield RealServer(process, keys["acme"], tenants)
    finally:
        process.stop()


@pytest.fixture
def fake() -> FakeInference:
    return FakeInference()


@pytest.fixture
def fake_target(fake: FakeInference) -> Iterator[str]:
    with serve(fake) as target:
        yield target
