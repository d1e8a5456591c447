"""When and how a call is retried (tenacity underneath).

The rule, shared by both clients:
- A call is retried only while nothing of it has been delivered to the caller. For unary calls
  that means "until the response arrives". For Generate, the client holds the `Started` event
  back until the stream's first `Chunk` (or `Finished`) arrives, and retries only before that
  point. Once any event has been handed to the caller the stream is never retried, so a caller
  can never see a token twice, or two `Started` events.
- Only UNAVAILABLE is retried, plus RESOURCE_EXHAUSTED when the server attached RetryInfo (the
  server's way of saying "try again later"; without it the limit is not transient). Every other
  code, UNAUTHENTICATED, PERMISSION_DENIED, INVALID_ARGUMENT and CANCELLED included, is raised
  at once.
- The wait is exponential backoff plus random jitter, and never less than the server's
  RetryInfo.retry_delay.
- A retry happens only if its wait ends before the call's deadline (`timeout=`) and the policy's
  attempt count is not spent; otherwise the last error is raised.
Each retry is logged at info level as `kvfence.retry` (method, attempt, code, wait; no text).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import structlog
import tenacity

from clients.errors import ClientError, KvfenceError, ResourceExhausted, Unavailable

Clock = Callable[[], float]
Sleep = Callable[[float], None]
AsyncSleep = Callable[[float], Awaitable[None]]
T = TypeVar("T")

_log = structlog.get_logger("kvfence.client")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How many times and how patiently to retry. `RetryPolicy(enabled=False)` turns it off."""

    enabled: bool = True
    max_attempts: int = 4  # total tries, the first included
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    jitter_s: float = 0.2  # uniform random extra on top of each backoff

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ClientError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if min(self.initial_backoff_s, self.max_backoff_s, self.jitter_s) < 0:
            raise ClientError("backoff and jitter must be >= 0")

    @property
    def attempts(self) -> int:
        return self.max_attempts if self.enabled else 1

    def backoff_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait after failed attempt number `attempt` (1-based), server delay aside."""
        base = min(self.max_backoff_s, self.initial_backoff_s * 2.0 ** (attempt - 1))
        return base + (rng or random).uniform(0.0, self.jitter_s)


DEFAULT_RETRY_POLICY = RetryPolicy()


def as_policy(retries: int | RetryPolicy) -> RetryPolicy:
    """`retries=N` means up to N retries after the first attempt; 0 switches retries off."""
    if isinstance(retries, RetryPolicy):
        return retries
    if retries < 0:
        raise ClientError(f"retries must be >= 0, got {retries}")
    return RetryPolicy(enabled=retries > 0, max_attempts=retries + 1)


def is_retryable(error: BaseException) -> bool:
    if isinstance(error, Unavailable):
        return True
    return isinstance(error, ResourceExhausted) and error.retry_delay is not None


def call_with_retries(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    method: str,
    deadline: float | None,
    clock: Clock,
    sleep: Sleep,
) -> T:
    """Run `fn` (one attempt of a call) until it succeeds or the rule says stop."""
    for attempt in tenacity.Retrying(sleep=sleep, **_settings(policy, method, deadline, clock)):
        with attempt:
            return fn()
    raise AssertionError("unreachable: with reraise=True tenacity stops by raising")


async def acall_with_retries(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    method: str,
    deadline: float | None,
    clock: Clock,
    sleep: AsyncSleep,
) -> T:
    """The asyncio twin of call_with_retries."""
    retrying = tenacity.AsyncRetrying(sleep=sleep, **_settings(policy, method, deadline, clock))
    async for attempt in retrying:
        with attempt:
            return await fn()
    raise AssertionError("unreachable: with reraise=True tenacity stops by raising")


def _settings(
    policy: RetryPolicy, method: str, deadline: float | None, clock: Clock
) -> dict[str, Any]:
    def wait(state: tenacity.RetryCallState) -> float:
        server_delay = _error(state).retry_delay or 0.0
        return max(policy.backoff_s(state.attempt_number), server_delay)

    def log_retry(state: tenacity.RetryCallState) -> None:
        error = _error(state)
        _log.info(
            "kvfence.retry",
            method=method,
            attempt=state.attempt_number,
            code=error.code.name,
            wait_s=round(state.upcoming_sleep, 3),
        )

    return {
        "retry": tenacity.retry_if_exception(is_retryable),
        "wait": wait,
        "stop": tenacity.stop_after_attempt(policy.attempts) | _StopAtDeadline(deadline, clock),
        "before_sleep": log_retry,
        "reraise": True,
    }


class _StopAtDeadline(tenacity.stop.stop_base):
    """Stop when the next wait would end at or past the call's deadline."""

    def __init__(self, deadline: float | None, clock: Clock) -> None:
        self._deadline = deadline
        self._clock = clock

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        # tenacity computes the wait before it asks `stop`, so upcoming_sleep is this wait.
        if self._deadline is None:
            return False
        return self._clock() + retry_state.upcoming_sleep >= self._deadline


def _error(state: tenacity.RetryCallState) -> KvfenceError:
    outcome = state.outcome
    error = outcome.exception() if outcome is not None else None
    if not isinstance(error, KvfenceError):
        # Only KvfenceErrors pass is_retryable, so wait/stop/before_sleep never see others.
        return KvfenceError(grpc.StatusCode.UNKNOWN, repr(error))
    return error
