"""TLS made easy: `kvfence certs dev` end to end, and handshake failures in one line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.conftest import GRPC_CORE_LINE, RealServer, kvfence
from tests.serverutil import start_server_process


@pytest.fixture(scope="module")
def mtls_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[RealServer, Path]]:
    """The README walk-through: tenants add, certs dev (mapping the tenant), serve with mTLS."""
    work = tmp_path_factory.mktemp("walkthrough")
    tenants = work / "tenants.toml"
    added = kvfence("tenants", "add", "dev", "--file", str(tenants))
    assert added.returncode == 0, added.stderr
    key = added.stdout.split()[-1]
    made = kvfence("certs", "dev", "--dir", str(work / "certs"), "--tenant", "dev",
                   "--tenants", str(tenants))
    assert made.returncode == 0, made.stderr
    certs = work / "certs"
    process = start_server_process(
        tiny_llama_dir, tenants, ["--tls-cert", str(certs / "server.pem"),
                                  "--tls-key", str(certs / "server.key"),
                                  "--tls-client-ca", str(certs / "ca.pem")])
    try:
        yield RealServer(process, key, tenants), certs
    finally:
        process.stop()


def test_certs_dev_files_and_tenant_mapping(mtls_server: tuple[RealServer, Path]) -> None:
    server, certs = mtls_server
    assert sorted(p.name for p in certs.iterdir()) == [
        "ca.key", "ca.pem", "dev.key", "dev.pem", "server.key", "server.pem"]
    assert {oct(p.stat().st_mode & 0o777) for p in certs.glob("*.key")} == {"0o600"}
    assert 'mtls_identities = ["uri:spiffe://kvfence/tenant/dev"]' in server.tenants.read_text()


def test_client_certificate_alone_authenticates_as_the_tenant(
        mtls_server: tuple[RealServer, Path]) -> None:
    server, certs = mtls_server
    run = kvfence("usage", "--target", f"localhost:{server.process.port}",
                  "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "dev.pem"),
                  "--tls-key", str(certs / "dev.key"))
    assert run.returncode == 0, run.stderr
    assert "page_size: 16" in run.stdout


def _one_line(run_stderr: str) -> str:
    assert not GRPC_CORE_LINE.search(run_stderr), run_stderr
    [line] = run_stderr.splitlines()
    return line


def test_plaintext_client_is_told_the_server_requires_tls(
        mtls_server: tuple[RealServer, Path]) -> None:
    server, _ = mtls_server
    run = kvfence("usage", "--target", server.target, "--api-key", server.key, "--timeout", "10")
    assert run.returncode == 24
    assert _one_line(run.stderr).startswith(
        "kvfence: error: UNAVAILABLE: the server requires TLS: pass --tls-ca")


def test_missing_client_certificate_is_named(mtls_server: tuple[RealServer, Path]) -> None:
    server, certs = mtls_server
    run = kvfence("usage", "--target", server.target, "--api-key", server.key,
                  "--tls-ca", str(certs / "ca.pem"), "--timeout", "10")
    assert run.returncode == 24
    assert _one_line(run.stderr).startswith(
        "kvfence: error: UNAVAILABLE: client certificate required")


def test_unknown_ca_is_named(mtls_server: tuple[RealServer, Path], tmp_path: Path) -> None:
    server, certs = mtls_server
    other = kvfence("certs", "dev", "--dir", str(tmp_path), "--tenant", "dev")
    assert other.returncode == 0, other.stderr
    run = kvfence("usage", "--target", server.target, "--tls-ca", str(tmp_path / "ca.pem"),
                  "--tls-cert", str(certs / "dev.pem"), "--tls-key", str(certs / "dev.key"),
                  "--timeout", "10")
    assert run.returncode == 24
    assert _one_line(run.stderr).startswith(
        f"kvfence: error: UNAVAILABLE: unknown CA: the server's certificate is not signed by "
        f"--tls-ca {tmp_path / 'ca.pem'}")


def test_client_certificate_from_another_ca_is_named(
        mtls_server: tuple[RealServer, Path], tmp_path: Path) -> None:
    server, certs = mtls_server
    assert kvfence("certs", "dev", "--dir", str(tmp_path), "--tenant", "dev").returncode == 0
    run = kvfence("usage", "--target", server.target, "--tls-ca", str(certs / "ca.pem"),
                  "--tls-cert", str(tmp_path / "dev.pem"), "--tls-key", str(tmp_path / "dev.key"),
                  "--timeout", "10")
    assert run.returncode == 24
    assert _one_line(run.stderr).startswith(
        "kvfence: error: UNAVAILABLE: the server refused the client certificate dev.pem")


def test_tls_client_against_a_plaintext_server_is_told(plain_server: RealServer,
                                                       tmp_path: Path) -> None:
    assert kvfence("certs", "dev", "--dir", str(tmp_path)).returncode == 0
    run = kvfence("usage", "--target", plain_server.target, "--tls-ca", str(tmp_path / "ca.pem"),
                  "--api-key", plain_server.key, "--timeout", "10")
    assert run.returncode == 24
    assert _one_line(run.stderr) == ("kvfence: error: UNAVAILABLE: the server does not use TLS: "
                                     "drop --tls-ca, --tls-cert and --tls-key")
