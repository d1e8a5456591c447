"""Per-tenant admission limits checked before a request reaches the engine.

Two limits: concurrent calls (Generate streams and Tokenize calls), and a token bucket over
``input + max_tokens`` refilled at ``tokens_per_minute``. Both are checked and taken together
before any work on the request (tokenizing included), so a refused request consumes nothing.
The input's token count is not known before tokenizing, so it is charged by its size:
``byte_tokens``, one token per ``BYTES_PER_TOKEN`` bytes (token ids: one each). Everything
here runs on the event-loop thread.

``Limiter`` is what the servicers see. ``TenantLimiter`` keeps the limits in this process;
``service.admission.cluster_limits.ClusterLimiter`` keeps them in Redis, shared by every replica.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from service.admission.tenants import Quotas
from service.errors import resource_exhausted

BYTES_PER_TOKEN = 4


def byte_tokens(n_bytes: int) -> int:
    """What an input of ``n_bytes`` is charged before it is tokenized."""
    return -(-n_bytes // BYTES_PER_TOKEN)


class LeaseLike(Protocol):
    def release(self) -> None:
        """Free the stream's concurrency slot; idempotent."""


class Limiter(Protocol):
    """Admission limits as the servicers and the server use them."""

    def configure(self, tenant: str, quotas: Quotas) -> None:
        """Set or update a tenant's quotas (on start and on tenants-file reload)."""

    def active(self, tenant: str) -> int:
        """Streams this process has admitted for ``tenant`` and not yet released."""

    def total_active(self) -> int:
        """Streams this process has admitted and not yet released, all tenants."""

    async def admit(self, tenant: str, cost: int) -> LeaseLike:
        """Take a stream slot and ``cost`` tokens, or raise a ServiceError."""

    async def start(self) -> None:
        """Begin background work (lease renewal); called once the server serves."""

    async def close(self) -> None:
        """Stop background work and drop connections."""


def check_cost(quotas: Quotas, cost: int) -> None:
    """A request that can never fit the tenant's bucket is refused without a retry hint."""
    tpm = quotas.tokens_per_minute
    if 0 < tpm < cost:
        raise resource_exhausted(
            "tokens_per_minute",
            f"request needs {cost} tokens (prompt + max_tokens) but the tenant's "
            f"limit is {tpm} per minute",
        )


@dataclass(slots=True)
class TokenBucket:
    """Holds up to ``capacity`` tokens, refilled at ``rate_per_s``."""

    capacity: float
    rate_per_s: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
        self.updated = now

    def wait_for(self, cost: float) -> float:
        """Seconds until ``cost`` tokens are available (0 = now). Call ``refill`` first."""
        return 0.0 if self.level >= cost else (cost - self.level) / self.rate_per_s


@dataclass(slots=True)
class _TenantState:
    quotas: Quotas
    active: int = 0
    bucket: TokenBucket | None = field(default=None)


class Lease:
    """One admitted stream; ``release`` (idempotent) frees its concurrency slot."""

    def __init__(self, state: _TenantState) -> None:
        self._state: _TenantState | None = state

    def release(self) -> None:
        if self._state is not None:
            self._state.active -= 1
            self._state = None


class TenantLimiter:
    """Concurrency slots and token buckets for every tenant."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._states: dict[str, _TenantState] = {}

    def configure(self, tenant: str, quotas: Quotas) -> None:
        """Set or update a tenant's quotas (on start and on tenants-file reload).

        Active streams and the bucket level survive an update; a changed rate takes effect
        from now on.
        """
        state = self._states.get(tenant)
        if state is None:
            state = self._states[tenant] = _TenantState(quotas=quotas)
        state.quotas = quotas
        tpm = quotas.tokens_per_minute
        if tpm <= 0:
            state.bucket = None
        elif state.bucket is None:
            state.bucket = TokenBucket(tpm, tpm / 60.0, float(tpm), self._clock())
        else:
            state.bucket.refill(self._clock())
            state.bucket.capacity = tpm
            state.bucket.rate_per_s = tpm / 60.0
            state.bucket.level = min(state.bucket.level, tpm)

    def active(self, tenant: str) -> int:
        state = self._states.get(tenant)
        return 0 if state is None else state.active

    def total_active(self) -> int:
        return sum(state.active for state in self._states.values())

    def quotas(self, tenant: str) -> Quotas | None:
        state = self._states.get(tenant)
        return None if state is None else state.quotas

    async def admit(self, tenant: str, cost: int) -> Lease:
        return self.acquire(tenant, cost)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def acquire(self, tenant: str, cost: int) -> Lease:
        """Take a stream slot and ``cost`` tokens, or raise RESOURCE_EXHAUSTED."""
        state = self._states.get(tenant)
        if state is None:
            raise RuntimeError(f"tenant {tenant!r} has no limits configured")
        limit = state.quotas.max_concurrent_streams
        if state.active >= limit:
            raise resource_exhausted(
                "max_concurrent_streams",
                f"tenant has {state.active} of {limit} concurrent streams open",
                retry_after_s=1.0,
            )
        bucket = state.bucket
        if bucket is not None:
            check_cost(state.quotas, cost)
            bucket.refill(self._clock())
            wait = bucket.wait_for(cost)
            if wait > 0:
                raise resource_exhausted(
                    "tokens_per_minute",
                    f"tenant token rate limit reached ({int(bucket.capacity)} per minute)",
                    retry_after_s=wait,
                )
            bucket.level -= cost
        state.active += 1
        return Lease(state)
