"""Cluster-wide limits against a real redis-server: several ``ClusterLimiter`` instances stand
in for several replicas (each its own Redis connection pool, as separate processes have)."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Literal

import grpc
import pytest
from prometheus_client import CollectorRegistry

from service.admission.cluster_limits import (
    ClusterLimiter,
    ClusterLimitsConfig,
    build_cluster_limiter,
)
from service.admission.limiter import LeaseLike
from service.admission.redis_scripts import LeaseKey
from service.admission.tenants import Quotas
from service.errors import ServiceError
from service.telemetry.logs import make_logger
from tests.cluster.conftest import RedisProcess


def _replica(
    url: str,
    quotas: Quotas,
    *,
    mode: Literal["open", "closed"] = "open",
    ttl: float = 10.0,
    log: io.StringIO | None = None,
    registry: CollectorRegistry | None = None,
) -> ClusterLimiter:
    config = ClusterLimitsConfig(
        redis_url=url, on_redis_failure=mode, lease_ttl_s=ttl, retry_interval_s=0.2
    )
    limiter = build_cluster_limiter(
        config,
        registry=registry or CollectorRegistry(),
        log=make_logger("json", log or io.StringIO()),
        clock=time.monotonic,
    )
    limiter.configure("acme", quotas)
    return limiter


async def _try(admit: Callable[[], Awaitable[LeaseLike]]) -> LeaseLike | ServiceError:
    try:
        return await admit()
    except ServiceError as err:
        return err


def _run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def test_token_bucket_is_atomic_across_replicas(redis_server: RedisProcess) -> None:
    """600 tokens/minute, 60 concurrent requests of 100 from 3 replicas: exactly 6 get in.

    A read-modify-write bucket (no Lua) lets many of the racing requests read the same
    full level and over-admits."""

    async def main() -> None:
        quotas = Quotas(max_concurrent_streams=1000, tokens_per_minute=600)
        replicas = [_replica(redis_server.url, quotas) for _ in range(3)]
        results = await asyncio.gather(
            *(_try(lambda r=r: r.admit("acme", 100)) for _ in range(20) for r in replicas)
        )
        admitted = [r for r in results if not isinstance(r, ServiceError)]
        refused = [r for r in results if isinstance(r, ServiceError)]
        assert len(admitted) == 6
        assert {err.code for err in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert all(r.redis_up for r in replicas)
        for r in replicas:
            await r.close()

    _run(main())


def test_stream_cap_holds_across_replicas_and_release_frees_it(
    redis_server: RedisProcess,
) -> None:
    async def main() -> None:
        quotas = Quotas(max_concurrent_streams=4)
        replicas = [_replica(redis_server.url, quotas) for _ in range(3)]
        results = await asyncio.gather(
            *(_try(lambda r=r: r.admit("acme", 1)) for _ in range(10) for r in replicas)
        )
        leases = [r for r in results if not isinstance(r, ServiceError)]
        assert len(leases) == 4
        store = replicas[0].store
        assert await store.active("acme") == 4
        assert sum(r.active("acme") for r in replicas) == 4
        for lease in leases:
            lease.release()
            lease.release()  # idempotent
        for r in replicas:
            await r.close()  # waits for the releases in flight
        check = _replica(redis_server.url, quotas)
        assert await check.store.active("acme") == 0
        await check.close()

    _run(main())


def test_crashed_replicas_leases_expire_within_ttl_and_live_ones_are_renewed(
    redis_server: RedisProcess,
) -> None:
    async def main() -> None:
        ttl = 1.0
        quotas = Quotas(max_concurrent_streams=2)
        live = _replica(redis_server.url, quotas, ttl=ttl)
        await live.start()
        held = [await live.admit("acme", 1), await live.admit("acme", 1)]
        other = _replica(redis_server.url, quotas, ttl=ttl)
        # The live replica renews: well past the TTL its streams still count.
        await asyncio.sleep(ttl * 2.5)
        refused = await _try(lambda: other.admit("acme", 1))
        assert isinstance(refused, ServiceError)
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Crash: renewal stops and nothing is released.
        live.stop_renewing()
        crashed_at = time.monotonic()
        while isinstance(lease := await _try(lambda: other.admit("acme", 1)), ServiceError):
            assert time.monotonic() - crashed_at < ttl + 0.5, "leases outlived their TTL"
            await asyncio.sleep(0.05)
        lease.release()
        assert len(held) == 2
        await other.close()

    _run(main())


def _events(log: io.StringIO) -> list[str]:
    return [json.loads(line)["event"] for line in log.getvalue().splitlines()]


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_outage_follows_the_failure_mode_and_limits_resume(
    redis_server: RedisProcess, mode: Literal["open", "closed"]
) -> None:
    async def main() -> None:
        log = io.StringIO()
        registry = CollectorRegistry()
        quotas = Quotas(max_concurrent_streams=3, tokens_per_minute=6000)
        limiter = _replica(redis_server.url, quotas, mode=mode, log=log, registry=registry)
        (await limiter.admit("acme", 10)).release()
        redis_server.stop()
        outcomes = [await _try(lambda: limiter.admit("acme", 10)) for _ in range(5)]
        assert not limiter.redis_up
        if mode == "open":
            # This replica's own limits apply: 3 streams, not unlimited.
            assert [isinstance(o, ServiceError) for o in outcomes] == [False] * 3 + [True] * 2
            assert all(
                o.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                for o in outcomes
                if isinstance(o, ServiceError)
            )
        else:
            assert all(
                isinstance(o, ServiceError) and o.code == grpc.StatusCode.UNAVAILABLE
                for o in outcomes
            )
        failures = registry.get_sample_value("kvfence_limits_redis_failures_total", {"mode": mode})
        assert failures == 5
        assert registry.get_sample_value("kvfence_limits_redis_up") == 0
        assert _events(log).count("limits.redis_unavailable") == 1  # once per outage
        for o in outcomes:
            if not isinstance(o, ServiceError):
                o.release()

        redis_server.start()  # empty: the old bucket and leases are gone
        await asyncio.sleep(0.25)  # past retry_interval_s
        leases = [await _try(lambda: limiter.admit("acme", 10)) for _ in range(4)]
        assert [isinstance(x, ServiceError) for x in leases] == [False] * 3 + [True]
        assert await limiter.store.active("acme") == 3  # counted in Redis again
        assert limiter.redis_up
        assert _events(log).count("limits.redis_restored") == 1
        assert registry.get_sample_value("kvfence_limits_redis_outages_total") == 1
        for x in leases:
            if not isinstance(x, ServiceError):
                x.release()
        await limiter.close()

    _run(main())


def test_redis_down_at_start_is_an_outage_not_a_crash() -> None:
    async def main() -> None:
        from tests.cluster.conftest import free_port

        limiter = _replica(f"redis://127.0.0.1:{free_port()}/0", Quotas(), mode="closed")
        await limiter.start()
        err = await _try(lambda: limiter.admit("acme", 1))
        assert isinstance(err, ServiceError) and err.code == grpc.StatusCode.UNAVAILABLE
        await limiter.renew_once()
        await limiter.close()

    _run(main())


def test_live_leases_are_reasserted_when_redis_comes_back_empty(
    redis_server: RedisProcess,
) -> None:
    """Redis restarted without its data: the next renewal puts the live streams back, so
    another replica is held to the cap again (renewing only existing members never would)."""

    async def main() -> None:
        ttl = 1.5
        quotas = Quotas(max_concurrent_streams=2)
        live = _replica(redis_server.url, quotas, ttl=ttl)
        held = [await live.admit("acme", 1), await live.admit("acme", 1)]
        redis_server.stop()
        redis_server.start()  # empty: no save, no append-only file
        other = _replica(redis_server.url, quotas, ttl=ttl)
        assert await other.store.active("acme") == 0
        await live.renew_once()
        assert await other.store.active("acme") == 2
        refused = await _try(lambda: other.admit("acme", 1))
        assert isinstance(refused, ServiceError)
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        held[0].release()
        await live.close()  # waits for the release
        assert await other.store.active("acme") == 1
        await other.close()

    _run(main())


def test_a_lease_released_during_a_renewal_is_not_left_behind(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        quotas = Quotas(max_concurrent_streams=4)
        live = _replica(redis_server.url, quotas, ttl=30.0)
        lease = await live.admit("acme", 1)
        store = live.store
        renew = store.renew

        async def slow_renew(leases: Sequence[LeaseKey], ttl: float) -> int:
            lease.release()  # the stream ends while the renewal is on its way
            await asyncio.sleep(0.1)  # its ZREM lands first, then the re-add
            return await renew(leases, ttl)

        monkeypatch.setattr(store, "renew", slow_renew)
        await live.renew_once()
        assert await store.active("acme") == 0
        await live.close()

    _run(main())
