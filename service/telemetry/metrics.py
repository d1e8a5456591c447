"""Prometheus metrics on a dedicated ``CollectorRegistry`` (no global registry state).

The ``tenant`` label only takes names from the tenants file; anything else is ``unknown``,
so label cardinality is bounded by the file. The ``name`` label of the shared-prefix series
is an operator-declared name from the same file (never anything a tenant sent). Per-request series carry ``front`` ("grpc" or
"http") and are recorded for both fronts by ``service.telemetry.request_metrics``. KV-cache figures come from the latest
``KVCacheManager.stats()`` snapshot the server hands to ``observe_cache``; they are rendered
at scrape time by a custom collector, so per-tenant series follow reloads exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.engine import CacheStats

UNKNOWN_TENANT = "unknown"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class EngineGauges:
    waiting: int
    running: int


_Family = TypeVar("_Family", CounterMetricFamily, GaugeMetricFamily)


def _by_key(family: _Family, values: Mapping[str, float]) -> _Family:
    """``family`` (one label) with one sample per key of ``values``, in key order."""
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


class _CacheCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats, engine = self._metrics.snapshot()
        queue = GaugeMetricFamily("kvfence_queue_depth", "Requests waiting for admission")
        running = GaugeMetricFamily("kvfence_running_sequences", "Sequences holding KV pages")
        if engine is not None:
            queue.add_metric([], engine.waiting)
            running.add_metric([], engine.running)
        yield queue
        yield running
        if stats is None:
            return
        used = GaugeMetricFamily(
            "kvfence_kv_pages_used", "KV pages referenced by running requests", labels=["tenant"]
        )
        cached = GaugeMetricFamily(
            "kvfence_kv_pages_cached", "Unreferenced cached prefix pages", labels=["tenant"]
        )
        hits = CounterMetricFamily(
            "kvfence_prefix_hit_tokens",
            "Prompt tokens served from the tenant's own prefix cache (pool and KV tier)",
            labels=["tenant"],
        )
        shared_hits = CounterMetricFamily(
            "kvfence_shared_prefix_hit_tokens",
            "Prompt tokens the tenant read from the operator's shared prefixes",
            labels=["tenant"],
        )
        tier_bytes = GaugeMetricFamily(
            "kvfence_kv_tier_bytes", "Bytes of the tenant's records in the KV tier",
            labels=["tenant"],
        )
        for name in self._metrics.tenants:
            usage = stats.tenants.get(name)
            used.add_metric([name], usage.pages_in_use if usage else 0)
            cached.add_metric([name], usage.pages_cached if usage else 0)
            hits.add_metric([name], usage.hit_tokens if usage else 0)
            shared_hits.add_metric([name], usage.shared_hit_tokens if usage else 0)
            tier_bytes.add_metric([name], usage.tier_bytes if usage else 0)
        yield used
        yield cached
        yield hits
        yield shared_hits
        yield tier_bytes
        yield _by_key(CounterMetricFamily(
            "kvfence_cached_prompt_tokens_by_source",
            "Prompt tokens not computed, by where their KV came from (pool, tier, shared)",
            labels=["source"],
        ), stats.hit_tokens)
        yield _by_key(CounterMetricFamily(
            "kvfence_shared_prefix_hits", "Requests that read a shared prefix, by its name",
            labels=["name"],
        ), stats.shared_hits)
        yield _by_key(GaugeMetricFamily(
            "kvfence_shared_prefix_pages", "KV pages of each declared shared prefix",
            labels=["name"],
        ), stats.shared_prefixes)
        yield CounterMetricFamily(
            "kvfence_kv_tier_rejected",
            "KV tier records refused on the way back (altered, moved or replayed: a miss)",
            value=stats.tier_rejected,
        )
        yield _by_key(CounterMetricFamily(
            "kvfence_kv_evictions", "Cached pages evicted", labels=["reason"]
        ), stats.evictions)
        yield CounterMetricFamily("kvfence_kv_scrubs", "KV pages zeroed", value=stats.scrubs)
        yield CounterMetricFamily(
            "kvfence_kv_scrub_seconds",
            "Wall seconds spent zeroing KV pages",
            value=stats.scrub_s,
        )
        yield CounterMetricFamily(
            "kvfence_kv_prefix_seconds",
            "Wall seconds spent in prefix-cache lookups and inserts",
            value=stats.prefix_s,
        )
        yield CounterMetricFamily(
            "kvfence_kv_fence_violations",
            "Fence checks that refused a page",
            value=stats.fence_violations,
        )
        free = GaugeMetricFamily("kvfence_kv_pages_free", "Free KV pages", value=stats.free_pages)
        yield free
        yield GaugeMetricFamily("kvfence_kv_pages_total", "KV pool size", value=stats.total_pages)


class Metrics:
    """Every metric the server exports; one instance per server."""

    def __init__(self, tenants: Iterable[str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._guard = threading.Lock()  # the scrape thread reads what the loop thread writes
        self._tenants: tuple[str, ...] = tuple(tenants)
        self._stats: CacheStats | None = None
        self._engine: EngineGauges | None = None
        r = self.registry
        self.requests = Counter(
            "kvfence_requests",
            "Requests by tenant, method, status code and front",
            ["tenant", "method", "code", "front"],
            registry=r,
        )
        self.refusals = Counter(
            "kvfence_refusals",
            "Requests refused (an error instead of a generation) by status code and reason",
            ["tenant", "front", "code", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvfence_prompt_tokens", "Prompt tokens processed", ["tenant", "front"], registry=r
        )
        self.completion_tokens = Counter(
            "kvfence_completion_tokens", "Tokens generated", ["tenant", "front"], registry=r
        )
        self.cached_tokens = Counter(
            "kvfence_cached_prompt_tokens",
            "Prompt tokens not computed: the caller's own cached prefixes and the shared "
            "prefixes it reads",
            ["tenant", "front"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvfence_ttft_seconds",
            "Time to first token",
            ["tenant", "front"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "kvfence_inter_token_seconds",
            "Time between streamed chunks of one sequence",
            ["tenant", "front"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.auth_denials = Counter(
            "kvfence_auth_denials", "Refused credentials by status code", ["code"], registry=r
        )
        self.kv_alerts = Counter(
            "kvfence_kv_alerts", "KV usage anomaly alerts", ["tenant", "kind"], registry=r
        )
        # Adapter names come from the tenants file, as tenant names do (bounded labels).
        self.adapter_requests = Counter(
            "kvfence_adapter_requests",
            "Finished streams by tenant and LoRA adapter",
            ["tenant", "adapter"],
            registry=r,
        )
        self.adapter_tokens = Counter(
            "kvfence_adapter_tokens",
            "Prompt and completion tokens by tenant and LoRA adapter",
            ["tenant", "adapter", "kind"],
            registry=r,
        )
        r.register(_CacheCollector(self))

    @property
    def tenants(self) -> tuple[str, ...]:
        return self._tenants

    def set_tenants(self, tenants: Iterable[str]) -> None:
        """After a tenants-file reload: the new label set."""
        self._tenants = tuple(tenants)

    def label(self, tenant: str) -> str:
        return tenant if tenant in self._tenants else UNKNOWN_TENANT

    def observe_cache(self, stats: CacheStats, engine: EngineGauges) -> None:
        with self._guard:
            self._stats = stats
            self._engine = engine

    def snapshot(self) -> tuple[CacheStats | None, EngineGauges | None]:
        with self._guard:
            return self._stats, self._engine


class MetricsServer:
    """The ``/metrics`` HTTP endpoint on its own thread."""

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        server, thread = start_http_server(port, addr=host, registry=metrics.registry)
        self._server: WSGIServer = server
        self._thread = thread
        self.port: int = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
