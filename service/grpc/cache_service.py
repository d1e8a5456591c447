"""``kvfence.v1.Cache``: a tenant's view of, and control over, its own KV namespace only."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from protos.kvfence.v1 import cache_pb2
from service.admission.limiter import Limiter
from service.admission.tenant_adapters import Adapters
from service.admission.tenants import Tenant
from service.engine import TenantUsage
from service.telemetry.metrics import Metrics


class CacheServicer:
    def __init__(
        self,
        usage: Callable[[str], Awaitable[TenantUsage]],
        purge: Callable[[str], Awaitable[int]],
        page_size: int,
        default_ttl_s: float,
        limiter: Limiter,
        metrics: Metrics,
        adapters: Adapters | None = None,
    ) -> None:
        self._adapters = adapters
        self._usage = usage
        self._purge = purge
        self._page_size = page_size
        self._default_ttl_s = default_ttl_s
        self._limiter = limiter
        self._metrics = metrics

    async def GetUsage(
        self,
        request: cache_pb2.GetUsageRequest,
        context: grpc.aio.ServicerContext,
        tenant: Tenant,
    ) -> cache_pb2.GetUsageResponse:
        usage = await self._usage(tenant.name)
        self._count(tenant, "GetUsage")
        return cache_pb2.GetUsageResponse(
            pages_in_use=usage.pages_in_use,
            pages_cached=usage.pages_cached,
            cached_prefixes=usage.cached_prefixes,
            prefix_hit_tokens=usage.hit_tokens,
            prefix_miss_tokens=usage.miss_tokens,
            hit_rate=usage.hit_rate,
            page_size=self._page_size,
            running_requests=self._limiter.active(tenant.name),
            quotas=self._quotas(tenant, usage.max_pages),
            adapters=[] if self._adapters is None else self._adapters.usage(tenant),
            shared_prefix_hit_tokens=usage.shared_hit_tokens,
            tier_hit_tokens=usage.tier_hit_tokens,
            tier_bytes=usage.tier_bytes,
        )

    async def Purge(
        self,
        request: cache_pb2.PurgeRequest,
        context: grpc.aio.ServicerContext,
        tenant: Tenant,
    ) -> cache_pb2.PurgeResponse:
        purged = await self._purge(tenant.name)
        self._count(tenant, "Purge")
        return cache_pb2.PurgeResponse(pages_purged=purged)

    def _count(self, tenant: Tenant, method: str) -> None:
        self._metrics.requests.labels(
            self._metrics.label(tenant.name), method, "OK", "grpc"
        ).inc()

    def _quotas(self, tenant: Tenant, share: int | None) -> cache_pb2.Quotas:
        q = tenant.quotas
        ttl = tenant.prefix_cache_ttl_seconds
        return cache_pb2.Quotas(
            # The share in force: the file's value, or the one derived from the pool.
            max_kv_pages=q.max_kv_pages if share is None else share,
            max_concurrent_streams=q.max_concurrent_streams,
            max_prompt_tokens=q.max_prompt_tokens,
            tokens_per_minute=q.tokens_per_minute,
            prefix_cache_ttl_seconds=self._default_ttl_s if ttl is None else ttl,
        )
