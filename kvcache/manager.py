"""KVCacheManager: the only interface the engine uses to KV memory.

It ties the pieces together: the allocator (refcounts, owners, generation fences), the
per-tenant prefix cache, the eviction queue (TTL and LRU over unreferenced cached pages),
per-tenant quotas, scrubbing, and per-step attention metadata. Expected outcomes come back
as results (an ``Allocation`` that did not fit, a ``StepPlan`` with refused sequences);
exceptions mean a bug in the caller and leave nothing that matters changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from kvcache.allocator import PageAllocator, PageRef
from kvcache.backends.base import AttentionBackend
from kvcache.backends.torch_backend import TorchBackend
from kvcache.config import CacheConfig, TenantCachePolicy
from kvcache.errors import FenceViolation, InvalidRequest, UnknownSequence
from kvcache.eviction import EvictionQueue
from kvcache.metadata import SeqSpan, StepEntry, build_metadata
from kvcache.page_table import PageTable
from kvcache.pool import PagePool
from kvcache.prefix_cache import ChainPos, KeyFn, PrefixCache, chain_key
from kvcache.results import FITS, Allocation, StepPlan
from kvcache.stats import CacheStats, Counters, TenantUsage
from kvcache.step import StepAttention


class KVCacheManager:
    """Pages, prefix cache and attention metadata for every open sequence.

    Not thread-safe: the engine loop is its only caller. ``key_fn`` is a test hook that
    replaces the prefix-cache HMAC (e.g. with a weak hash to force collisions).
    """

    def __init__(
        self,
        pool: PagePool,
        config: CacheConfig,
        clock: Callable[[], float],
        backend: AttentionBackend | None = None,
        *,
        key_fn: KeyFn = chain_key,
    ) -> None:
        if pool.page_size != config.page_size:
            raise ValueError(
                f"pool page_size {pool.page_size} != config page_size {config.page_size}"
            )
        self.pool = pool
        self.config = config
        self._clock = clock
        self._backend: AttentionBackend = backend if backend is not None else TorchBackend()
        self.allocator = PageAllocator(pool.num_pages)
        self.prefix = PrefixCache(config.secret, key_fn)
        self.evictable = EvictionQueue()
        self._policies: dict[str, TenantCachePolicy] = {}
        self._tables: dict[str, PageTable] = {}
        self._counters = Counters()
        #: Test hook: called with the sequence id after every ``free`` (even a refused one).
        self.on_free: Callable[[str], None] | None = None

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def num_free_pages(self) -> int:
        return self.allocator.num_free()

    # -- policy --------------------------------------------------------------------------
    def set_tenant_policy(self, tenant: str, policy: TenantCachePolicy) -> None:
        """Quota and TTL for one tenant; applies to later allocations and releases."""
        self._policies[tenant] = policy

    def _ttl(self, tenant: str) -> float:
        p = self._policies.get(tenant)
        return self.config.default_ttl_s if p is None or p.ttl_s is None else p.ttl_s

    def _caching(self, table: PageTable) -> bool:
        return table.use_prefix_cache and table.chain_open and self._ttl(table.tenant) > 0

    def _table(self, seq_id: str) -> PageTable:
        table = self._tables.get(seq_id)
        if table is None:
            raise UnknownSequence(seq_id)
        return table

    # -- sequences -----------------------------------------------------------------------
    def open(
        self,
        seq_id: str,
        tenant: str,
        token_ids: Sequence[int],
        *,
        use_prefix_cache: bool = True,
        salt: str = "",
        adapter: str = "",
    ) -> int:
        """Register a sequence and reuse the tenant's cached full pages of its prefix that
        were cached under the same ``adapter`` identity ("" = the base model) and ``salt``
        (sub-namespaces inside the tenant's).

        At least one token is always left uncomputed (its logits are needed). Takes a
        reference on every hit page. Returns the number of cached tokens.
        """
        if seq_id in self._tables:
            raise InvalidRequest(f"sequence {seq_id!r} is already open")
        if not tenant:
            raise InvalidRequest("tenant must be non-empty")
        if not token_ids:
            raise InvalidRequest("token_ids must be non-empty")
        self.evict_expired()
        table = PageTable(seq_id, tenant, self.page_size, use_prefix_cache, salt, adapter)
        cached = 0
        if self._caching(table):
            started = time.perf_counter()
            self._self_match(table, token_ids)
            self._counters.prefix_s += time.perf_counter() - started
            table.num_cached_pages = len(table.pages)
            cached = len(table.pages) * self.page_size
            self._counters.add_lookup(tenant, cached, len(token_ids) - cached)
        self._tables[seq_id] = table
        return cached

    def _self_match(self, table: PageTable, token_ids: Sequence[int]) -> None:
        """Take refs on the tenant's cached pages of the table's prefix, in chain order."""
        tenant = table.tenant
        ns = table.namespace
        try:
            for index in range((len(token_ids) - 1) // self.page_size):
                entry = self.prefix.lookup(ns, table.chain, table.page_tokens(token_ids, index))
                if entry is None:
                    break
                # NOTE: share() is the owner check behind the key-space separation.
                ref = self.allocator.share(entry.page_id, tenant, table.seq_id)
                if entry.page_id in self.evictable:
                    self.evictable.remove(entry.page_id)
                table.pages.append(ref)
                table.chain = ChainPos(entry.key, entry.serial)
        except FenceViolation:
            expires_at = self._clock() + self._ttl(tenant)
            for ref in reversed(table.pages):  # undo: the sequence is not opened
                if self.allocator.release(ref, tenant, table.seq_id) == 0:
                    self.evictable.push(ref.page_id, tenant, expires_at)
            raise

    def num_cached_tokens(self, seq_id: str) -> int:
        """Tokens of the sequence that are in (or were served from) the prefix cache."""
        return self._table(seq_id).num_cached_pages * self.page_size

    def _plan_reserve(self, tenant: str, needed: int) -> tuple[Allocation, int]:
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

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Whether ``allocate_slots`` would fit now (counting evictable pages)."""
        table = self._table(seq_id)
        needed = table.pages_needed(num_tokens)
        return self._plan_reserve(table.tenant, needed)[0].ok

    def allocate_slots(self, seq_id: str, num_tokens: int) -> Allocation:
        """Give tokens ``[0, num_tokens)`` slots, all or nothing.

        Evicts expired, then (under quota) the tenant's own, then LRU unreferenced cached
        pages as needed. Returns ``Allocation(ok=False, reason=...)`` having allocated
        nothing when the tenant's quota or the pool cannot hold it."""
        if num_tokens < 0:
            raise InvalidRequest(f"num_tokens must be >= 0, got {num_tokens}")
        table = self._table(seq_id)
        needed = table.pages_needed(num_tokens)
        if needed == 0:
            return FITS
        self.evict_expired()
        tenant = table.tenant
        answer, quota_evictions = self._plan_reserve(tenant, needed)
        if not answer.ok:
            return answer
        for _ in range(quota_evictions):
            page_id = self.evictable.oldest(tenant)
            assert page_id is not None
            self._evict(page_id, "quota")
        while self.allocator.num_free() < needed:
            page_id = self.evictable.oldest()
            assert page_id is not None
            self._evict(page_id, "lru")
        to_scrub: list[int] = []
        for _ in range(needed):
            ref, data_owner = self.allocator.take(tenant, seq_id)
            if self.config.scrub_policy != "off" and data_owner not in (None, tenant):
                to_scrub.append(ref.page_id)
            table.pages.append(ref)
        self._zero(to_scrub)
        for ref in table.pages[-needed:]:
            self.allocator.mark_written(ref.page_id, tenant)
        return FITS

    def begin_step(self, entries: Sequence[StepEntry]) -> StepPlan:
        """Fence every page of every sequence in the batch, then build the step's metadata
        for the sequences that passed.

        A sequence with any page whose owner or generation does not match it is refused
        (with the violation, counted in ``stats().fence_violations``) and nothing of it is
        in the step. Raises only on a malformed batch (unknown or repeated sequence, a span
        that disagrees with the sequence's state).
        """
        if not entries:
            raise InvalidRequest("a step needs at least one sequence")
        spans: list[SeqSpan] = []
        passed: list[StepEntry] = []
        refused: list[tuple[StepEntry, FenceViolation]] = []
        seen: set[str] = set()
        for e in entries:
            table = self._table(e.seq_id)
            if e.seq_id in seen:
                raise InvalidRequest(f"sequence {e.seq_id!r} appears twice in one step")
            seen.add(e.seq_id)
            span = table.span(e.num_computed, e.num_new)
            try:
                for ref in table.pages:
                    self.allocator.check(ref, table.tenant, e.seq_id)
            except FenceViolation as violation:
                refused.append((e, violation))
                continue
            passed.append(e)
            spans.append(span)
        attn = None
        if spans:
            metadata = build_metadata(
                spans, self.page_size, self.pool.device, self.pool.windows, self.pool.softcaps
            )
            attn = StepAttention(metadata, self.pool, self._backend.prepare(metadata))
        return StepPlan(tuple(passed), attn, tuple(refused))

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Tokens ``[0, num_computed)`` of ``token_ids`` (the sequence's tokens, owned by the
        caller) now have KV; full pages enter the prefix cache."""
        table = self._table(seq_id)
        cached = table.num_cached_pages * self.page_size
        if not cached <= num_computed <= min(table.num_slots, len(token_ids)):
            raise InvalidRequest(
                f"commit of {num_computed} tokens for {seq_id!r} outside "
                f"[{cached}, {min(table.num_slots, len(token_ids))}]"
            )
        if not (self._caching(table) and table.num_cached_pages < num_computed // self.page_size):
            return
        started = time.perf_counter()
        while self._caching(table) and table.num_cached_pages < num_computed // self.page_size:
            index = table.num_cached_pages
            page_id = table.pages[index].page_id
            tokens = table.page_tokens(token_ids, index)
            entry = self.prefix.insert(table.namespace, table.chain, tokens, page_id)
            if entry is None:
                table.chain_open = False  # collision: stop caching this sequence's pages
                break
            table.chain = ChainPos(entry.key, entry.serial)
            table.num_cached_pages += 1
        self._counters.prefix_s += time.perf_counter() - started

    def free(self, seq_id: str) -> None:
        """Release the sequence's pages, tail first. Cached pages become evictable."""
        try:
            self._free(seq_id)
        finally:
            if self.on_free is not None:
                self.on_free(seq_id)

    def _free(self, seq_id: str) -> None:
        table = self._table(seq_id)
        del self._tables[seq_id]
        now = self._clock()
        ttl = self._ttl(table.tenant)
        to_zero: list[int] = []
        violation: FenceViolation | None = None
        for ref in reversed(table.pages):
            try:
                if self.allocator.release(ref, table.tenant, seq_id) > 0:
                    continue
            except FenceViolation as exc:
                # NOTE: keep releasing the sequence's other pages, then report.
                violation = violation or exc
                continue
            cached = self.prefix.entry_for_page(ref.page_id) is not None
            if cached and ttl > 0:
                self.evictable.push(ref.page_id, table.tenant, now + ttl)
            else:
                if cached:
                    self.prefix.remove_page(ref.page_id)
                to_zero.extend(self._reclaim(ref.page_id))
        self._zero(to_zero)
        if violation is not None:
            raise violation

    # -- eviction ------------------------------------------------------------------------
    def _reclaim(self, page_id: int) -> list[int]:
        """Return an unreferenced page to the free list; returns it if it must be zeroed."""
        self.allocator.reclaim(page_id)
        return [page_id] if self.config.scrub_policy == "always" else []

    def _zero(self, page_ids: list[int]) -> None:
        if not page_ids:
            return
        started = time.perf_counter()
        self.pool.zero_pages(page_ids)
        self._counters.scrub_s += time.perf_counter() - started
        for page_id in page_ids:
            self.allocator.mark_zeroed(page_id)
        self._counters.scrubs += len(page_ids)

    def _evict(self, page_id: int, reason: str) -> None:
        self.evictable.remove(page_id)
        self.prefix.remove_page(page_id)
        self._zero(self._reclaim(page_id))
        self._counters.evictions[reason] += 1

    def evict_expired(self) -> int:
        """Evict every unreferenced cached page whose TTL has run out."""
        expired = self.evictable.pop_expired(self._clock())
        for page_id in expired:
            self.prefix.remove_page(page_id)
            self._zero(self._reclaim(page_id))
        self._counters.evictions["ttl"] += len(expired)
        return len(expired)

    def purge_tenant(self, tenant: str) -> int:
        """Drop every prefix-cache entry of ``tenant``. Unreferenced pages return to the
        pool; pages running sequences still use stay with them, uncached. Returns the
        number of entries dropped."""
        pages = self.prefix.pages_of(tenant)
        for table in self._tables.values():
            if table.tenant == tenant:
                # NOTE: their chains point at entries being dropped; entries inserted after
                # them would be unreachable, so running sequences stop caching.
                table.chain_open = False
        for page_id in pages:
            if page_id in self.evictable:
                self._evict(page_id, "purge")
            else:
                self.prefix.remove_page(page_id)
        return len(pages)

    def purge_all(self) -> int:
        """``purge_tenant`` for every tenant; returns the entries dropped."""
        return sum(self.purge_tenant(t) for t in self.prefix.tenants())

    # -- stats ---------------------------------------------------------------------------
    def usage(self, tenant: str) -> TenantUsage:
        """The tenant's own pages and hit counters (never anything about other tenants)."""
        pages = self.allocator.tenant_pages(tenant)
        policy = self._policies.get(tenant)
        return TenantUsage(
            tenant=tenant,
            pages_in_use=pages.referenced,
            pages_cached=pages.owned - pages.referenced,
            cached_prefixes=self.prefix.num_entries(tenant),
            hit_tokens=self._counters.hit_tokens.get(tenant, 0),
            miss_tokens=self._counters.miss_tokens.get(tenant, 0),
            max_pages=None if policy is None else policy.max_pages,
        )

    def stats(self) -> CacheStats:
        """Server-wide snapshot for metrics and admin."""
        tenants = (
            set(self._counters.hit_tokens)
            | set(self.prefix.tenants())
            | {t.tenant for t in self._tables.values()}
            | set(self._policies)
        )
        return CacheStats(
            tenants={t: self.usage(t) for t in sorted(tenants)},
            evictions=dict(self._counters.evictions),
            scrubs=self._counters.scrubs,
            scrub_s=self._counters.scrub_s,
            prefix_s=self._counters.prefix_s,
            fence_violations=self.allocator.violations,
            hash_collisions=self.prefix.collisions,
            free_pages=self.allocator.num_free(),
            total_pages=self.num_pages,
            open_sequences=len(self._tables),
        )

    def table(self, seq_id: str) -> PageTable:
        """The sequence's live page table, for invariant checks in tests (read it; change
        it only through the manager or the fault-injection hooks below)."""
        return self._table(seq_id)

    def tables(self) -> Mapping[str, PageTable]:
        """Every open sequence's page table (read-only mapping; see ``table``)."""
        return MappingProxyType(self._tables)

    def sequence_pages(self, seq_id: str) -> tuple[PageRef, ...]:
        """The sequence's page refs in order (for the engine's accounting and tests)."""
        return tuple(self._table(seq_id).pages)

    # -- fault injection (documented test hooks; never called in serving) -----------------
    def inject_stale_page(self, seq_id: str, index: int = 0) -> None:
        """The sequence's page ``index`` is recycled under it (its generation moves on), so
        the next fence over it must refuse."""
        self.allocator.bump_generation(self._table(seq_id).pages[index].page_id)

    def inject_page_ref(self, seq_id: str, index: int, ref: PageRef) -> None:
        """Splice ``ref`` into the sequence's page table at ``index`` (a foreign or stale
        page), as a bookkeeping bug would; the fence must refuse it."""
        self._table(seq_id).pages[index] = ref
