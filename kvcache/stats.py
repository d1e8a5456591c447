"""Read-only snapshots of cache usage, per tenant and server-wide."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

EVICTION_REASONS = ("ttl", "lru", "quota", "purge")
HIT_TIERS = ("pool", "tier", "shared")  # where cached prompt tokens were served from


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """``pages_in_use``: pages referenced by the tenant's sequences (its own; shared pages
    it reads are the operator's). ``pages_cached``: cached pages no sequence references.
    Their sum is what counts against ``max_pages``. ``cached_prefixes``: prefix-cache
    entries in the pool (referenced or not); ``tier_prefixes`` and ``tier_bytes``: its
    records in the KV tier. ``hit_tokens``: prompt tokens served from the tenant's own
    cache, ``tier_hit_tokens`` of them restored from the tier; ``shared_hit_tokens``:
    prompt tokens read from shared prefixes; ``miss_tokens``: prompt tokens computed."""

    tenant: str
    pages_in_use: int
    pages_cached: int
    cached_prefixes: int
    hit_tokens: int
    miss_tokens: int
    max_pages: int | None
    shared_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    tier_prefixes: int = 0
    tier_bytes: int = 0
    max_tier_bytes: int | None = None

    @property
    def hit_rate(self) -> float:
        """The share of looked-up prompt tokens not computed (own and shared hits)."""
        hits = self.hit_tokens + self.shared_hit_tokens
        total = hits + self.miss_tokens
        return hits / total if total else 0.0


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
    hit_tokens: Mapping[str, int] = field(default_factory=dict)  # by HIT_TIERS
    shared_prefixes: Mapping[str, int] = field(default_factory=dict)  # declared name -> pages
    shared_hits: Mapping[str, int] = field(default_factory=dict)  # name -> sequences that hit
    shared_pages: int = 0  # pages the operator holds (declared, prefilling, still read)
    tier_bytes: int = 0  # bytes of every tenant's records in the KV tier
    tier_rejected: int = 0  # tier records refused on the way back (each a miss)
    tier_dropped: int = 0  # evicted pages the tier did not keep (limits, write errors)


@dataclass(slots=True)
class Counters:
    """Mutable counters the manager updates; snapshots are taken by ``KVCacheManager``."""

    hit_tokens: dict[str, int] = field(default_factory=dict)  # own: pool + tier
    miss_tokens: dict[str, int] = field(default_factory=dict)
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    shared_hit_tokens: dict[str, int] = field(default_factory=dict)
    by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HIT_TIERS, 0))
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    scrubs: int = 0
    scrub_s: float = 0.0
    prefix_s: float = 0.0

    def add_lookup(self, tenant: str, pool: int, tier: int, shared: int, miss: int) -> None:
        """One open's prompt tokens: cached in the pool, restored from the tier, read from a
        shared prefix, and computed."""
        for counts, n in (
            (self.hit_tokens, pool + tier),
            (self.miss_tokens, miss),
            (self.tier_hit_tokens, tier),
            (self.shared_hit_tokens, shared),
        ):
            counts[tenant] = counts.get(tenant, 0) + n
        for name, n in (("pool", pool), ("tier", tier), ("shared", shared)):
            self.by_tier[name] += n
