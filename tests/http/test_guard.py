"""The HTTP front's connection guard and answer pacing, against a real server.

Slowloris: hundreds of connections that each send a request line and ``Host:`` and then
nothing. Past the per-peer cap they are closed as soon as they are accepted, the rest when
the header timeout passes, and meanwhile gRPC calls and another peer's HTTP calls are served.
Floods of cheap answers (wrong keys, /health, /v1/models, 400s) are held to the paced rate,
per peer or per tenant, without slowing another tenant."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from protos.kvfence.v1 import inference_pb2_grpc
from service.http.guard import HttpGuard
from service.serve.kvfence_server import ServerOptions
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.service.rpc import request

GUARD = HttpGuard(
    header_timeout_s=4.0, body_idle_s=1.5, max_connections=120, max_per_peer=40,
    paced_per_s=20.0, paced_burst=10, paced_wait_s=1.0,
)


@pytest.fixture(scope="module")
def guarded(tiny_model: Any) -> Iterator[ServerHandle]:
    tenants = {"acme": TenantSpec(), "globex": TenantSpec()}
    options = ServerOptions(http_port=0, http_guard=GUARD, metrics_on_http=True)
    with running_server(tiny_model, tenants, options=options) as handle:
        yield handle


def _port(srv: ServerHandle) -> int:
    assert srv.server.http is not None
    return srv.server.http.port


def _half_request(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line
    return s


def _closed(s: socket.socket, wait_s: float) -> bool:
    s.settimeout(wait_s)  # 0: do not wait
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except (TimeoutError, BlockingIOError):
        return False


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_slowloris_connections_are_capped_and_timed_out_while_others_are_served(
    guarded: ServerHandle,
) -> None:
    port = _port(guarded)
    before = _open_fds()
    socks = [_half_request(port) for _ in range(300)]
    try:
        closed_at_once: list[socket.socket] = []
        deadline = time.monotonic() + 10  # the server accepts them at its own pace
        while len(closed_at_once) < 300 - GUARD.max_per_peer and time.monotonic() < deadline:
            closed_at_once += [s for s in socks if s not in closed_at_once and _closed(s, 0)]
            time.sleep(0.1)
        assert len(closed_at_once) == 300 - GUARD.max_per_peer
        held = [s for s in socks if s not in closed_at_once]
        assert not any(_closed(s, 0.01) for s in held)  # still within the header timeout
        # The server's side of the 260 refused ones is gone: both ends here are this process.
        assert _open_fds() - before <= 300 + GUARD.max_per_peer + 16
        stub = inference_pb2_grpc.InferenceStub(guarded.channel())
        out = list(stub.Generate(request("Hi", max_tokens=2), metadata=guarded.auth("acme"),
                                 timeout=30))
        assert out[-1].WhichOneof("event") == "finished"
        other_peer = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=other_peer, timeout=10) as client:
            r = client.get(f"http://127.0.0.1:{port}/v1/models",
                           headers={"Authorization": f"Bearer {guarded.keys['globex']}"})
        assert r.status_code == 200
        deadline = time.monotonic() + GUARD.header_timeout_s + 2.0
        assert all(_closed(s, max(0.01, deadline - time.monotonic())) for s in held)
    finally:
        for s in socks:
            s.close()


def test_a_stalled_body_is_cut_after_the_idle_timeout(guarded: ServerHandle) -> None:
    s = socket.create_connection(("127.0.0.1", _port(guarded)))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                  b"Authorization: Bearer " + guarded.keys["acme"].encode() + b"\r\n\r\n{")
        began = time.monotonic()
        assert _closed(s, GUARD.body_idle_s + 3.0)
        assert time.monotonic() - began >= GUARD.body_idle_s - 0.2
    finally:
        s.close()


def _flood(port: int, n: int, method: str, path: str, key: str | None,
           body: bytes | None = None, local: str = "127.0.0.1") -> tuple[float, set[int]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    codes: set[int] = set()
    with httpx.Client(transport=httpx.HTTPTransport(local_address=local), timeout=30) as c:
        began = time.monotonic()
        for _ in range(n):
            codes.add(c.request(method, f"http://127.0.0.1:{port}{path}", headers=headers,
                                content=body).status_code)
        return time.monotonic() - began, codes


# 40 answers at 20/s after a burst of 10: at least 1.5 s.
FLOOD = 40
PACED_S = (FLOOD - GUARD.paced_burst) / GUARD.paced_per_s


@pytest.mark.parametrize(
    ("method", "path", "who", "body", "code"),
    [
        ("GET", "/v1/models", "wrong", None, 401),
        ("GET", "/health", None, None, 200),
        ("GET", "/v1/models", "acme", None, 200),
        ("POST", "/v1/completions", "acme", b"{not json", 400),
        ("GET", "/metrics", None, None, 200),
        ("POST", "/detokenize", "acme", b'{"tokens": []}', 200),
    ],
    ids=["wrong-key", "health", "models", "bad-request", "metrics", "detokenize"],
)
def test_floods_of_cheap_answers_are_paced(
    guarded: ServerHandle, method: str, path: str, who: str | None, body: bytes | None,
    code: int, request: pytest.FixtureRequest,
) -> None:
    key = None if who is None else "sk-wrong-key" if who == "wrong" else guarded.keys[who]
    local = {"wrong-key": "127.0.0.3", "health": "127.0.0.4", "metrics": "127.0.0.5"}.get(
        request.node.callspec.id, "127.0.0.1")
    elapsed, codes = _flood(_port(guarded), FLOOD, method, path, key, body, local)
    assert codes == {code}
    assert elapsed >= PACED_S * 0.9, elapsed


def test_one_tenants_flood_does_not_pace_another_tenant(guarded: ServerHandle) -> None:
    port = _port(guarded)
    time.sleep(GUARD.paced_burst / GUARD.paced_per_s + 0.2)  # buckets full again
    _flood(port, GUARD.paced_burst + 5, "GET", "/v1/models", guarded.keys["acme"])
    elapsed, codes = _flood(port, 5, "GET", "/v1/models", guarded.keys["globex"])
    assert codes == {200}
    assert elapsed < 2.5, elapsed  # held, five answers would take 5 s


def test_the_connection_cap_follows_the_descriptor_limit() -> None:
    guard = HttpGuard(max_connections=4096, spare_fds=256)
    assert guard.connection_cap(1024) == 384
    assert guard.connection_cap(1 << 20) == 4096
    assert guard.connection_cap(300) == 22
    assert guard.connection_cap(10) == 1
