"""KVCacheManager lifecycle: metadata contents, argument errors, stats."""

from __future__ import annotations

import pytest
import torch

from kvcache import InvalidRequest, StepEntry, UnknownSequence

from .helpers import attn_of, grow, make_manager, prefill


def test_metadata_is_flashinfer_csr() -> None:
    mgr, _ = make_manager(num_pages=16, page_size=4)
    mgr.open("a", "t", list(range(6)), use_prefix_cache=False)
    mgr.open("b", "u", list(range(9)), use_prefix_cache=False)
    grow(mgr, "a", 6)  # pages 0, 1
    grow(mgr, "b", 3)  # page 2
    step = attn_of(mgr, [StepEntry("b", 0, 3), StepEntry("a", 0, 6)])
    m = step.metadata
    assert m.qo_indptr.tolist() == [0, 3, 9]
    assert m.kv_indptr.tolist() == [0, 1, 3]
    assert m.kv_indices.tolist() == [2, 0, 1]
    assert m.kv_last_page_len.tolist() == [3, 2]
    assert m.slot_mapping.tolist() == [8, 9, 10, 0, 1, 2, 3, 4, 5]
    assert m.qo_indptr.dtype == torch.int32 and m.slot_mapping.dtype == torch.int64
    mgr.commit("b", range(9), 3)
    grow(mgr, "b", 5)  # grows into page 3
    m = attn_of(mgr, [StepEntry("b", 3, 2)]).metadata
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
        attn_of(mgr, [StepEntry("a", 0, 2)])  # no slots yet
    grow(mgr, "a", 3)
    with pytest.raises(InvalidRequest):
        attn_of(mgr, [StepEntry("a", 0, 1), StepEntry("a", 0, 1)])
    with pytest.raises(InvalidRequest):
        mgr.begin_step([])
    with pytest.raises(InvalidRequest):
        mgr.commit("a", [1, 2, 3], 5)  # beyond slots and tokens
    step = attn_of(mgr, [StepEntry("a", 0, 3)])
    with pytest.raises(InvalidRequest):
        step(0, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    mgr.free("a")
    with pytest.raises(UnknownSequence):
        mgr.free("a")  # a second free of the same sequence


def test_a_step_may_not_rewrite_prefix_cached_pages() -> None:
    """A sequence that hit the prefix cache shares those pages: a span starting inside them
    would overwrite KV other sequences read, so it is refused as a bug."""
    mgr, _ = make_manager(page_size=4)
    prefill(mgr, "first", "t", [1, 2, 3, 4, 5, 6])
    assert mgr.open("second", "t", [1, 2, 3, 4, 9]) == 4
    grow(mgr, "second", 5)
    with pytest.raises(InvalidRequest):
        attn_of(mgr, [StepEntry("second", 0, 5)])
    with pytest.raises(InvalidRequest):
        mgr.commit("second", [1, 2, 3, 4, 9], 2)  # below what the cache already holds
    attn_of(mgr, [StepEntry("second", 4, 1)])


def test_decode_loop_appends_and_caches_generated_pages() -> None:
    mgr, _ = make_manager(page_size=4)
    tokens = [1, 2, 3]
    prefill(mgr, "a", "t", tokens)
    for tok in (4, 5, 6):
        tokens.append(tok)  # the caller owns the tokens; the cache reads them at commit
        n = len(tokens) - 1
        grow(mgr, "a", n + 1)
        attn_of(mgr, [StepEntry("a", n, 1)])
        mgr.commit("a", tokens, n + 1)
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


def test_prefix_time_is_counted_only_when_the_prefix_cache_is_used() -> None:
    mgr, _ = make_manager(num_pages=8)
    prefill(mgr, "off", "t", list(range(10)), use_prefix_cache=False)
    assert mgr.stats().prefix_s == 0.0
    prefill(mgr, "on", "t", list(range(10)))
    assert mgr.stats().prefix_s > 0.0
