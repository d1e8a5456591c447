"""A real ``redis-server`` per test on a free loopback port (the tests skip without one).

``make test`` installs redis-server (apt-get, as root) so CI runs these; elsewhere they skip
with the reason below.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

REDIS = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class RedisProcess:
    """One redis-server on ``port``; ``stop``/``start`` simulate an outage and recovery."""

    port: int
    workdir: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS is not None
        self.proc = subprocess.Popen(
            [
                REDIS,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.workdir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; make test does)")
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisProcess(free_port(), workdir)
        server.start()
        try:
            yield server
        finally:
            server.stop()
