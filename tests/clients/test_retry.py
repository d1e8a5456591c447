"""The retry rule (clients/retry.py), through real gRPC calls to a scripted server."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import grpc
import pytest

from clients import (
    AsyncClient,
    Cancelled,
    Chunk,
    Client,
    InvalidArgument,
    KvfenceError,
    PermissionDenied,
    ResourceExhausted,
    RetryPolicy,
    Started,
    Unauthenticated,
    Unavailable,
)
from clients.errors import Internal
from clients.types import GenerateEvent
from tests.clients.fakeserver import GOOD_KEY, Fail, FakeInference, serve

FAST = RetryPolicy(max_attempts=5, initial_backoff_s=0.1, max_backoff_s=0.3, jitter_s=0.0)
UNAVAILABLE = Fail(grpc.StatusCode.UNAVAILABLE, "engine restarting")


def _client(target: str, sleeps: list[float], **kwargs: Any) -> Client:
    kwargs.setdefault("retries", FAST)
    return Client(target, api_key=GOOD_KEY, sleep=sleeps.append, **kwargs)


def test_unavailable_is_retried_with_exponential_backoff(
    fake: FakeInference, target: str, sleeps: list[float]
) -> None:
    fake.failures = [UNAVAILABLE] * 4
    with _client(target, sleeps) as client:
        result = client.generate_text("hi")
    assert result.text == "Hello, world"
    assert fake.generate_calls == 5
    assert sleeps == pytest.approx([0.1, 0.2, 0.3, 0.3])  # doubling, capped at max_backoff_s


def test_resource_exhausted_with_retry_info_waits_at_least_the_servers_delay(
    fake: FakeInference, target: str, sleeps: list[float]
) -> None:
    fake.failures = [
        Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant queue full", retry_delay_s=2.5)
    ] * 2
    with _client(target, sleeps) as client:
        assert client.generate_text("hi").text == "Hello, world"
    assert fake.generate_calls == 3
    assert sleeps == pytest.approx([2.5, 2.5])


def test_resource_exhausted_without_retry_info_is_not_retried(
    fake: FakeInference, target: str, sleeps: list[float]
) -> None:
    fake.failures = [Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota")]
    with _client(target, sleeps) as client, pytest.raises(ResourceExhausted, match="quota"):
        client.generate_text("hi")
    assert (fake.generate_calls, sleeps) == (1, [])


def test_a_stream_that_failed_after_its_first_chunk_is_never_retried(
    fake: FakeInference, target: str, sleeps: list[float]
) -> None:
    fake.failures = [Fail(grpc.StatusCode.UNAVAILABLE, "lost", after_chunks=1)]
    seen: list[GenerateEvent] = []
    with _client(target, sleeps) as client, pytest.raises(Unavailable, match="lost"):
        for event in client.generate("hi"):
            seen.append(event)
    assert [type(e) for e in seen] == [Started, Chunk]
    assert isinstance(seen[1], Chunk) and seen[1].text == "Hel"
    assert (fake.generate_calls, sleeps) == (1, [])


def test_a_failure_after_started_but_before_any_chunk_is_retried_invisibly(
    fake: FakeInference, target: str, sleeps: list[float]
) -> None:
    fake.failures = [Fail(grpc.StatusCode.UNAVAILABLE, after_chunks=0)]
    with _client(target, sleeps) as client:
        events = list(client.generate("hi"))
    started = [e for e in events if isinstance(e, Started)]
    assert [s.request_id for s in started] == ["req-2"]  # the failed attempt's is never shown
    assert fake.generate_calls == 2 and sleeps == pytest.approx([0.1])


@pytest.mark.parametrize(
    ("code", "error_type"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.CANCELLED, Cancelled),
        (grpc.StatusCode.INTERNAL, Internal),
    ],
)
def test_other_codes_raise_at_once_as_their_type(
    fake: FakeInference,
    target: str,
    sleeps: list[float],
    code: grpc.StatusCode,
    error_type: type[KvfenceError],
) -> None:
    # RetryInfo attached on purpose: only UNAVAILABLE/RESOURCE_EXHAUSTED may honour it.
    fake.failures = [Fail(code, "nope", retry_delay_s=0.1)] * 3
    with _client(target, sleeps) as client, pytest.raises(error_type) as caught:
        client.generate_text("hi")
    assert type(caught.value) is error_type
    assert caught.value.code == code and caught.value.message == "nope"
    assert str(caught.value) == f"{code.name}: nope"
    assert (fake.generate_calls, sleeps) == (1, [])


@pytest.mark.parametrize("retries", [0, RetryPolicy(enabled=False)])
def test_retries_can_be_switched_off(
    fake: FakeInference, target: str, sleeps: list[float], retries: int | RetryPolicy
) -> None:
    fake.failures = [UNAVAILABLE]
    with _client(target, sleeps, retries=retries) as client, pytest.raises(Unavailable):
        client.generate_text("hi")
    assert (fake.generate_calls, sleeps) == (1, [])


def test_attempts_are_bounded(fake: FakeInference, target: str, sleeps: list[float]) -> None:
    fake.failures = [UNAVAILABLE] * 10
    with _client(target, sleeps, retries=2) as client, pytest.raises(Unavailable):
        client.generate_text("hi")
    assert fake.generate_calls == 3 and len(sleeps) == 2


def test_retries_stop_at_the_deadline(fake: FakeInference, target: str) -> None:
    now = [100.0]
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # a fake clock that moves only when the client waits
        waits.append(seconds)
        now[0] += seconds

    fake.failures = [UNAVAILABLE] * 10
    policy = RetryPolicy(max_attempts=100, initial_backoff_s=0.4, jitter_s=0.0)
    with (
        Client(
            target, api_key=GOOD_KEY, retries=policy, clock=lambda: now[0], sleep=sleep
        ) as client,
        pytest.raises(Unavailable),
    ):
        client.generate_text("hi", timeout=1.0)
    # 0.4 s fits in the 1 s budget; the next wait (0.8 s) would end past the deadline.
    assert waits == [0.4] and fake.generate_calls == 2
    second_attempt_budget = fake.seen.timeouts[1]
    assert second_attempt_budget is not None and second_attempt_budget <= 0.65


def test_server_delay_beyond_the_deadline_is_not_waited_for(
    fake: FakeInference, target: str, sleeps: list[float]
) -> None:
    fake.failures = [Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", retry_delay_s=30.0)]
    with _client(target, sleeps) as client, pytest.raises(ResourceExhausted) as caught:
        client.generate_text("hi", timeout=5.0)
    assert caught.value.retry_delay == 30.0
    assert (fake.generate_calls, sleeps) == (1, [])


def test_unary_calls_are_retried_too(fake: FakeInference, target: str, sleeps: list[float]) -> None:
    fake.failures = [UNAVAILABLE, UNAVAILABLE]
    with _client(target, sleeps) as client:
        assert client.tokenize("a bb").token_ids == (1, 2)
    assert len(fake.seen.requests) == 3 and sleeps == pytest.approx([0.1, 0.2])


def test_backoff_jitter_stays_within_its_bounds() -> None:
    policy = RetryPolicy(initial_backoff_s=0.2, max_backoff_s=1.0, jitter_s=0.1)
    rng = random.Random(7)
    waits = [[policy.backoff_s(n, rng) for _ in range(50)] for n in (1, 2, 3, 4, 5)]
    for base, samples in zip((0.2, 0.4, 0.8, 1.0, 1.0), waits, strict=True):
        assert all(base <= w <= base + 0.1 for w in samples)
        assert max(samples) - min(samples) > 0.05  # the jitter is really there


# -- the same rule in the asyncio client ---------------------------------------------------


def _run_async(target: str, sleeps: list[float], prompt_events: list[GenerateEvent]) -> None:
    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def main() -> None:
        async with AsyncClient(target, api_key=GOOD_KEY, retries=FAST, sleep=sleep) as client:
            async for event in client.generate("hi"):
                prompt_events.append(event)

    asyncio.run(main())


def test_async_retries_before_the_first_chunk_and_honours_retry_info(sleeps: list[float]) -> None:
    fake = FakeInference(
        failures=[UNAVAILABLE, Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_delay_s=1.5)]
    )
    events: list[GenerateEvent] = []
    with serve(fake) as target:
        _run_async(target, sleeps, events)
    assert "".join(e.text for e in events if isinstance(e, Chunk)) == "Hello, world"
    assert [e.request_id for e in events if isinstance(e, Started)] == ["req-3"]
    assert fake.generate_calls == 3 and sleeps == pytest.approx([0.1, 1.5])


def test_async_stream_is_not_retried_after_a_chunk(sleeps: list[float]) -> None:
    fake = FakeInference(failures=[Fail(grpc.StatusCode.UNAVAILABLE, "lost", after_chunks=2)])
    events: list[GenerateEvent] = []
    with serve(fake) as target, pytest.raises(Unavailable, match="lost"):
        _run_async(target, sleeps, events)
    assert [e.text for e in events if isinstance(e, Chunk)] == ["Hel", "lo"]
    assert (fake.generate_calls, sleeps) == (1, [])


@pytest.mark.parametrize(
    ("code", "error_type"),
    [
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
        (grpc.StatusCode.CANCELLED, Cancelled),
    ],
)
def test_async_non_retryable_codes(
    sleeps: list[float], code: grpc.StatusCode, error_type: type[KvfenceError]
) -> None:
    fake = FakeInference(failures=[Fail(code, "no")] * 2)
    with serve(fake) as target, pytest.raises(error_type):
        _run_async(target, sleeps, [])
    assert (fake.generate_calls, sleeps) == (1, [])
