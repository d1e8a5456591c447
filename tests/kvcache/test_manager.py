"""KVCacheManager lifecycle: metadata contents, argument errors, stats."""

from __future__ import annotations

import pytest
import torch

from kvcache import InvalidRequest, StepEntry, UnknownSequence

from .helpers import make_manager, prefill


def test_metadata_is_flashinfer_csr() -> None:
    mgr, _ = make_manager(num_pages=16, page_size=4)
    mgr.open("a", "t", list(range(6)), use_prefix_cache=False)
    mgr.open("b", "u", list(range(9)), use_prefix_cache=False)
    mgr.allocate_slots("a", 6)  # pages 0, 1
    mgr.allocate_slots("b", 3)  # page 2
    step = mgr.begin_step([StepEntry("b", 0, 3), StepEntry("a", 0, 6)])
    m = step.metadata
    assert m.qo_indptr.tolist() == [0, 3, 9]
    assert m.kv_indptr.tolist() == [0, 1, 3]
    assert m.kv_indices.tolist() == [2, 0, 1]
    assert m.kv_last_page_len.tolist() == [3, 2]
    assert m.slot_mapping.tolist() == [8, 9, 10, 0, 1, 2, 3, 4, 5]
    assert m.qo_indptr.dtype == torch.int32 and m.slot_mapping.dtype == torch.int64
    mgr.commit("b", 3)
    mgr.allocate_slots("b", 2)  # grows into page 3
    m = mgr.begin_step([StepEntry("b", 3, 2)]).metadata
    assert m.kv_indices.tolist() == [2, 3]
    assert m.kv_last_page_len.tolist() == [1]
    assert m.slot_mapping.tolist() == [11, 12]


def test_bad_calls_raise_typed_errors() -> None:
    mgr, _ = make_manager()
    with pytest.raises(UnknownSequence):
        mgr.free("nope")
    with pytest.raises(InvalidRequest):
        mgr.open("a", "t", [])
    with pytest.raises(InvalidRequest):
        mgr.open("a", "", [1])
    mgr.open("a", "t", [1, 2, 3])
    with pytest.raises(InvalidRequest):
        mgr.open("a", "t", [1])
    with pytest.raises(InvalidRequest):
        mgr.begin_step([StepEntry("a", 0, 2)])  # no slots yet
    mgr.allocate_slots("a", 3)
    with pytest.raises(InvalidRequest):
        mgr.begin_step([StepEntry("a", 1, 2)])  # num_computed disagrees
    with pytest.raises(InvalidRequest):
        mgr.begin_step([StepEntry("a", 0, 1), StepEntry("a", 0, 1)])
    with pytest.raises(InvalidRequest):
        mgr.begin_step([])
    with pytest.raises(InvalidRequest):
        mgr.commit("a", 5)  # beyond slots and tokens
    step = mgr.begin_step([StepEntry("a", 0, 3)])
    with pytest.raises(InvalidRequest):
        step(0, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    mgr.free("a")
    with pytest.raises(UnknownSequence):
        mgr.free("a")  # a second free of the same sequence


def test_decode_loop_appends_and_caches_generated_pages() -> None:
    mgr, _ = make_manager(page_size=4)
    prefill(mgr, "a", "t", [1, 2, 3])
    for tok in (4, 5, 6):
        mgr.append_token("a", tok)
        n = len(mgr.table("a").token_ids) - 1
        mgr.allocate_slots("a", 1)
        mgr.begin_step([StepEntry("a", n, 1)])
        mgr.commit("a", n + 1)
    # tokens [1..6] computed: the first page [1,2,3,4] is cached
    assert mgr.usage("t").cached_prefixes == 1
    assert mgr.open("b", "t", [1, 2, 3, 4, 9]) == 4


def test_stats_snapshot() -> None:
    mgr, _ = make_manager(num_pages=8)
    prefill(mgr, "a", "t", list(range(10)))
    mgr.free("a")
    mgr.open("b", "t", list(range(10)))
    s = mgr.stats()
    assert (s.free_pages, s.total_pages, s.fence_violations, s.scrubs) == (6, 8, 0, 0)
    u = s.tenants["t"]
    assert (u.pages_in_use, u.pages_cached, u.cached_prefixes) == (2, 0, 2)
    assert (u.hit_tokens, u.miss_tokens) == (8, 12)
    assert u.hit_rate == pytest.approx(0.4)
    assert dict(s.evictions) == {"ttl": 0, "lru": 0, "quota": 0, "purge": 0}
