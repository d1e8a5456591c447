"""What a caller without credentials can make the server do.

A call with a bad or missing API key is refused before its body is parsed, and the one
unauthenticated service, health, caps its long-lived ``Watch`` streams.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.admission.auth import Authenticator
from service.admission.tenants import hash_key, parse_tenants
from service.grpc.interceptor import AuthInterceptor
from service.serve.kvfence_server import ServerOptions
from tests.serverutil import TenantSpec, running_server

KEY = "kvf_the-right-key"
METHOD = "/kvfence.v1.Inference/Generate"


class _Details:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = METHOD
        self.invocation_metadata = metadata


def _handler_for(metadata: tuple[tuple[str, str], ...], client_certs: bool) -> Any:
    """The handler the interceptor returns, and how many times the real parser ran."""
    parsed: list[bytes] = []

    def parse(raw: bytes) -> bytes:
        parsed.append(raw)
        return raw

    async def generate(request: Any, context: Any) -> Any:
        yield request

    inner = grpc.unary_stream_rpc_method_handler(generate, request_deserializer=parse)
    registry = parse_tenants({"tenants": {"a": {"api_key_sha256": [hash_key(KEY).hex()]}}})
    interceptor = AuthInterceptor(
        Authenticator(registry),
        lambda: False,
        structlog.get_logger(),
        client_certs=client_certs,
    )

    async def continuation(_: Any) -> Any:
        return inner

    handler = asyncio.run(interceptor.intercept_service(continuation, _Details(metadata)))
    handler.request_deserializer(b"\xff" * 64)  # what gRPC does with the body next
    return parsed


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer kvf_wrong"),), (("authorization", "Basic abc"),)],
)
def test_unauthenticated_body_is_never_parsed(metadata: tuple[tuple[str, str], ...]) -> None:
    assert _handler_for(metadata, client_certs=False) == []


def test_authenticated_body_is_parsed() -> None:
    assert _handler_for((("authorization", f"Bearer {KEY}"),), client_certs=False) == [b"\xff" * 64]
    # With client certificates the identity is only known in the handler: parse, then check.
    assert _handler_for((), client_certs=True) == [b"\xff" * 64]


def test_refused_before_parsing_still_answers_unauthenticated(tiny_model: Any) -> None:
    with running_server(tiny_model, {"a": TenantSpec()}, log_stream=io.StringIO()) as srv:
        call = srv.channel().unary_stream(METHOD)
        for metadata in ((), (("authorization", "Bearer kvf_wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                list(call(b"\xff" * 1024, metadata=metadata, timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert any('"auth.denied"' in line for line in srv.log_lines())


def _watch(channel: grpc.Channel) -> Any:
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)


def _wait(predicate: Callable[[], bool]) -> None:
    for _ in range(500):
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def test_health_watch_streams_are_capped(tiny_model: Any) -> None:
    options = ServerOptions(max_health_watches=2)
    with running_server(tiny_model, {"a": TenantSpec()}, options=options) as srv:
        channel = srv.channel()
        open_streams = [_watch(channel) for _ in range(2)]
        for stream in open_streams:
            assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            next(_watch(channel))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Check is not a stream and is never capped.
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        open_streams[0].cancel()
        _wait(lambda: _watching(srv) == 1)
        assert next(_watch(channel)).status == health_pb2.HealthCheckResponse.SERVING
        for stream in open_streams[1:]:
            stream.cancel()


def _watching(srv: Any) -> int:
    return int(srv.server.health_watches)


def test_default_cap_holds(tiny_model: Any) -> None:
    from service.grpc.health_service import DEFAULT_MAX_WATCHES

    with running_server(tiny_model, {"a": TenantSpec()}) as srv:
        channel = srv.channel()
        streams = [_watch(channel) for _ in range(DEFAULT_MAX_WATCHES)]
        for stream in streams:
            next(stream)
        with pytest.raises(grpc.RpcError) as info:
            next(_watch(channel))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for stream in streams:
            stream.cancel()
