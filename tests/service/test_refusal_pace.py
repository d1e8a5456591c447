"""Refused calls are paced per peer host (the unauthenticated flood).

A client that retries at once on every refusal made the server read ~850 bodies a second;
past a burst, each refusal now waits for its token, so such a client is slowed to the
bucket's rate. Authenticated calls never wait.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import structlog

from service.admission.auth import Authenticator
from service.admission.refusal_pace import RefusalPace, peer_host
from service.admission.tenants import hash_key, parse_tenants
from service.grpc.interceptor import AuthInterceptor

KEY = "kvf_the-right-key"
METHOD = "/kvfence.v1.Inference/Generate"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_answers_a_burst_at_once_then_paces_to_its_rate() -> None:
    clock = Clock()
    pace = RefusalPace(rate=10.0, burst=3, max_waiting=2, max_wait_s=1.0, clock=clock)
    peer = "ipv4:10.0.0.7:41000"
    assert [pace.reserve(peer) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert pace.reserve(peer) == pytest.approx(0.1)  # the next token, 1/rate away
    assert pace.reserve("ipv4:10.0.0.7:41001") == pytest.approx(0.2)  # same host, new port
    # Two wait already: the next is answered at once rather than held.
    assert pace.reserve(peer) == 0.0
    assert pace.reserve("ipv4:10.0.0.8:41000") == 0.0  # another host has its own bucket
    pace.release(peer)
    pace.release(peer)
    clock.now += 10.0  # the bucket refills up to its burst, no further
    assert [pace.reserve(peer) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert pace.reserve(peer) > 0


def test_a_wait_past_max_wait_is_not_held() -> None:
    pace = RefusalPace(rate=1.0, burst=1, max_waiting=100, max_wait_s=1.5, clock=Clock())
    assert pace.reserve("ipv4:1.2.3.4:1") == 0.0
    assert pace.reserve("ipv4:1.2.3.4:1") == pytest.approx(1.0)
    assert pace.reserve("ipv4:1.2.3.4:1") == 0.0  # 2 s away: answered at once


def test_quiet_hosts_are_forgotten_when_many() -> None:
    clock = Clock()
    pace = RefusalPace(rate=1.0, burst=1, clock=clock, max_hosts=4)
    for i in range(4):
        pace.reserve(f"ipv4:10.0.0.{i}:1")
    clock.now += 5.0
    pace.reserve("ipv4:10.0.1.1:1")
    assert pace.num_hosts == 1


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:127.0.0.1:5555", "ipv4:127.0.0.1"),
        ("ipv6:[::1]:5555", "ipv6:[::1]"),
        ("unix:/tmp/sock", "unix:/tmp/sock"),
    ],
)
def test_peer_host(peer: str, host: str) -> None:
    assert peer_host(peer) == host


class _Details:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = METHOD
        self.invocation_metadata = metadata


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.codes: list[grpc.StatusCode] = []
        self._metadata = metadata

    def peer(self) -> str:
        return "ipv4:10.9.8.7:40000"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, Any]:
        return {}

    async def abort_with_status(self, status: grpc.Status) -> None:
        self.codes.append(status.code)
        raise _Aborted


def _calls(
    metadata: tuple[tuple[str, str], ...], n: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[float], list[grpc.StatusCode]]:
    """``n`` calls through the interceptor; the sleeps its refusals took, and their codes."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr("service.grpc.interceptor.asyncio.sleep", sleep)
    registry = parse_tenants({"tenants": {"a": {"api_key_sha256": [hash_key(KEY).hex()]}}})
    pace = RefusalPace(rate=4.0, burst=2, clock=Clock())
    interceptor = AuthInterceptor(
        Authenticator(registry), lambda: False, structlog.get_logger(), pace=pace
    )

    async def generate(
        request: Any, context: Any, tenant: Any, auth_ns: tuple[int, int] | None = None
    ) -> Any:
        yield request

    inner = grpc.unary_stream_rpc_method_handler(generate)

    async def continuation(_: Any) -> Any:
        return inner

    async def run() -> list[grpc.StatusCode]:
        codes: list[grpc.StatusCode] = []
        for _ in range(n):
            handler = await interceptor.intercept_service(continuation, _Details(metadata))
            context = _Context(metadata)
            try:
                if handler.stream_stream is not None:
                    await handler.stream_stream(iter(()), context)
                else:
                    async for _item in handler.unary_stream(b"x", context):
                        pass
                codes.append(grpc.StatusCode.OK)
            except _Aborted:
                codes.extend(context.codes)
        return codes

    return slept, asyncio.run(run())


def test_refusals_past_the_burst_wait_for_their_token(monkeypatch: pytest.MonkeyPatch) -> None:
    slept, codes = _calls((("authorization", "Bearer kvf_wrong"),), 4, monkeypatch)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
    # Burst of 2 at once; the fake clock stands still, so the 3rd and 4th wait 1 and 2 tokens.
    assert slept == [pytest.approx(0.25), pytest.approx(0.5)]


def test_authenticated_calls_never_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    slept, codes = _calls((("authorization", f"Bearer {KEY}"),), 5, monkeypatch)
    assert codes == [grpc.StatusCode.OK] * 5
    assert slept == []


def test_a_tenants_flood_of_cheap_calls_is_paced_and_another_tenant_is_not(srv: Any) -> None:
    """ListModels back to back: the first 100 at once, then 50 a second (a flood's calls
    held up to 2 s each); another tenant's calls meanwhile are answered at once."""
    import time

    from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc

    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    req = inference_pb2.ListModelsRequest()
    began = time.monotonic()
    for _ in range(300):
        stub.ListModels(req, metadata=srv.auth("acme"), timeout=30)
    flood_s = time.monotonic() - began
    began = time.monotonic()
    for _ in range(5):
        stub.ListModels(req, metadata=srv.auth("globex"), timeout=30)
    other_s = time.monotonic() - began
    assert flood_s >= (300 - 100) / 50 * 0.9, flood_s
    assert other_s < 2.0, (other_s, flood_s)  # held, five calls would take 10 s


def test_a_tenants_invalid_calls_are_paced_and_another_tenants_are_not(srv: Any) -> None:
    """Generate calls refused INVALID_ARGUMENT (temperature -1) back to back: the first 100
    at once, then 50 a second, as the HTTP front paces its 400s; another tenant's refusals
    meanwhile are answered at once."""
    import time

    from protos.kvfence.v1 import inference_pb2_grpc
    from tests.service.rpc import request

    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    bad = request("Hi", max_tokens=1)
    bad.sampling.temperature = -1.0

    def refused(tenant: str) -> grpc.StatusCode:
        try:
            list(stub.Generate(bad, metadata=srv.auth(tenant), timeout=30))
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    began = time.monotonic()
    codes = {refused("acme") for _ in range(200)}
    flood_s = time.monotonic() - began
    began = time.monotonic()
    other = {refused("globex") for _ in range(5)}
    other_s = time.monotonic() - began
    assert codes == other == {grpc.StatusCode.INVALID_ARGUMENT}
    assert flood_s >= (200 - 100) / 50 * 0.9, flood_s
    assert other_s < 2.0, (other_s, flood_s)
