"""TTL expiry, LRU eviction under pressure, referenced pages never evicted, purge."""

from __future__ import annotations

import pytest

from kvcache import Allocation, TenantCachePolicy

from .helpers import grow, make_manager, prefill

PROMPT = list(range(100, 110))  # page_size 4: two full pages + a partial one
EPS = 1e-3


@pytest.mark.parametrize("ttl", [30.0, 600.0])
def test_ttl_boundary_hit_then_miss(ttl: float) -> None:
    mgr, clock = make_manager(num_pages=8, ttl=ttl)
    prefill(mgr, "a", "t", PROMPT)
    mgr.free("a")
    assert mgr.num_free_pages() == 6  # two cached pages wait in the eviction queue
    clock.advance(ttl - EPS)
    assert mgr.open("hit", "t", PROMPT) == 8
    mgr.free("hit")  # released again at ttl - eps: a fresh TTL starts now
    clock.advance(ttl + EPS)
    assert mgr.open("miss", "t", PROMPT) == 0
    mgr.free("miss")
    assert mgr.num_free_pages() == 8
    assert mgr.usage("t").cached_prefixes == 0
    assert mgr.stats().evictions["ttl"] == 2


def test_evict_expired_returns_pages_to_pool() -> None:
    mgr, clock = make_manager(num_pages=8, ttl=10.0)
    prefill(mgr, "a", "t", PROMPT)
    mgr.free("a")
    clock.advance(10.0 - EPS)
    assert mgr.evict_expired() == 0
    clock.advance(2 * EPS)
    assert mgr.evict_expired() == 2
    assert mgr.num_free_pages() == 8


def test_referenced_pages_do_not_expire() -> None:
    mgr, clock = make_manager(num_pages=8, ttl=10.0)
    prefill(mgr, "a", "t", PROMPT)
    clock.advance(1000.0)
    assert mgr.evict_expired() == 0
    assert mgr.open("b", "t", PROMPT) == 8


def test_tenant_ttl_override_and_zero_disables_caching() -> None:
    mgr, clock = make_manager(num_pages=16, ttl=600.0)
    mgr.set_tenant_policy("short", TenantCachePolicy(ttl_s=5.0))
    mgr.set_tenant_policy("none", TenantCachePolicy(ttl_s=0.0))
    for tenant in ("short", "none", "default"):
        prefill(mgr, tenant, tenant, PROMPT)
        mgr.free(tenant)
    assert mgr.usage("none").cached_prefixes == 0
    assert mgr.usage("none").pages_cached == 0
    clock.advance(5.0 + EPS)
    assert mgr.open("s2", "short", PROMPT) == 0
    assert mgr.open("n2", "none", PROMPT) == 0
    assert mgr.open("d2", "default", PROMPT) == 8


def test_lru_evicts_least_recently_released_tail_first() -> None:
    mgr, _ = make_manager(num_pages=6, ttl=600.0)
    prefill(mgr, "old", "a", PROMPT)  # pages 0,1 cached, 2 private
    mgr.free("old")
    prefill(mgr, "new", "b", PROMPT)  # pages 3,4 cached, 5 private
    mgr.free("new")
    assert mgr.num_free_pages() == 2
    # 3 pages needed: 2 free + 1 eviction: the oldest release, the tail of "old" (page 1)
    mgr.open("big", "c", list(range(12)))
    grow(mgr, "big", 12)
    assert mgr.stats().evictions["lru"] == 1
    assert mgr.open("old2", "a", PROMPT) == 4  # page 0 survived, page 1 did not
    assert mgr.open("new2", "b", PROMPT) == 8


def test_referenced_pages_are_never_evicted() -> None:
    mgr, _ = make_manager(num_pages=4)
    prefill(mgr, "a", "t", PROMPT)  # 3 pages referenced
    mgr.open("b", "u", list(range(9)))
    fit = mgr.allocate_slots("b", 9)  # needs 3, 1 free, nothing evictable
    assert fit == Allocation(False, "out_of_pages", requested=3, limit=1)
    assert not mgr.can_allocate("b", 9)
    assert mgr.sequence_pages("b") == ()
    assert mgr.num_free_pages() == 1  # nothing was allocated
    assert mgr.open("c", "t", PROMPT) == 8


def test_purge_tenant_drops_only_that_tenant() -> None:
    mgr, _ = make_manager(num_pages=16)
    prefill(mgr, "a", "t", PROMPT)
    mgr.free("a")
    prefill(mgr, "running", "t", [*PROMPT[:5], 1, 2, 3, 4, 5])  # shares page 0
    prefill(mgr, "b", "u", PROMPT)
    mgr.free("b")
    assert mgr.purge_tenant("t") == 3  # two from "a" (one now referenced) + one new
    assert mgr.usage("t").cached_prefixes == 0
    assert mgr.stats().evictions["purge"] == 1  # only the unreferenced one went back
    assert mgr.open("a2", "t", PROMPT) == 0
    assert mgr.open("b2", "u", PROMPT) == 8
    assert mgr.purge_all() == 2
    assert mgr.usage("u").cached_prefixes == 0
    mgr.free("running")  # the running sequence's pages are intact and free cleanly
    for sid in ("a2", "b2"):
        mgr.free(sid)
    assert mgr.num_free_pages() == 16
