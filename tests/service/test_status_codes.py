"""Every row of the status table in service/errors.py, produced by its case on a real server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc
import pytest

from protos.kvfence.v1 import cache_pb2, inference_pb2
from tests.serverutil import ServerHandle
from tests.service.rpc import details, generate, request, stubs, usage

LONG = 490  # with a 6-token prompt this fills the 512-token context: a stream that lasts


class _Stream(Iterator[inference_pb2.GenerateResponse], Protocol):
    """A server stream as grpc's blocking stub returns it: an iterator and a call."""

    def cancel(self) -> bool: ...


def _wait_for(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _open_stream(srv: ServerHandle, tenant: str, max_tokens: int = LONG) -> _Stream:
    inference, _ = stubs(srv)
    stream: _Stream = inference.Generate(
        request("Hello world", max_tokens=max_tokens), metadata=srv.auth(tenant)
    )
    assert next(stream).WhichOneof("event") == "started"
    return stream


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ((), "UNAUTHENTICATED"),
        ((("authorization", "Bearer kvf_not-a-real-key"),), "INVALID_KEY"),
        ((("authorization", "Basic dXNlcjpwYXNz"),), "MALFORMED"),
        ((("authorization", "Bearer "),), "MALFORMED"),
    ],
    ids=["missing", "unknown key", "wrong scheme", "empty key"],
)
def test_bad_credentials_are_unauthenticated(
    srv: ServerHandle, metadata: tuple[tuple[str, str], ...], reason: str
) -> None:
    inference, cache = stubs(srv)
    for call in (
        lambda: list(inference.Generate(request("hi"), metadata=metadata)),
        lambda: inference.ListModels(inference_pb2.ListModelsRequest(), metadata=metadata),
        lambda: cache.GetUsage(cache_pb2.GetUsageRequest(), metadata=metadata),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert details(info.value)["ErrorInfo"].reason == reason


def test_duplicate_authorization_headers_are_unauthenticated_even_if_both_valid(
    srv: ServerHandle,
) -> None:
    inference, _ = stubs(srv)
    metadata = srv.auth("acme") + srv.auth("acme")
    with pytest.raises(grpc.RpcError) as info:
        inference.ListModels(inference_pb2.ListModelsRequest(), metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert details(info.value)["ErrorInfo"].reason == "DUPLICATE_CREDENTIALS"


def test_health_needs_no_credentials(srv: ServerHandle) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(srv.channel())
    for service in ("", "kvfence.v1.Inference", "kvfence.v1.Cache"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_model_outside_the_tenants_list_is_permission_denied(srv: ServerHandle) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(srv, "other_model", request("hi"))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert details(info.value)["ErrorInfo"].reason == "MODEL"


def test_concurrent_stream_quota_is_resource_exhausted_with_retry_info(srv: ServerHandle) -> None:
    stream = _open_stream(srv, "one_stream")
    try:
        with pytest.raises(grpc.RpcError) as info:
            generate(srv, "one_stream", request("hi"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        d = details(info.value)
        assert d["QuotaFailure"].violations[0].subject == "max_concurrent_streams"
        assert d["RetryInfo"].retry_delay.seconds == 1
    finally:
        stream.cancel()
    # The slot is released with the stream.
    _wait_for(lambda: srv.server.limiter.active("one_stream") == 0)
    assert len(generate(srv, "one_stream", request("hi", max_tokens=1))) == 3


def test_tokens_per_minute_is_resource_exhausted(srv: ServerHandle) -> None:
    # slow_rate: 60 tokens per minute, charged on prompt + max_tokens.
    ok = generate(srv, "slow_rate", request(ids=[5] * 10, max_tokens=40))
    assert ok[-1].finished.usage.completion_tokens == 40
    with pytest.raises(grpc.RpcError) as info:
        generate(srv, "slow_rate", request(ids=[5] * 10, max_tokens=20))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    d = details(info.value)
    assert d["QuotaFailure"].violations[0].subject == "tokens_per_minute"
    delay = d["RetryInfo"].retry_delay
    # 10 tokens left, 30 needed at 1 token/s: about 20 s.
    assert 15 <= delay.seconds + delay.nanos / 1e9 <= 21
    with pytest.raises(grpc.RpcError) as never:
        generate(srv, "slow_rate", request(ids=[5] * 10, max_tokens=60))
    assert never.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "RetryInfo" not in details(never.value)  # waiting cannot help


def test_kv_page_quota_is_resource_exhausted_and_frees_everything(srv: ServerHandle) -> None:
    # two_pages: 2 pages of 16 tokens; 6 prompt + 100 new tokens cannot fit.
    with pytest.raises(grpc.RpcError) as info:
        generate(srv, "two_pages", request("Hello world", max_tokens=100))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details(info.value)["QuotaFailure"].violations[0].subject in ("max_kv_pages", "kv_pages")
    assert usage(srv, "two_pages").pages_in_use == 0
    assert len(generate(srv, "two_pages", request("Hello world", max_tokens=4))) == 6


def test_client_deadline_is_deadline_exceeded_and_frees_pages(srv: ServerHandle) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(srv, "globex", request("Hello world", max_tokens=LONG), timeout=0.15)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for(lambda: usage(srv, "globex").pages_in_use == 0)
    _wait_for(lambda: srv.usage("globex").pages_in_use == 0)
    labels = {"tenant": "globex", "method": "Generate", "code": "DEADLINE_EXCEEDED", "front": "grpc"}
    registry = srv.server.metrics.registry
    _wait_for(lambda: registry.get_sample_value("kvfence_requests_total", labels) == 1)


def test_mid_stream_cancel_frees_the_pages_within_a_step(srv: ServerHandle) -> None:
    stream = _open_stream(srv, "acme")
    for _ in range(3):
        assert next(stream).WhichOneof("event") == "chunk"
    during = usage(srv, "acme")
    assert during.pages_in_use >= 1 and during.running_requests == 1
    stream.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    _wait_for(lambda: usage(srv, "acme").pages_in_use == 0, timeout=2.0)
    after = usage(srv, "acme")
    assert after.running_requests == 0
    assert srv.engine.num_running() == 0
    # The server recorded the stream as cancelled.
    value = srv.server.metrics.registry.get_sample_value(
        "kvfence_requests_total", {"tenant": "acme", "method": "Generate", "code": "CANCELLED", "front": "grpc"}
    )
    assert value is not None and value >= 1


def test_fence_violation_aborts_the_request_with_internal_kv_fence(srv: ServerHandle) -> None:
    stream = _open_stream(srv, "globex")
    first = next(stream)
    assert first.WhichOneof("event") == "chunk"
    before = srv.stats().fence_violations
    # Simulate a recycled page: its generation moves on under the running sequence.
    _, generated_when_broken = asyncio.run(srv.engine.hooks.inject_stale_page("globex"))
    received = 0
    with pytest.raises(grpc.RpcError) as info:
        for response in stream:
            assert response.WhichOneof("event") == "chunk"
            received += 1
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert details(info.value)["ErrorInfo"].reason == "KV_FENCE"
    # Tokens computed before the page moved may still arrive; after it, at most the one step
    # that had already passed the fence. Nothing computed over the moved page is sent.
    assert 1 + received <= generated_when_broken + 1
    assert srv.stats().fence_violations > before
