"""Read-only snapshots of cache usage, per tenant and server-wide."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

EVICTION_REASONS = ("ttl", "lru", "quota", "purge")


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """``pages_in_use``: pages referenced by the tenant's sequences. ``pages_cached``: cached
    pages no sequence references. Their sum is what counts against ``max_pages``.
    ``cached_prefixes``: prefix-cache entries (referenced or not)."""

    tenant: str
    pages_in_use: int
    pages_cached: int
    cached_prefixes: int
    hit_tokens: int
    miss_tokens: int
    max_pages: int | None

    @property
    def hit_rate(self) -> float:
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0


@dataclass(frozen=True, slots=True)
class CacheStats:
    tenants: Mapping[str, TenantUsage]
    evictions: Mapping[str, int]  # by reason: ttl, lru, quota, purge
    scrubs: int  # pages zeroed
    fence_violations: int
    hash_collisions: int  # key hits rejected by the token comparison
    free_pages: int
    total_pages: int
    open_sequences: int = 0  # opened and not freed yet
    scrub_s: float = 0.0  # wall seconds spent zeroing those pages (host time of the zeroing call)
    prefix_s: float = 0.0  # wall seconds in prefix-cache lookups (open) and inserts (commit)


@dataclass(slots=True)
class Counters:
    """Mutable counters the manager updates; snapshots are taken by ``KVCacheManager``."""

    hit_tokens: dict[str, int] = field(default_factory=dict)
    miss_tokens: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    scrubs: int = 0
    scrub_s: float = 0.0
    prefix_s: float = 0.0

    def add_lookup(self, tenant: str, hit: int, miss: int) -> None:
        self.hit_tokens[tenant] = self.hit_tokens.get(tenant, 0) + hit
        self.miss_tokens[tenant] = self.miss_tokens.get(tenant, 0) + miss
