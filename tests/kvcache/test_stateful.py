"""Randomised model-based test of KVCacheManager (hypothesis RuleBasedStateMachine).

100 examples x up to 150 steps (>10,000 random operations in all): open (with prefix hits), prefill
chunks, decodes, free, TTL clock, expiry, purge, quota and pool pressure, and injected
faults (double free, stale PageRef, cross-tenant use). After every step the invariants
below are checked against the manager's real state.

Refcount convention: the prefix cache holds no references. The sum of page refcounts
equals the number of page refs held in open sequences' page tables.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import (
    FenceViolation,
    OutOfPages,
    PageRef,
    QuotaExceeded,
    StepEntry,
    TenantCachePolicy,
)

from .helpers import make_manager

PAGE_SIZE = 2
NUM_PAGES = 16
TENANTS = ("t0", "t1", "t2")
MARK = {t: float(i + 1) for i, t in enumerate(TENANTS)}  # each tenant writes its own value
PREFIXES = ([1, 2, 3, 4], [1, 2, 3, 5], [7, 7, 7, 7, 7, 7])


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr, self.clock = make_manager(
            num_pages=NUM_PAGES, page_size=PAGE_SIZE, num_layers=1, head_dim=2, ttl=50.0
        )
        self.mgr.set_tenant_policy("t1", TenantCachePolicy(max_pages=8, ttl_s=20.0))
        self.mgr.set_tenant_policy("t2", TenantCachePolicy(max_pages=12))
        self.seqs: dict[str, str] = {}  # open seq id -> tenant
        self.retired: list[tuple[PageRef, str, str]] = []  # (ref, tenant, freed seq id)
        self.next_id = 0
        self.faults = 0

    # -- helpers -------------------------------------------------------------------------
    def _run(self, seq_id: str, n: int) -> None:
        table = self.mgr.table(seq_id)
        start = table.num_computed
        pages_before, free_before = len(table.pages), self.mgr.num_free_pages()
        try:
            self.mgr.allocate_slots(seq_id, n)
        except (QuotaExceeded, OutOfPages):
            assert len(table.pages) == pages_before  # all or nothing
            # nothing was taken (only expired pages may have gone back to the pool)
            assert self.mgr.num_free_pages() >= free_before
            return
        step = self.mgr.begin_step([StepEntry(seq_id, start, n)])
        kv = torch.full((n, 1, 2), MARK[table.tenant])
        out = step(0, kv.clone(), kv, kv)
        # every key this sequence reads holds its own tenant's mark
        torch.testing.assert_close(out, torch.full_like(out, MARK[table.tenant]))
        self.mgr.commit(seq_id, start + n)

    # -- rules ---------------------------------------------------------------------------
    @rule(
        tenant=st.sampled_from(TENANTS),
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 9), min_size=1, max_size=6),
        use_cache=st.booleans(),
    )
    def open_seq(self, tenant: str, prefix: list[int], suffix: list[int], use_cache: bool) -> None:
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        tokens = prefix + suffix
        cached = self.mgr.open(seq_id, tenant, tokens, use_prefix_cache=use_cache)
        assert cached % PAGE_SIZE == 0 and 0 <= cached < len(tokens)
        if not use_cache:
            assert cached == 0
        self.seqs[seq_id] = tenant

    def _work(self, seq_id: str, chunk: int, token: int) -> None:
        """Prefill the next chunk, or decode one token once the prompt is done."""
        table = self.mgr.table(seq_id)
        if table.num_computed == len(table.token_ids):
            self.mgr.append_token(seq_id, token)
        self._run(seq_id, min(chunk, len(table.token_ids) - table.num_computed))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 8), token=st.integers(0, 9))
    def work(self, data: st.DataObject, chunk: int, token: int) -> None:
        self._work(data.draw(st.sampled_from(sorted(self.seqs))), chunk, token)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 8), token=st.integers(0, 9))
    def work_more(self, data: st.DataObject, chunk: int, token: int) -> None:
        """Same as ``work``; a second rule doubles how often work is drawn."""
        self._work(data.draw(st.sampled_from(sorted(self.seqs))), chunk, token)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        tenant = self.seqs.pop(seq_id)
        refs = self.mgr.sequence_pages(seq_id)
        self.mgr.free(seq_id)
        self.retired.extend((r, tenant, seq_id) for r in refs)
        self.retired = self.retired[-40:]

    @rule(
        op=st.sampled_from(["clock", "clock", "clock", "expire", "purge"]),
        tenant=st.sampled_from(TENANTS),
        dt=st.sampled_from([1.0, 10.0, 30.0]),
    )
    def housekeeping(self, op: str, tenant: str, dt: float) -> None:
        if op == "clock":
            self.clock.advance(dt)
        elif op == "expire":
            self.mgr.evict_expired()
        else:
            self.mgr.purge_tenant(tenant)
            assert self.mgr.usage(tenant).cached_prefixes == 0

    @precondition(lambda self: self.retired)
    @rule(data=st.data())
    def fault_double_free(self, data: st.DataObject) -> None:
        ref, tenant, seq_id = data.draw(st.sampled_from(self.retired))
        before = self.mgr.allocator.state(ref.page_id)
        with pytest.raises(FenceViolation):
            self.mgr.allocator.release(ref, tenant, seq_id)
        assert self.mgr.allocator.state(ref.page_id) == before
        self.faults += 1

    @precondition(lambda self: self.retired and self.seqs)
    @rule(data=st.data())
    def fault_stale_ref(self, data: st.DataObject) -> None:
        """A retired ref spliced into a live sequence of the same tenant."""
        ref, tenant, _ = data.draw(st.sampled_from(self.retired))
        live = [s for s, t in sorted(self.seqs.items()) if t == tenant]
        if not live:
            return
        table = self.mgr.table(data.draw(st.sampled_from(live)))
        if ref in table.pages:
            return  # the same ref legitimately re-shared by this very sequence
        table.pages.append(ref)
        try:
            with pytest.raises(FenceViolation):
                self.mgr.begin_step([StepEntry(table.seq_id, table.num_computed, 1)])
        finally:
            table.pages.pop()
        self.faults += 1

    @precondition(lambda self: len(set(self.seqs.values())) >= 2)
    @rule(data=st.data())
    def fault_cross_tenant(self, data: st.DataObject) -> None:
        victim = data.draw(st.sampled_from(sorted(self.seqs)))
        refs = self.mgr.sequence_pages(victim)
        thieves = [s for s, t in sorted(self.seqs.items()) if t != self.seqs[victim]]
        if not refs:
            return
        thief = self.mgr.table(data.draw(st.sampled_from(thieves)))
        thief.pages.insert(0, data.draw(st.sampled_from(refs)))
        try:
            with pytest.raises(FenceViolation):
                self.mgr.begin_step([StepEntry(thief.seq_id, thief.num_computed, 1)])
        finally:
            thief.pages.pop(0)
        self.faults += 1

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def all_faults_detected(self) -> None:
        assert self.mgr.stats().fence_violations == self.faults

    @invariant()
    def page_accounting(self) -> None:
        alloc, prefix, evictable = self.mgr.allocator, self.mgr.prefix, self.mgr.evictable
        free = alloc.free_page_ids()
        assert len(free) == len(set(free))
        tables = self.mgr.tables()
        holders: dict[int, set[str]] = {}
        tenants_of: dict[int, set[str]] = {}
        for seq_id, table in tables.items():
            for ref in table.pages:
                holders.setdefault(ref.page_id, set()).add(seq_id)
                tenants_of.setdefault(ref.page_id, set()).add(table.tenant)
        states = [alloc.state(p) for p in range(NUM_PAGES)]
        assert sum(s.refcount for s in states) == sum(len(t.pages) for t in tables.values())
        assert all(len(ts) == 1 for ts in tenants_of.values())  # no page in two tenants
        used = 0
        for page_id, s in enumerate(states):
            assert s.holders == holders.get(page_id, set())
            cached = prefix.entry_for_page(page_id)
            if page_id in free:
                assert s.owner is None and not s.holders and cached is None
                assert page_id not in evictable
            else:
                used += 1
                assert s.owner is not None
                assert bool(s.holders) != (page_id in evictable)
                if page_id in evictable:
                    assert cached is not None
            if cached is not None:
                assert cached[0] == s.owner  # namespace tenant owns the page
            if s.holders:
                assert tenants_of[page_id] == {s.owner}
        assert used + len(free) == NUM_PAGES

    @invariant()
    def tenant_counters_and_quotas(self) -> None:
        for tenant in TENANTS:
            u = self.mgr.usage(tenant)
            owned = [p for p in range(NUM_PAGES) if self.mgr.allocator.state(p).owner == tenant]
            assert u.pages_in_use + u.pages_cached == len(owned)
            if u.max_pages is not None:
                assert len(owned) <= u.max_pages

    @invariant()
    def pages_hold_only_their_tenants_data(self) -> None:
        kv = self.mgr.pool.kv[0]
        for table in self.mgr.tables().values():
            for ref in table.pages:
                values = set(kv[ref.page_id].unique().tolist())
                assert values <= {0.0, MARK[table.tenant]}


CacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)
TestCacheMachine = CacheMachine.TestCase
