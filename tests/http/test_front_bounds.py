"""The HTTP front judges a request before reading it: the body's size against the tenant's
prompt limit, the key from the headers, and room for new connections among idle ones."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.admission.request_size import JSON_BYTES_PER_TOKEN, REQUEST_ALLOWANCE_BYTES
from service.http.guard import HttpGuard
from service.serve.kvfence_server import ServerOptions
from tests.serverutil import ServerHandle, TenantSpec, running_server

GUARD = HttpGuard(max_connections=30, max_per_peer=10, limit_concurrency=4)
SHORT_LIMIT = 8 * JSON_BYTES_PER_TOKEN + REQUEST_ALLOWANCE_BYTES


@pytest.fixture(scope="module")
def srv(tiny_model: Any) -> Iterator[ServerHandle]:
    tenants = {"acme": TenantSpec(), "short": TenantSpec(max_prompt_tokens=8)}
    options = ServerOptions(http_port=0, http_guard=GUARD)
    with running_server(tiny_model, tenants, options=options) as handle:
        yield handle


def _port(srv: ServerHandle) -> int:
    assert srv.server.http is not None
    return srv.server.http.port


def _recv_all(s: socket.socket) -> bytes:
    s.settimeout(10)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_a_body_past_the_tenants_limit_is_413_from_its_declared_length(
    srv: ServerHandle,
) -> None:
    with socket.create_connection(("127.0.0.1", _port(srv))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  + srv.keys["short"].encode()
                  + f"\r\nContent-Length: {SHORT_LIMIT + 1}\r\n\r\n".encode())
        answer = _recv_all(s)  # no byte of the body sent: answered and closed
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert b"connection: close" in head.lower()
    assert f"body: is {SHORT_LIMIT + 1} bytes".encode() in body
    assert f"the {SHORT_LIMIT} bytes".encode() in body and b"8 prompt tokens" in body


def test_a_body_past_the_limit_as_it_streams_is_413(srv: ServerHandle) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "' + b"x" * SHORT_LIMIT + b'"}'

    r = httpx.post(f"http://127.0.0.1:{_port(srv)}/v1/completions", content=chunks(),
                   headers={"Authorization": f"Bearer {srv.keys['short']}"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    # The same body is within the bound of a tenant with the model's whole context.
    r = httpx.post(f"http://127.0.0.1:{_port(srv)}/v1/completions", content=chunks(),
                   headers={"Authorization": f"Bearer {srv.keys['acme']}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_wrong_key_is_401_from_the_headers_and_nothing_behind_it_is_read(
    srv: ServerHandle,
) -> None:
    one = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer kvf_wrong\r\n"
           b"Content-Length: 2\r\n\r\n{}")
    with socket.create_connection(("127.0.0.1", _port(srv))) as s:
        s.sendall(one * 5)
        answer = _recv_all(s)
    assert answer.count(b"HTTP/1.1 401") == 1  # then the connection was closed
    assert b"authentication_error" in answer and b"connection: close" in answer.lower()
    # A right key on the same route is served; an unknown route is still 404.
    ok = httpx.get(f"http://127.0.0.1:{_port(srv)}/v1/models", timeout=30,
                   headers={"Authorization": f"Bearer {srv.keys['acme']}"})
    assert ok.status_code == 200
    assert httpx.get(f"http://127.0.0.1:{_port(srv)}/v1/audio/speech").status_code == 404


def test_idle_connections_make_room_for_new_ones(srv: ServerHandle) -> None:
    """Past the per-peer and total caps, a new connection closes the oldest idle one; more
    idle connections than limit_concurrency deny no request."""
    port = _port(srv)
    idle = [socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{2 + i % 4}", 0))
            for i in range(3 * GUARD.max_connections)]
    try:
        time.sleep(0.5)
        open_now = [s for s in idle if not _closed(s)]
        assert len(open_now) <= GUARD.max_connections
        assert idle[0] not in open_now  # the oldest made room
        headers = {"Authorization": f"Bearer {srv.keys['acme']}"}
        for source in ("127.0.0.2", "127.0.0.9"):
            transport = httpx.HTTPTransport(local_address=source)
            with httpx.Client(transport=transport, timeout=30) as client:
                codes = {client.get(f"http://127.0.0.1:{port}/v1/models", headers=headers)
                         .status_code for _ in range(3)}
            assert codes == {200}, source
    finally:
        for s in idle:
            s.close()


def _closed(s: socket.socket) -> bool:
    s.settimeout(0)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except BlockingIOError:
        return False
