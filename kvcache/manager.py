"""KVCacheManager: the only interface the engine uses to KV memory.

It ties the pieces together: the page store (``page_store``: allocator with refcounts,
owners and generation fences, the per-tenant prefix cache, the eviction queue, scrubbing,
and the KV tier evicted pages go down to when one is given), per-tenant quotas, the
operator's shared prefixes (``shared_prefix``) and per-step attention metadata. Expected
outcomes come back as results (an ``Allocation`` that did not fit, a ``StepPlan`` with
refused sequences, a ``SharedPublish`` that did not fit); exceptions mean a bug in the
caller and leave nothing that matters changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from kvcache.allocator import SHARED_OWNER, PageRef
from kvcache.backends.base import AttentionBackend
from kvcache.backends.torch_backend import TorchBackend
from kvcache.config import CacheConfig, TenantCachePolicy
from kvcache.errors import FenceViolation, InvalidRequest, UnknownSequence
from kvcache.metadata import SeqSpan, StepEntry, build_metadata
from kvcache.page_store import PageStore
from kvcache.page_table import PageTable
from kvcache.pool import PagePool
from kvcache.prefix_cache import ChainPos, KeyFn, chain_key
from kvcache.results import FITS, Allocation, PrefixHit, SharedPublish, StepPlan
from kvcache.shared_prefix import SharedPrefix, SharedPrefixes
from kvcache.stats import CacheStats, Counters, TenantUsage
from kvcache.step import StepAttention
from kvcache.tier import KVTier


class KVCacheManager:
    """Pages, prefix cache and attention metadata for every open sequence.

    Not thread-safe: the engine loop is its only caller. ``key_fn`` is a test hook that
    replaces the prefix-cache HMAC (e.g. with a weak hash to force collisions). ``tier``:
    where evicted cached pages go (None: they are dropped).
    """

    def __init__(
        self,
        pool: PagePool,
        config: CacheConfig,
        clock: Callable[[], float],
        backend: AttentionBackend | None = None,
        *,
        key_fn: KeyFn = chain_key,
        tier: KVTier | None = None,
    ) -> None:
        if pool.page_size != config.page_size:
            raise ValueError(
                f"pool page_size {pool.page_size} != config page_size {config.page_size}"
            )
        self.pool = pool
        self.config = config
        self._clock = clock
        self._backend: AttentionBackend = backend if backend is not None else TorchBackend()
        self._policies: dict[str, TenantCachePolicy] = {}
        self._tables: dict[str, PageTable] = {}
        self._counters = Counters()
        self.shared = SharedPrefixes()
        self.pages = PageStore(
            pool,
            config,
            clock,
            key_fn,
            policies=self._policies,
            counters=self._counters,
            shared=self.shared,
            tier=tier,
        )
        # The store's parts, named here for the engine's accounting and for tests.
        self.allocator = self.pages.allocator
        self.prefix = self.pages.prefix
        self.evictable = self.pages.evictable
        self.tier = tier
        self._publications = 0
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

    def _caching(self, table: PageTable) -> bool:
        return table.use_prefix_cache and table.chain_open and self.pages.ttl(table.tenant) > 0

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
        """Register a sequence and reuse cached full pages of its prefix: first a shared
        prefix the tenant opted in to (base model and no salt only), then the tenant's own
        pages cached under the same ``adapter`` identity ("" = the base model) and ``salt``
        (sub-namespaces inside the tenant's), from the pool or else the KV tier.

        At least one token is always left uncomputed (its logits are needed). Takes a
        reference on every hit page. Returns the number of cached tokens (``prefix_hit``
        says where they came from).
        """
        if seq_id in self._tables:
            raise InvalidRequest(f"sequence {seq_id!r} is already open")
        if not tenant or tenant == SHARED_OWNER:
            raise InvalidRequest("tenant must be a tenant's name")
        if not token_ids:
            raise InvalidRequest("token_ids must be non-empty")
        self.evict_expired()
        table = PageTable(seq_id, tenant, self.page_size, use_prefix_cache, salt, adapter)
        shared = self._shared_names(table)
        if shared or self._caching(table):
            started = time.perf_counter()
            self._match(table, token_ids, shared)
            self._counters.prefix_s += time.perf_counter() - started
            table.num_cached_pages = table.num_hit_pages = len(table.pages)
            hit = self._hit(table)
            self._counters.add_lookup(
                tenant, hit.pool_tokens, hit.tier_tokens, hit.shared_tokens,
                len(token_ids) - hit.total,
            )
            if hit.shared_tokens:
                self.shared.count_hit(hit.shared_name, hit.shared_tokens)
        self._tables[seq_id] = table
        return table.num_cached_pages * self.page_size

    def _shared_names(self, table: PageTable) -> frozenset[str]:
        """The shared prefixes the sequence may read: its tenant's opt-ins, for a sequence
        that uses the prefix cache on the base model without a salt."""
        policy = self._policies.get(table.tenant)
        if policy is None or not table.use_prefix_cache or table.adapter or table.salt:
            return frozenset()
        return policy.shared_prefixes

    def _match(self, table: PageTable, token_ids: Sequence[int], shared: frozenset[str]) -> None:
        """Take refs on the cached pages of the table's prefix, in chain order; all or none."""
        max_pages = (len(token_ids) - 1) // self.page_size
        try:
            if shared:
                self._shared_match(table, token_ids, shared, max_pages)
            if self._caching(table):
                self._self_match(table, token_ids, max_pages)
        except FenceViolation:
            self.pages.zero(self.pages.release_pages(table)[0])  # undo: the sequence is not opened
            raise

    def _shared_match(
        self, table: PageTable, token_ids: Sequence[int], names: frozenset[str], max_pages: int
    ) -> None:
        hit = self.shared.match(names, token_ids, self.page_size, max_pages)
        if hit is None:
            return
        prefix = hit.prefix
        for ref in prefix.pages[: hit.num_pages]:
            table.pages.append(self.allocator.share_sealed(ref, table.seq_id))
        table.shared_name, table.shared_chain = prefix.name, prefix.chain
        table.num_shared_pages = hit.num_pages
        # NOTE: the tenant's chain runs over the shared pages' tokens in its own namespace
        # (which names the publication), so its pages after them are keyed per tenant.
        ns, pos = table.namespace, ChainPos()
        for index in range(hit.num_pages):
            key = self.prefix.key(ns, pos.key, table.page_tokens(token_ids, index))
            pos = ChainPos(key, prefix.serials[index])
        table.chain = pos

    def _self_match(self, table: PageTable, token_ids: Sequence[int], max_pages: int) -> None:
        """The tenant's own cached pages after what the table holds: from the pool, else
        restored from the KV tier."""
        ns = table.namespace
        for index in range(len(table.pages), max_pages):
            tokens = table.page_tokens(token_ids, index)
            entry = self.prefix.lookup(ns, table.chain, tokens)
            if entry is None:
                if self.pages.restore(table, tokens):
                    continue
                break
            # NOTE: share() is the owner check behind the key-space separation.
            ref = self.allocator.share(entry.page_id, table.tenant, table.seq_id)
            if entry.page_id in self.evictable:
                self.evictable.remove(entry.page_id)
            table.pages.append(ref)
            table.chain = ChainPos(entry.key, entry.serial)

    def _hit(self, table: PageTable) -> PrefixHit:
        ps = self.page_size
        own = table.num_hit_pages - table.num_shared_pages
        return PrefixHit(
            shared_tokens=table.num_shared_pages * ps,
            pool_tokens=(own - table.num_restored_pages) * ps,
            tier_tokens=table.num_restored_pages * ps,
            shared_name=table.shared_name,
        )

    def prefix_hit(self, seq_id: str) -> PrefixHit:
        """Where the open sequence's cached tokens came from (shared, pool, tier)."""
        return self._hit(self._table(seq_id))

    def num_cached_tokens(self, seq_id: str) -> int:
        """Tokens of the sequence that are in (or were served from) the prefix cache."""
        return self._table(seq_id).num_cached_pages * self.page_size

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Whether ``allocate_slots`` would fit now (counting evictable pages)."""
        table = self._table(seq_id)
        needed = table.pages_needed(num_tokens)
        return self.pages.plan_reserve(table.tenant, needed)[0].ok

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
        if table.tenant == SHARED_OWNER:
            raise InvalidRequest(f"shared prefix sequence {seq_id!r} holds all its pages")
        self.evict_expired()
        answer, quota_evictions = self.pages.plan_reserve(table.tenant, needed)
        if not answer.ok:
            return answer
        self.pages.make_room(table.tenant, needed, quota_evictions)
        self.pages.take(table, needed)
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
            first = e.num_computed // self.page_size
            last = (e.num_computed + e.num_new - 1) // self.page_size
            try:
                for index, ref in enumerate(table.pages):
                    # The pages the step writes must be writable: never a sealed shared page.
                    write = first <= index <= last
                    self.allocator.check(ref, table.tenant, e.seq_id, write=write)
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
        if table.tenant == SHARED_OWNER:
            self._seal_if_done(table, token_ids, num_computed)
            return
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
        prefill = self.shared.by_seq.pop(seq_id, None)
        if prefill is not None and not prefill.live and prefill.declared:
            self._retire_shared(self.shared.withdraw(prefill.name))  # freed unprefilled
        to_zero, violation = self.pages.release_pages(table)
        self.pages.zero(to_zero)
        if violation is not None:
            raise violation

    # -- eviction ------------------------------------------------------------------------
    def evict_expired(self) -> int:
        """Evict every unreferenced cached page whose TTL has run out, and delete the KV
        tier's records whose TTL has run out. Returns the pool pages evicted."""
        return self.pages.evict_expired()

    def purge_tenant(self, tenant: str) -> int:
        """Drop every prefix-cache entry of ``tenant``, in the pool and in the KV tier.
        Unreferenced pages return to the pool; pages running sequences still use stay with
        them, uncached. Returns the number of entries dropped."""
        pages = self.prefix.pages_of(tenant)
        for table in self._tables.values():
            if table.tenant == tenant:
                # NOTE: their chains point at entries being dropped; entries inserted after
                # them would be unreachable, so running sequences stop caching.
                table.chain_open = False
        for page_id in pages:
            if page_id in self.evictable:
                self.pages.evict(page_id, "purge")
            else:
                self.prefix.remove_page(page_id)
        in_tier = 0 if self.tier is None else self.tier.purge(tenant)
        return len(pages) + in_tier

    def purge_all(self) -> int:
        """``purge_tenant`` for every tenant; returns the entries dropped."""
        tenants = set(self.prefix.tenants())
        if self.tier is not None:
            tenants |= set(self.tier.tenants())
        return sum(self.purge_tenant(t) for t in sorted(tenants))

    # -- shared prefixes ---------------------------------------------------------------
    def publish_shared(self, name: str, token_ids: Sequence[int]) -> SharedPublish:
        """Declare the full pages of ``token_ids`` as the shared prefix ``name`` (replacing
        what ``name`` held: the old publication takes no new hits and is freed when no
        sequence reads it). Allocates the pages to the operator within
        ``CacheConfig.shared_pages`` and opens the internal sequence that prefills them
        (see :class:`SharedPublish`); tenants read them once that sequence has committed
        them all."""
        if not name:
            raise InvalidRequest("a shared prefix needs a name")
        num_pages = len(token_ids) // self.page_size
        tokens = tuple(token_ids[: num_pages * self.page_size])
        if num_pages == 0:
            return SharedPublish(False, reason="no_full_page", requested=len(token_ids))
        old = self.shared.declared.get(name)
        if old is not None and old.token_ids == tokens:
            return SharedPublish(True)
        self.evict_expired()
        # Pages the old publication gives back at once (no sequence reads them).
        back = 0 if old is None else sum(
            1 for r in old.pages if not self.allocator.state(r.page_id).holders
        )
        held = self.allocator.tenant_pages(SHARED_OWNER).owned - back
        if held + num_pages > self.config.shared_pages:
            return SharedPublish(
                False, reason="shared_budget", requested=held + num_pages,
                limit=self.config.shared_pages,
            )
        available = self.allocator.num_free() + len(self.evictable) + back
        if num_pages > available:
            return SharedPublish(
                False, reason="out_of_pages", requested=num_pages, limit=available
            )
        if old is not None:
            self._retire_shared(self.shared.withdraw(name))
        self._publications += 1
        seq_id = f"{SHARED_OWNER}:{name}#{self._publications}"
        table = PageTable(seq_id, SHARED_OWNER, self.page_size, use_prefix_cache=False)
        self.pages.make_room(SHARED_OWNER, num_pages, 0)
        self.pages.take(table, num_pages)
        self._tables[seq_id] = table
        self.shared.add(
            SharedPrefix(
                name=name,
                chain=f"{name}#{self._publications}",
                token_ids=tokens,
                seq_id=seq_id,
                pages=tuple(table.pages),
                serials=self.prefix.new_serials(num_pages),
            )
        )
        return SharedPublish(True, seq_id=seq_id, token_ids=tokens)

    def withdraw_shared(self, name: str) -> bool:
        """Stop ``name``'s hits now; its pages are scrubbed and freed once no sequence
        reads them, with every tenant's cached pages that follow it. False if ``name`` was
        not declared."""
        prefix = self.shared.withdraw(name)
        self._retire_shared(prefix)
        return prefix is not None

    def _seal_if_done(self, table: PageTable, token_ids: Sequence[int], computed: int) -> None:
        prefix = self.shared.by_seq.get(table.seq_id)
        if prefix is None or prefix.live or computed < len(prefix.token_ids):
            return
        if tuple(token_ids[: len(prefix.token_ids)]) != prefix.token_ids:
            raise InvalidRequest(f"shared prefix {prefix.name!r} prefilled with other tokens")
        for ref in prefix.pages:
            self.allocator.seal(ref.page_id)
        table.num_cached_pages = len(table.pages)  # no step may write them again
        prefix.live = prefix.declared

    def _retire_shared(self, prefix: SharedPrefix | None) -> None:
        """A publication left the declared set: its tenants' continuations go, and its
        pages no sequence holds are scrubbed and freed (the others as their readers end)."""
        if prefix is None:
            return
        for table in self._tables.values():
            if table.shared_chain == prefix.chain:
                table.chain_open = False  # its chain continues in a namespace no one reaches
        for page_id in self.prefix.pages_after_shared(prefix.chain):
            if page_id in self.evictable:
                self.pages.evict(page_id, "purge")
            else:
                self.prefix.remove_page(page_id)
        if self.tier is not None:
            self.tier.drop_shared(prefix.chain)
        to_zero: list[int] = []
        for ref in prefix.pages:
            if not self.allocator.state(ref.page_id).holders:
                to_zero.extend(self.pages.reclaim_shared(ref.page_id))
        self.pages.zero(to_zero)

    # -- stats ---------------------------------------------------------------------------
    def usage(self, tenant: str) -> TenantUsage:
        """The tenant's own pages and hit counters (never anything about other tenants)."""
        pages = self.allocator.tenant_pages(tenant)
        policy = self._policies.get(tenant)
        c = self._counters
        return TenantUsage(
            tenant=tenant,
            pages_in_use=pages.referenced,
            pages_cached=pages.owned - pages.referenced,
            cached_prefixes=self.prefix.num_entries(tenant),
            hit_tokens=c.hit_tokens.get(tenant, 0),
            miss_tokens=c.miss_tokens.get(tenant, 0),
            max_pages=None if policy is None else policy.max_pages,
            shared_hit_tokens=c.shared_hit_tokens.get(tenant, 0),
            tier_hit_tokens=c.tier_hit_tokens.get(tenant, 0),
            tier_prefixes=0 if self.tier is None else self.tier.tenant_entries(tenant),
            tier_bytes=0 if self.tier is None else self.tier.tenant_bytes(tenant),
            max_tier_bytes=None if policy is None else policy.tier_bytes,
        )

    def stats(self) -> CacheStats:
        """Server-wide snapshot for metrics and admin."""
        tenants = (
            set(self._counters.hit_tokens)
            | set(self.prefix.tenants())
            | {t.tenant for t in self._tables.values()}
            | set(self._policies)
            | set([] if self.tier is None else self.tier.tenants())
        ) - {SHARED_OWNER}
        tier = self.tier
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
            hit_tokens=dict(self._counters.by_tier),
            shared_prefixes={
                n: p.num_pages for n, p in sorted(self.shared.declared.items()) if p.live
            },
            shared_hits=dict(self.shared.hits),
            shared_pages=self.allocator.tenant_pages(SHARED_OWNER).owned,
            tier_bytes=0 if tier is None else tier.total_bytes,
            tier_rejected=0 if tier is None else tier.rejected,
            tier_dropped=0 if tier is None else tier.dropped,
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
