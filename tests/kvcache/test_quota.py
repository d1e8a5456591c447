"""Per-tenant page quotas: own cache evicted first, then QuotaExceeded; others untouched."""

from __future__ import annotations

from kvcache import Allocation, TenantCachePolicy

from .helpers import grow, make_manager, prefill

PROMPT = list(range(100, 110))  # 3 pages at page_size 4 (2 cacheable)


def test_over_quota_evicts_own_cached_pages_first() -> None:
    mgr, _ = make_manager(num_pages=16)
    mgr.set_tenant_policy("t", TenantCachePolicy(max_pages=4))
    prefill(mgr, "a", "t", PROMPT)
    mgr.free("a")
    assert mgr.usage("t").pages_cached == 2
    prefill(mgr, "b", "t", [1] * 9)  # 3 pages: owned would be 5 > 4, evict one own page
    assert mgr.stats().evictions["quota"] == 1
    u = mgr.usage("t")
    assert (u.pages_in_use, u.pages_cached, u.max_pages) == (3, 1, 4)


def test_a_tenant_at_its_share_evicts_its_own_pages_not_older_ones_of_others() -> None:
    mgr, _ = make_manager(num_pages=16)
    mgr.set_tenant_policy("t", TenantCachePolicy(max_pages=4))
    prefill(mgr, "older", "u", PROMPT)
    mgr.free("older")  # u's 2 cached pages are the least recently used in the pool
    prefill(mgr, "a", "t", PROMPT)
    mgr.free("a")
    prefill(mgr, "b", "t", [1] * 9)  # t at its share: one of its own pages goes
    assert mgr.stats().evictions["quota"] == 1
    assert (mgr.usage("t").pages_cached, mgr.usage("u").pages_cached) == (1, 2)


def test_quota_exceeded_when_own_cache_is_not_enough() -> None:
    mgr, _ = make_manager(num_pages=16)
    mgr.set_tenant_policy("t", TenantCachePolicy(max_pages=4))
    prefill(mgr, "a", "t", PROMPT)  # 3 running pages
    mgr.open("b", "t", [1] * 9)
    assert not mgr.can_allocate("b", 9)
    fit = mgr.allocate_slots("b", 9)
    assert fit == Allocation(False, "quota", requested=6, limit=4)
    assert mgr.sequence_pages("b") == ()
    assert mgr.usage("t").pages_in_use == 3
    assert mgr.stats().evictions["quota"] == 0  # refusing evicted nothing
    grow(mgr, "b", 4)  # one page still fits
    assert len(mgr.sequence_pages("b")) == 1


def test_one_tenant_never_evicts_another_tenants_running_pages() -> None:
    mgr, _ = make_manager(num_pages=6)
    prefill(mgr, "victim", "v", PROMPT)  # 3 running pages
    victim_pages = mgr.sequence_pages("victim")
    mgr.open("greedy", "g", list(range(16)))
    assert mgr.allocate_slots("greedy", 16).reason == "out_of_pages"
    assert mgr.sequence_pages("victim") == victim_pages
    for ref in victim_pages:
        mgr.allocator.check(ref, "v", "victim")  # still valid: no generation moved


def test_quota_counts_cached_pages_of_the_tenant_only() -> None:
    mgr, _ = make_manager(num_pages=16)
    mgr.set_tenant_policy("t", TenantCachePolicy(max_pages=3))
    prefill(mgr, "other", "u", PROMPT)
    mgr.free("other")  # u's cached pages do not count against t
    prefill(mgr, "a", "t", PROMPT)
    assert mgr.usage("t").pages_in_use == 3
    assert mgr.usage("u").pages_cached == 2
