"""Allocator: generation fences, double free, cross-tenant use, LRU free order."""

from __future__ import annotations

import pytest

from kvcache import FenceViolation, PageRef, StepEntry
from kvcache.allocator import PageAllocator

from .helpers import make_manager, prefill


def test_take_bumps_generation_and_release_reclaim_bumps_again() -> None:
    alloc = PageAllocator(2)
    ref, data_owner = alloc.take("a", "s1")
    assert (ref, data_owner) == (PageRef(0, 1), None)
    assert alloc.release(ref, "a", "s1") == 0
    alloc.reclaim(0)
    assert alloc.state(0).generation == 2
    assert alloc.state(0).owner is None
    assert alloc.free_page_ids() == [1, 0]


def test_stale_ref_is_refused_after_reassignment() -> None:
    alloc = PageAllocator(1)
    old, _ = alloc.take("a", "s1")
    alloc.release(old, "a", "s1")
    alloc.reclaim(old.page_id)
    new, _ = alloc.take("a", "s1")
    assert new.page_id == old.page_id and new.generation > old.generation
    with pytest.raises(FenceViolation, match="stale generation") as exc:
        alloc.check(old, "a", "s1")
    assert exc.value.page_id == old.page_id
    with pytest.raises(FenceViolation, match="stale generation"):
        alloc.release(old, "a", "s1")
    assert alloc.state(0).refcount == 1  # the refused release changed nothing
    assert alloc.violations == 2


def test_cross_tenant_use_is_refused() -> None:
    alloc = PageAllocator(2)
    ref, _ = alloc.take("a", "s1")
    with pytest.raises(FenceViolation, match="another tenant"):
        alloc.check(ref, "b", "s1")
    with pytest.raises(FenceViolation, match="another tenant"):
        alloc.release(ref, "b", "s1")
    with pytest.raises(FenceViolation, match="another tenant"):
        alloc.share(ref.page_id, "b", "s2")
    assert alloc.state(0).holders == {"s1"}
    assert alloc.violations == 3


def test_double_free_is_refused_even_while_shared() -> None:
    alloc = PageAllocator(1)
    ref, _ = alloc.take("a", "s1")
    alloc.share(ref.page_id, "a", "s2")
    alloc.release(ref, "a", "s1")
    with pytest.raises(FenceViolation, match="double free"):
        alloc.release(ref, "a", "s1")
    with pytest.raises(FenceViolation, match="not held"):
        alloc.check(ref, "a", "s1")
    assert alloc.state(0).holders == {"s2"}
    alloc.check(ref, "a", "s2")  # the remaining holder is unaffected


def test_out_of_range_page_is_refused() -> None:
    alloc = PageAllocator(1)
    with pytest.raises(FenceViolation, match="out of range"):
        alloc.check(PageRef(7, 1), "a", "s1")


def test_free_returns_pages_tail_first() -> None:
    """vLLM-style LRU: a sequence's pages are freed in reverse, so its tail is reused first."""
    mgr, _ = make_manager(num_pages=6, page_size=2)
    prefill(mgr, "s", "a", [1, 2, 3, 4, 5], use_prefix_cache=False)
    pages = [r.page_id for r in mgr.sequence_pages("s")]
    assert pages == [0, 1, 2]
    mgr.free("s")
    assert mgr.allocator.free_page_ids() == [3, 4, 5, 2, 1, 0]


def test_begin_step_fences_every_page() -> None:
    """A page table holding another tenant's page is refused before any metadata exists."""
    mgr, _ = make_manager()
    prefill(mgr, "victim", "a", [1, 2, 3, 4, 5, 6])
    mgr.open("thief", "b", [9, 9, 9, 9, 9])
    mgr.allocate_slots("thief", 4)
    # fault injection: splice a foreign page into the table
    mgr.inject_page_ref("thief", 0, mgr.sequence_pages("victim")[0])
    with pytest.raises(FenceViolation, match="another tenant"):
        mgr.begin_step([StepEntry("thief", 0, 4)])
    assert mgr.stats().fence_violations == 1


def test_begin_step_refuses_pages_of_a_same_tenant_sequence() -> None:
    mgr, _ = make_manager()
    prefill(mgr, "one", "a", [1, 2, 3, 4, 5, 6])
    mgr.open("two", "a", [7, 7, 7])
    mgr.allocate_slots("two", 3)
    mgr.inject_page_ref("two", 0, mgr.sequence_pages("one")[1])  # unshared page of "one"
    with pytest.raises(FenceViolation, match="not held"):
        mgr.begin_step([StepEntry("two", 0, 3)])


def test_begin_step_refuses_stale_refs() -> None:
    mgr, _ = make_manager(num_pages=4)
    prefill(mgr, "s", "a", [1, 2, 3], use_prefix_cache=False)
    stale = mgr.sequence_pages("s")[0]
    mgr.free("s")
    mgr.open("s2", "a", [1, 2, 3], use_prefix_cache=False)
    mgr.allocate_slots("s2", 3)
    mgr.inject_page_ref("s2", 0, stale)  # fault injection: a ref from the page's last life
    with pytest.raises(FenceViolation, match="stale generation"):
        mgr.begin_step([StepEntry("s2", 0, 3)])
