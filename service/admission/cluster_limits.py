"""Cluster-wide tenant limits: the token bucket and stream cap held in Redis (``--redis-url``).

Every admitted stream holds a lease in Redis that this replica renews every ``lease_ttl/3``
while the stream lives; a replica that crashes stops renewing, so its streams stop counting
against the tenant within ``lease_ttl`` seconds.

When Redis cannot be reached, ``on_redis_failure`` decides:

- ``open`` (the default): admit under this replica's own limits (``TenantLimiter``, the
  limits as without ``--redis-url``). Serving continues; a tenant can get up to N times its
  quota across N replicas while the outage lasts.
- ``closed``: refuse new streams with UNAVAILABLE (and a retry hint) until Redis is back.

Either way the server never crashes: each decision taken without Redis is counted in
``kvfence_limits_redis_failures_total``, the outage is logged once when it starts and once
when it ends, and after a failure Redis is not asked again for ``retry_interval_s`` (so an
outage adds no per-request timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import Redis
from redis.exceptions import RedisError
from structlog.typing import FilteringBoundLogger

from service.admission.limiter import LeaseLike, TenantLimiter, check_cost
from service.admission.redis_scripts import ADMITTED, STREAMS_FULL, LeaseKey, RedisLimitStore
from service.admission.tenants import Quotas
from service.errors import resource_exhausted, unavailable

FailureMode = Literal["open", "closed"]
DEFAULT_FAILURE_MODE: FailureMode = "open"
_REDIS_DOWN = (RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True, slots=True)
class ClusterLimitsConfig:
    redis_url: str
    on_redis_failure: FailureMode = DEFAULT_FAILURE_MODE
    lease_ttl_s: float = 10.0
    redis_timeout_s: float = 0.5  # one Redis call; past it the call counts as a failure
    retry_interval_s: float = 1.0  # after a failure, Redis is not asked again for this long
    key_prefix: str = "kvfence"

    def __post_init__(self) -> None:
        if self.on_redis_failure not in ("open", "closed"):
            raise ValueError(
                f"on_redis_failure must be open or closed, not {self.on_redis_failure!r}"
            )
        if self.lease_ttl_s <= 0 or self.redis_timeout_s <= 0 or self.retry_interval_s < 0:
            raise ValueError("lease TTL and Redis timeout must be > 0")


class _ClusterLease:
    def __init__(self, owner: ClusterLimiter, key: LeaseKey) -> None:
        self._owner: ClusterLimiter | None = owner
        self.key = key

    def release(self) -> None:
        if self._owner is not None:
            self._owner._release(self.key)
            self._owner = None


class _RedisHealth:
    """Outage bookkeeping: one log line and one counted outage per outage."""

    def __init__(self, log: FilteringBoundLogger, registry: CollectorRegistry) -> None:
        self._log = log
        self.down_since: float | None = None
        self.retry_at = 0.0
        self.failures = Counter(
            "kvfence_limits_redis_failures",
            "Admission decisions taken without Redis, by failure mode",
            ["mode"],
            registry=registry,
        )
        self.outages = Counter(
            "kvfence_limits_redis_outages", "Times Redis became unreachable", registry=registry
        )
        self.up = Gauge("kvfence_limits_redis_up", "1 while Redis answers", registry=registry)
        self.up.set(1)

    def failed(self, now: float, retry_interval_s: float, error: BaseException) -> None:
        self.retry_at = now + retry_interval_s
        if self.down_since is None:
            self.down_since = now
            self.outages.inc()
            self.up.set(0)
            self._log.warning("limits.redis_unavailable", error=type(error).__name__)

    def answered(self, now: float) -> None:
        if self.down_since is not None:
            self._log.info("limits.redis_restored", outage_s=round(now - self.down_since, 3))
            self.down_since = None
            self.up.set(1)


class ClusterLimiter:
    """``Limiter`` over Redis, with ``fallback`` (this replica's limits) for ``open`` mode."""

    def __init__(
        self,
        store: RedisLimitStore,
        config: ClusterLimitsConfig,
        *,
        fallback: TenantLimiter,
        registry: CollectorRegistry,
        log: FilteringBoundLogger,
        clock: Callable[[], float],
        replica_id: str | None = None,
    ) -> None:
        self._store = store
        self._config = config
        self._fallback = fallback
        self._log = log
        self._clock = clock
        # Lease ids start with the replica id, so an operator can tell whose streams count.
        self._replica = replica_id or f"{socket.gethostname()}:{os.getpid()}"
        self._health = _RedisHealth(log, registry)
        self._leases: dict[str, LeaseKey] = {}  # lease id -> key, while the stream lives
        self._active: dict[str, int] = {}
        self._pending: set[asyncio.Task[None]] = set()  # releases in flight
        self._renewer: asyncio.Task[None] | None = None

    @property
    def redis_up(self) -> bool:
        return self._health.down_since is None

    def configure(self, tenant: str, quotas: Quotas) -> None:
        self._fallback.configure(tenant, quotas)

    def active(self, tenant: str) -> int:
        return self._active.get(tenant, 0) + self._fallback.active(tenant)

    def total_active(self) -> int:
        return sum(self._active.values()) + self._fallback.total_active()

    async def admit(self, tenant: str, cost: int) -> LeaseLike:
        quotas = self._fallback.quotas(tenant)
        if quotas is None:
            raise RuntimeError(f"tenant {tenant!r} has no limits configured")
        check_cost(quotas, cost)
        if self._clock() >= self._health.retry_at:
            key = LeaseKey(tenant, f"{self._replica}:{uuid.uuid4().hex}")
            try:
                decision = await asyncio.wait_for(
                    self._store.acquire(key, cost, quotas, self._config.lease_ttl_s),
                    self._config.redis_timeout_s,
                )
            except _REDIS_DOWN as err:
                # NOTE: a timeout may come after Redis ran the script; that lease is never
                # renewed, so it stops counting within the TTL.
                self._health.failed(self._clock(), self._config.retry_interval_s, err)
            else:
                self._health.answered(self._clock())
                if decision.outcome == STREAMS_FULL:
                    raise resource_exhausted(
                        "max_concurrent_streams",
                        f"tenant has {decision.active} of {quotas.max_concurrent_streams} "
                        "concurrent streams open across the cluster",
                        retry_after_s=1.0,
                    )
                if decision.outcome != ADMITTED:
                    raise resource_exhausted(
                        "tokens_per_minute",
                        f"tenant token rate limit reached ({quotas.tokens_per_minute} per "
                        "minute across the cluster)",
                        retry_after_s=decision.retry_after_s,
                    )
                self._leases[key.lease_id] = key
                self._active[tenant] = self._active.get(tenant, 0) + 1
                return _ClusterLease(self, key)
        mode = self._config.on_redis_failure
        self._health.failures.labels(mode).inc()
        if mode == "closed":
            raise unavailable("tenant limits are unavailable (limits store unreachable)", 1.0)
        return self._fallback.acquire(tenant, cost)

    def _release(self, key: LeaseKey) -> None:
        if self._leases.pop(key.lease_id, None) is None:
            return
        self._active[key.tenant] -= 1
        task = asyncio.get_running_loop().create_task(self._release_in_redis(key))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release_in_redis(self, key: LeaseKey) -> None:
        try:
            await asyncio.wait_for(self._store.release(key), self._config.redis_timeout_s)
        except _REDIS_DOWN as err:
            # The lease expires on its own within the TTL once nobody renews it.
            self._health.failed(self._clock(), self._config.retry_interval_s, err)

    async def renew_once(self) -> None:
        """Renew every live lease; also how a recovered Redis is noticed when idle."""
        leases = list(self._leases.values())
        try:
            restored = await asyncio.wait_for(
                self._store.renew(leases, self._config.lease_ttl_s),
                self._config.redis_timeout_s,
            )
            # A lease released while the renewal was on its way was re-added: remove it again.
            for key in leases:
                if key.lease_id not in self._leases:
                    await asyncio.wait_for(self._store.release(key), self._config.redis_timeout_s)
            if restored:
                self._log.warning("limits.leases_restored", leases=restored)
            if not self._leases:
                await asyncio.wait_for(self._store.ping(), self._config.redis_timeout_s)
        except _REDIS_DOWN as err:
            self._health.failed(self._clock(), self._config.retry_interval_s, err)
        else:
            self._health.answered(self._clock())
            self._health.retry_at = 0.0

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.lease_ttl_s / 3)
            await self.renew_once()

    @property
    def store(self) -> RedisLimitStore:
        """Where the cluster-wide counts live (read them with ``await store.active(t)``)."""
        return self._store

    async def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    def stop_renewing(self) -> None:
        """Stop renewing this replica's leases and release nothing, as a replica that
        crashed does: its streams stop counting once their TTL runs out."""
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=self._config.redis_timeout_s * 2)
        with contextlib.suppress(*_REDIS_DOWN):
            await self._store.close()


def build_cluster_limiter(
    config: ClusterLimitsConfig,
    *,
    registry: CollectorRegistry,
    log: FilteringBoundLogger,
    clock: Callable[[], float],
) -> ClusterLimiter:
    """Connect lazily: a Redis that is down at start is an outage, not a start failure."""
    client = Redis.from_url(
        config.redis_url,
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.redis_timeout_s,
    )
    return ClusterLimiter(
        RedisLimitStore(client, config.key_prefix),
        config,
        fallback=TenantLimiter(clock),
        registry=registry,
        log=log.bind(component="limits"),
        clock=clock,
    )
