"""Token bucket and concurrency limits with an injected clock; status mapping of finishes."""

from __future__ import annotations

import grpc
import pytest
from google.rpc.error_details_pb2 import ErrorInfo, RetryInfo

from service.admission.limiter import TenantLimiter
from service.admission.outcomes import finish_error
from service.admission.tenants import Quotas
from service.engine.types import Finished, FinishError, FinishReason, RequestTooLarge
from service.errors import ServiceError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _refused(limiter: TenantLimiter, tenant: str, cost: int) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        limiter.acquire(tenant, cost)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    return info.value


def test_token_bucket_refills_at_the_per_minute_rate() -> None:
    clock = Clock()
    limiter = TenantLimiter(clock)
    limiter.configure("t", Quotas(max_concurrent_streams=100, tokens_per_minute=120))
    limiter.acquire("t", 100).release()
    err = _refused(limiter, "t", 30)  # 20 left, 10 short at 2 tokens/s
    retry = err.detail(RetryInfo)
    assert retry.retry_delay.seconds == 5 and retry.retry_delay.nanos == 0
    clock.now += 5.0
    limiter.acquire("t", 30).release()
    assert not [d for d in _refused(limiter, "t", 121).details if type(d).__name__ == "RetryInfo"]
    clock.now += 3600
    limiter.acquire("t", 120).release()  # capacity caps the refill
    _refused(limiter, "t", 1)


def test_concurrency_slots_are_released_once() -> None:
    limiter = TenantLimiter(Clock())
    limiter.configure("t", Quotas(max_concurrent_streams=2))
    a, b = limiter.acquire("t", 1), limiter.acquire("t", 1)
    _refused(limiter, "t", 1)
    assert limiter.active("t") == 2 and limiter.total_active() == 2
    a.release()
    a.release()  # idempotent
    assert limiter.active("t") == 1
    b.release()
    assert limiter.active("t") == 0


def test_refused_request_takes_no_tokens() -> None:
    limiter = TenantLimiter(Clock())
    limiter.configure("t", Quotas(max_concurrent_streams=1, tokens_per_minute=60))
    held = limiter.acquire("t", 10)
    _refused(limiter, "t", 10)  # concurrency, not tokens
    held.release()
    limiter.acquire("t", 50).release()  # 50 of 60 still there


def test_reconfigure_keeps_active_streams() -> None:
    limiter = TenantLimiter(Clock())
    limiter.configure("t", Quotas(max_concurrent_streams=2))
    lease = limiter.acquire("t", 1)
    limiter.configure("t", Quotas(max_concurrent_streams=1))
    _refused(limiter, "t", 1)
    lease.release()
    limiter.acquire("t", 1)


def _finished(reason: FinishReason, error: FinishError | None = None) -> Finished:
    return Finished(reason, 3, 1, 0, 0.0, 0.1, 0.2, error)


@pytest.mark.parametrize(
    ("reason", "error", "draining", "code", "detail"),
    [
        ("deadline", None, False, grpc.StatusCode.DEADLINE_EXCEEDED, None),
        ("abort", None, False, grpc.StatusCode.CANCELLED, None),
        ("abort", None, True, grpc.StatusCode.UNAVAILABLE, "RetryInfo"),
        (
            "error",
            FinishError("kv_fence", "fence violation on page 3: stale generation"),
            False,
            grpc.StatusCode.INTERNAL,
            "KV_FENCE",
        ),
        (
            "error",
            FinishError.too_large(RequestTooLarge(5, 2, "tenant page quota")),
            False,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "QuotaFailure",
        ),
        ("error", FinishError("internal", "boom"), False, grpc.StatusCode.INTERNAL, "ENGINE"),
        (
            "error",
            FinishError("internal", "ValueError: boom", cause="sampling failed (ValueError)"),
            False,
            grpc.StatusCode.INTERNAL,
            "ENGINE",
        ),
    ],
)
def test_finish_mapping(
    reason: FinishReason,
    error: FinishError | None,
    draining: bool,
    code: grpc.StatusCode,
    detail: str | None,
) -> None:
    err = finish_error(_finished(reason, error), draining)
    assert err.code == code
    if detail in ("KV_FENCE", "ENGINE"):
        assert err.detail(ErrorInfo).reason == detail
        assert "boom" not in err.message and "stale" not in err.message
        if error is not None and error.kind == "internal":  # the engine's words, if any
            said = f": {error.cause}" if error.cause else ""
            assert err.message == f"internal engine error{said}"
    elif detail is not None:
        assert type(err.details[0]).__name__ == detail or type(err.details[-1]).__name__ == detail
