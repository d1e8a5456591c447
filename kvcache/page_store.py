"""PageStore: the pool's pages and where cached ones go.

It holds the allocator, the prefix cache and the eviction queue, and does what moves pages
between owners and places: taking free pages for a sequence (scrubbed for its tenant),
releasing a sequence's pages (cached ones become evictable, a declared shared page stays,
the rest are reclaimed), evicting (TTL, the tenant's own for its quota, LRU), handing
pages that memory pressure evicts to the KV tier and restoring them from it, and zeroing.
``KVCacheManager`` decides which sequence needs what; this module decides which page.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from kvcache.allocator import PageAllocator, PageRef
from kvcache.config import CacheConfig, TenantCachePolicy
from kvcache.errors import FenceViolation
from kvcache.eviction import EvictionQueue
from kvcache.page_table import PageTable
from kvcache.pool import PagePool
from kvcache.prefix_cache import ChainPos, KeyFn, PrefixCache
from kvcache.results import FITS, Allocation
from kvcache.shared_prefix import SharedPrefixes
from kvcache.stats import Counters
from kvcache.tier import KVTier
from kvcache.tier_seal import TierRecord

# Evictions whose page goes down to the KV tier: memory pressure, not a TTL or a purge.
TO_TIER = ("lru", "quota")


class PageStore:
    """Page transitions for the manager (its only user). ``policies`` is the manager's
    live map of tenant policies; ``counters`` and ``shared`` are the manager's too."""

    def __init__(
        self,
        pool: PagePool,
        config: CacheConfig,
        clock: Callable[[], float],
        key_fn: KeyFn,
        *,
        policies: Mapping[str, TenantCachePolicy],
        counters: Counters,
        shared: SharedPrefixes,
        tier: KVTier | None,
    ) -> None:
        self.pool = pool
        self.config = config
        self._clock = clock
        self.allocator = PageAllocator(pool.num_pages)
        self.prefix = PrefixCache(config.secret, key_fn)
        self.evictable = EvictionQueue()
        self.tier = tier
        self._policies = policies
        self._counters = counters
        self._shared = shared

    def ttl(self, tenant: str) -> float:
        p = self._policies.get(tenant)
        return self.config.default_ttl_s if p is None or p.ttl_s is None else p.ttl_s

    def plan_reserve(self, tenant: str, needed: int) -> tuple[Allocation, int]:
        """Check quota and pool for ``needed`` new pages without changing anything.
        Returns the answer and how many of the tenant's own cached pages must be evicted
        for its quota."""
        policy = self._policies.get(tenant)
        quota_evictions = 0
        if policy is not None and policy.max_pages is not None:
            owned = self.allocator.tenant_pages(tenant).owned
            excess = owned + needed - policy.max_pages
            if excess > 0:
                if excess > self.evictable.count(tenant):
                    return Allocation(False, "quota", owned + needed, policy.max_pages), 0
                quota_evictions = excess
        available = self.allocator.num_free() + len(self.evictable)
        if needed > available:
            return Allocation(False, "out_of_pages", needed, available), 0
        return FITS, quota_evictions

    def make_room(self, tenant: str, needed: int, quota_evictions: int) -> None:
        """Evict what ``plan_reserve`` said: the tenant's own for its quota, then the LRU."""
        for _ in range(quota_evictions):
            page_id = self.evictable.oldest(tenant)
            assert page_id is not None
            self.evict(page_id, "quota")
        while self.allocator.num_free() < needed:
            page_id = self.evictable.oldest()
            assert page_id is not None
            self.evict(page_id, "lru")

    def take(self, table: PageTable, needed: int) -> list[PageRef]:
        """``needed`` free pages onto the table, scrubbed for its tenant."""
        tenant = table.tenant
        to_scrub: list[int] = []
        taken: list[PageRef] = []
        for _ in range(needed):
            ref, data_owner = self.allocator.take(tenant, table.seq_id)
            if self.config.scrub_policy != "off" and data_owner not in (None, tenant):
                to_scrub.append(ref.page_id)
            taken.append(ref)
        table.pages.extend(taken)
        self.zero(to_scrub)
        for ref in taken:
            self.allocator.mark_written(ref.page_id, tenant)
        return taken

    def release_pages(self, table: PageTable) -> tuple[list[int], FenceViolation | None]:
        """Drop the table's references, tail first. A page no one holds any more becomes
        evictable when cached, stays when it is a declared shared page, and is otherwise
        reclaimed. Returns the pages to zero and the first fence violation met (every other
        page is released all the same)."""
        now = self._clock()
        ttl = self.ttl(table.tenant)
        to_zero: list[int] = []
        violation: FenceViolation | None = None
        for ref in reversed(table.pages):
            try:
                if self.allocator.release(ref, table.tenant, table.seq_id) > 0:
                    continue
            except FenceViolation as exc:
                # NOTE: keep releasing the sequence's other pages, then report.
                violation = violation or exc
                continue
            shared = self._shared.by_page.get(ref.page_id)
            if shared is not None:
                if not (shared.declared and shared.live):
                    to_zero.extend(self.reclaim_shared(ref.page_id))
                continue
            cached = self.prefix.entry_for_page(ref.page_id) is not None
            if cached and ttl > 0:
                self.evictable.push(ref.page_id, table.tenant, now + ttl)
            else:
                if cached:
                    self.prefix.remove_page(ref.page_id)
                to_zero.extend(self.reclaim(ref.page_id))
        return to_zero, violation

    def reclaim(self, page_id: int) -> list[int]:
        """Return an unreferenced page to the free list; returns it if it must be zeroed."""
        self.allocator.reclaim(page_id)
        return [page_id] if self.config.scrub_policy == "always" else []

    def zero(self, page_ids: list[int]) -> None:
        if not page_ids:
            return
        started = time.perf_counter()
        self.pool.zero_pages(page_ids)
        self._counters.scrub_s += time.perf_counter() - started
        for page_id in page_ids:
            self.allocator.mark_zeroed(page_id)
        self._counters.scrubs += len(page_ids)

    def evict(self, page_id: int, reason: str) -> None:
        """Evict one evictable cached page (to the KV tier, when one is set and the reason
        is memory pressure)."""
        expires_at = self.evictable.expires_at(page_id)
        self.evictable.remove(page_id)
        if reason in TO_TIER and self.tier is not None:
            self._demote(self.tier, page_id, expires_at)
        self.prefix.remove_page(page_id)
        self.zero(self.reclaim(page_id))
        self._counters.evictions[reason] += 1

    def _demote(self, tier: KVTier, page_id: int, expires_at: float) -> None:
        """Hand an evicted cached page to the KV tier (before it is reclaimed)."""
        found = self.prefix.entry_for_page(page_id)
        assert found is not None
        tenant, entry = found
        record = TierRecord(
            namespace=entry.namespace,
            key=entry.key,
            parent_key=entry.parent_key,
            parent_serial=entry.parent_serial,
            serial=entry.serial,
            token_ids=entry.token_ids,
            generation=self.allocator.state(page_id).generation,
            expires_at=expires_at,
        )
        policy = self._policies.get(tenant)
        tier.put(record, self.pool.page_data(page_id), None if policy is None else policy.tier_bytes)

    def evict_expired(self) -> int:
        """Evict every unreferenced cached page whose TTL has run out, and delete the KV
        tier's records whose TTL has run out. Returns the pool pages evicted."""
        now = self._clock()
        expired = self.evictable.pop_expired(now)
        for page_id in expired:
            self.prefix.remove_page(page_id)
            self.zero(self.reclaim(page_id))
        self._counters.evictions["ttl"] += len(expired)
        if self.tier is not None:
            self.tier.expire(now)
        return len(expired)

    def restore(self, table: PageTable, tokens: Sequence[int]) -> bool:
        """Bring the table's next page back from the KV tier, within the tenant's quota."""
        tier, ns = self.tier, table.namespace
        key = self.prefix.key(ns, table.chain.key, tokens)
        if tier is None or not tier.holds(ns, key):
            return False
        answer, quota_evictions = self.plan_reserve(table.tenant, 1)
        if not answer.ok:
            return False  # NOTE: the record stays in the tier for a later open
        found = tier.take(ns, key, table.chain.key, tokens, self.pool.page_bytes)
        if found is None:
            return False
        record, data = found
        self.make_room(table.tenant, 1, quota_evictions)
        ref = self.take(table, 1)[0]
        self.pool.load_page(ref.page_id, data)
        # The entry keeps its own serial while its parent is the one it was cached under,
        # so its children still in the pool stay reachable.
        serial = record.serial if record.parent_serial == table.chain.serial else None
        entry = self.prefix.insert(ns, table.chain, tokens, ref.page_id, serial)
        if entry is None or entry.page_id != ref.page_id:
            table.pages.pop()
            self.allocator.release(ref, table.tenant, table.seq_id)
            self.zero(self.reclaim(ref.page_id))
            return False
        table.chain = ChainPos(entry.key, entry.serial)
        table.num_restored_pages += 1
        return True

    def reclaim_shared(self, page_id: int) -> list[int]:
        """Free a shared page no one reads; it is zeroed unless scrubbing is off."""
        self._shared.forget_page(page_id)
        self.allocator.reclaim(page_id)
        return [page_id] if self.config.scrub_policy != "off" else []

