"""Shared prefixes: the operator's read-only pages, read by opted-in tenants only, never
written, never evicted while declared, freed after their last reader once withdrawn."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvcache import (
    SHARED_OWNER,
    Allocation,
    InvalidRequest,
    KVCacheManager,
    SharedPublish,
    StepEntry,
    TenantCachePolicy,
)

from .helpers import attn_of, grow, make_manager, page_data, prefill, refusal

SYS = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # page_size 4: two full pages + [19, 20]
SHARED = SYS[:8]
OPTED_IN = TenantCachePolicy(shared_prefixes=frozenset({"sys"}))


def run_valued(
    mgr: KVCacheManager, seq_id: str, tokens: Sequence[int], start: int, n: int
) -> torch.Tensor:
    """Compute tokens ``[start, start + n)`` with K = V = the token id (each layer), then
    commit; returns the last layer's attention output."""
    grow(mgr, seq_id, start + n)
    step = attn_of(mgr, [StepEntry(seq_id, start, n)])
    pool = mgr.pool
    kv = torch.tensor(tokens[start : start + n], dtype=torch.float32) / 10
    kv = kv[:, None, None].expand(n, pool.num_kv_heads, pool.head_dim).contiguous()
    q = torch.ones(n, pool.num_kv_heads, pool.head_dim)
    out = torch.empty(0)
    for layer in range(pool.num_layers):
        out = step(layer, q, kv, kv)
    mgr.commit(seq_id, tokens, start + n)
    return out


def publish(mgr: KVCacheManager, name: str, tokens: Sequence[int]) -> SharedPublish:
    """Declare ``name`` and prefill it through the ordinary step path, as the engine does."""
    pub = mgr.publish_shared(name, tokens)
    assert pub.ok and pub.seq_id, pub
    run_valued(mgr, pub.seq_id, pub.token_ids, 0, len(pub.token_ids))
    mgr.free(pub.seq_id)
    return pub


def shared_manager(num_pages: int = 16, shared_pages: int = 4) -> KVCacheManager:
    mgr, _ = make_manager(num_pages=num_pages, page_size=4, shared_pages=shared_pages)
    for tenant in ("a", "b"):
        mgr.set_tenant_policy(tenant, OPTED_IN)
    publish(mgr, "sys", SYS)
    return mgr


def shared_page_ids(mgr: KVCacheManager) -> list[int]:
    return [r.page_id for r in mgr.shared.declared["sys"].pages]


def test_only_full_pages_are_shared_and_they_are_sealed_for_the_operator() -> None:
    mgr, _ = make_manager(shared_pages=4)
    pub = mgr.publish_shared("sys", SYS)
    assert pub.token_ids == tuple(SHARED)
    run_valued(mgr, pub.seq_id, pub.token_ids, 0, 8)
    with pytest.raises(InvalidRequest):  # the prefilled pages are never written again
        mgr.begin_step([StepEntry(pub.seq_id, 0, 8)])
    mgr.free(pub.seq_id)
    for page_id in shared_page_ids(mgr):
        state = mgr.allocator.state(page_id)
        assert (state.owner, state.read_only, state.holders) == (SHARED_OWNER, True, set())
    assert mgr.stats().shared_prefixes == {"sys": 2}
    assert mgr.stats().shared_pages == 2
    assert mgr.publish_shared("sys", SYS) == SharedPublish(True)  # unchanged: nothing to do
    assert mgr.publish_shared("tiny", SYS[:3]).reason == "no_full_page"


def test_an_opted_in_tenant_reads_the_shared_pages_and_gets_identical_attention() -> None:
    mgr = shared_manager()
    prompt = [*SYS, 60, 61]
    assert mgr.open("hit", "a", prompt) == 8
    assert [r.page_id for r in mgr.sequence_pages("hit")] == shared_page_ids(mgr)
    hit = mgr.prefix_hit("hit")
    assert (hit.shared_tokens, hit.pool_tokens, hit.tier_tokens, hit.shared_name) == (
        8, 0, 0, "sys",
    )
    out_hit = run_valued(mgr, "hit", prompt, 8, 4)
    # the same prompt computed privately by a tenant that did not opt in
    assert mgr.open("own", "c", prompt) == 0
    out_own = run_valued(mgr, "own", prompt, 0, 12)
    torch.testing.assert_close(out_hit, out_own[8:])
    own_pages = [r.page_id for r in mgr.sequence_pages("own")[:2]]
    for shared_page, own_page in zip(shared_page_ids(mgr), own_pages, strict=True):
        assert torch.equal(page_data(mgr, shared_page), page_data(mgr, own_page))


def test_a_tenant_that_did_not_opt_in_never_hits() -> None:
    mgr = shared_manager()
    mgr.set_tenant_policy("other", TenantCachePolicy(shared_prefixes=frozenset({"nope"})))
    assert mgr.open("c", "c", [*SYS, 1]) == 0
    assert mgr.open("o", "other", [*SYS, 1]) == 0
    assert mgr.usage("c").shared_hit_tokens == mgr.usage("other").shared_hit_tokens == 0
    assert mgr.stats().shared_hits == {}


def test_adapters_salts_and_the_bypass_flag_never_hit() -> None:
    mgr = shared_manager()
    prompt = [*SYS, 1]
    assert mgr.open("salted", "a", prompt, salt="s") == 0
    assert mgr.open("adapted", "a", prompt, adapter="lora-1") == 0
    assert mgr.open("bypass", "a", prompt, use_prefix_cache=False) == 0
    assert mgr.usage("a").shared_hit_tokens == 0
    assert mgr.open("base", "a", prompt) == 8  # the same tenant on the base model does


def test_a_prompt_hits_only_the_pages_it_shares_and_keeps_one_token() -> None:
    mgr = shared_manager()
    assert mgr.open("diverges", "a", [*SYS[:4], 99, 98, 97, 96, 95]) == 4
    assert mgr.open("exact", "a", SHARED) == 4  # one token must be computed
    assert mgr.open("short", "a", SYS[:3]) == 0
    assert mgr.stats().shared_hits == {"sys": 2}


def test_the_fence_refuses_a_write_to_a_shared_page() -> None:
    mgr = shared_manager()
    prompt = [*SYS, 60, 61]
    mgr.open("r", "a", prompt)
    grow(mgr, "r", 12)
    shared_ref = mgr.sequence_pages("r")[0]
    mgr.inject_page_ref("r", 2, shared_ref)  # a bookkeeping bug: the step would write it
    violation = refusal(mgr, StepEntry("r", 8, 4))
    assert violation.reason == "write to a read-only shared page"
    assert violation.page_id == shared_ref.page_id
    assert mgr.stats().fence_violations == 1
    written = torch.tensor(SHARED[:4], dtype=torch.float32) / 10  # K and V of tokens 11..14
    assert torch.equal(page_data(mgr, shared_ref.page_id)[..., 0, 0], written.expand(2, 2, 4))


def test_shared_pages_are_never_evicted_under_pressure() -> None:
    mgr = shared_manager(num_pages=6, shared_pages=2)
    before = {p: mgr.allocator.state(p) for p in shared_page_ids(mgr)}
    prefill(mgr, "u", "u", list(range(12)))
    mgr.free("u")  # three cached pages, evictable
    prefill(mgr, "v", "v", list(range(100, 116)))  # takes the free page and all three
    assert mgr.stats().evictions["lru"] == 3
    mgr.open("w", "w", list(range(8)))
    assert mgr.allocate_slots("w", 8) == Allocation(False, "out_of_pages", requested=2, limit=0)
    assert {p: mgr.allocator.state(p) for p in shared_page_ids(mgr)} == before
    assert mgr.open("a", "a", [*SYS, 1]) == 8


def test_shared_pages_count_against_their_own_budget_not_a_tenants_quota() -> None:
    mgr, _ = make_manager(num_pages=16, shared_pages=1)
    refused = mgr.publish_shared("sys", SYS)
    assert refused == SharedPublish(False, reason="shared_budget", requested=2, limit=1)
    assert mgr.num_free_pages() == 16 and "sys" not in mgr.shared.declared
    mgr = shared_manager()
    mgr.set_tenant_policy("a", TenantCachePolicy(max_pages=1, shared_prefixes=frozenset({"sys"})))
    assert mgr.open("r", "a", [*SYS, 1, 2]) == 8
    grow(mgr, "r", 11)  # one own page: the shared two are the operator's
    u = mgr.usage("a")
    assert (u.pages_in_use, u.pages_cached) == (1, 0)


def test_withdraw_stops_hits_at_once_and_frees_pages_after_the_last_reader() -> None:
    mgr = shared_manager()
    pages = shared_page_ids(mgr)
    generations = [mgr.allocator.state(p).generation for p in pages]
    prompt = [*SYS, 60, 61]
    assert mgr.open("reader", "a", prompt) == 8
    assert mgr.withdraw_shared("sys")
    assert not mgr.withdraw_shared("sys")
    assert mgr.open("late", "b", prompt) == 0
    assert mgr.stats().shared_prefixes == {}
    # the reader still reads them: same owner, same generation, the fence passes
    assert [mgr.allocator.state(p).generation for p in pages] == generations
    run_valued(mgr, "reader", prompt, 8, 4)
    free_before = mgr.num_free_pages()
    mgr.free("reader")
    for page_id, generation in zip(pages, generations, strict=True):
        state = mgr.allocator.state(page_id)
        assert state.owner is None and state.generation == generation + 1
        assert not state.read_only and torch.all(page_data(mgr, page_id) == 0)
        assert page_id in mgr.allocator.free_page_ids()
    assert mgr.num_free_pages() == free_before + 3  # two shared pages and its own last one
    assert mgr.stats().shared_pages == 0


def test_a_withdrawn_prefix_no_one_reads_is_freed_at_once() -> None:
    mgr = shared_manager()
    pages = shared_page_ids(mgr)
    assert mgr.withdraw_shared("sys")
    assert all(mgr.allocator.state(p).owner is None for p in pages)
    assert mgr.num_free_pages() == 16


def test_the_tenants_own_continuation_is_cached_in_its_namespace_only() -> None:
    mgr = shared_manager()
    prompt = [*SYS, 60, 61, 62, 63, 64]  # two shared pages, one own full page, a tail
    assert mgr.open("first", "a", prompt) == 8
    run_valued(mgr, "first", prompt, 8, 7)
    mgr.free("first")
    assert mgr.usage("a").cached_prefixes == 1  # its own page; the shared ones are not its
    assert mgr.open("again", "a", prompt) == 12
    hit = mgr.prefix_hit("again")
    assert (hit.shared_tokens, hit.pool_tokens) == (8, 4)
    assert mgr.open("other", "b", prompt) == 8  # b reads the shared pages, not a's
    # a's page after the shared prefix does not hang off a's root chain
    assert mgr.open("root", "a", [*SYS, 60, 61, 62, 63, 64], salt="x") == 0
    assert mgr.stats().shared_hits == {"sys": 3}
    assert mgr.stats().hit_tokens == {"pool": 4, "tier": 0, "shared": 24}
    ua = mgr.usage("a")
    assert (ua.hit_tokens, ua.shared_hit_tokens, ua.miss_tokens) == (4, 16, 7 + 13 + 5)
    mgr.free("again")
    assert mgr.withdraw_shared("sys")
    assert mgr.usage("a").cached_prefixes == 0  # continuations go with the publication


def test_replacing_the_text_moves_hits_to_the_new_pages() -> None:
    mgr = shared_manager(shared_pages=4)
    old_pages = shared_page_ids(mgr)
    new_text = [21, 22, 23, 24, 25, 26, 27, 28]
    pub = mgr.publish_shared("sys", new_text)
    assert pub.ok and pub.seq_id
    assert mgr.open("old", "a", [*SYS, 1]) == 0  # the old text stopped at once
    assert mgr.open("early", "a", [*new_text, 1]) == 0  # the new one is not prefilled yet
    run_valued(mgr, pub.seq_id, pub.token_ids, 0, 8)
    mgr.free(pub.seq_id)
    assert mgr.open("new", "a", [*new_text, 1]) == 8
    assert not set(shared_page_ids(mgr)) & set(old_pages)
    assert mgr.stats().shared_pages == 2


def test_a_prefill_freed_before_it_finished_publishes_nothing() -> None:
    mgr, _ = make_manager(shared_pages=4)
    mgr.set_tenant_policy("a", OPTED_IN)
    pub = mgr.publish_shared("sys", SYS)
    mgr.free(pub.seq_id)
    assert "sys" not in mgr.shared.declared
    assert mgr.num_free_pages() == 16 and mgr.stats().shared_pages == 0
    assert mgr.open("a", "a", [*SYS, 1]) == 0


def test_no_tenant_can_be_the_shared_owner() -> None:
    mgr = shared_manager()
    with pytest.raises(InvalidRequest):
        mgr.open("x", SHARED_OWNER, [*SYS, 1])
    assert SHARED_OWNER not in mgr.stats().tenants
