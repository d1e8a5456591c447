"""Prefix cache: HMAC framing, per-tenant key spaces, salts inside them, collision safety,
opt-out."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from kvcache import FenceViolation
from kvcache.prefix_cache import (
    ChainPos,
    Namespace,
    PrefixCache,
    chain_key,
    derive_namespace_key,
    encode_tokens,
    frame,
)

from .helpers import SECRET, make_manager, page_data, prefill

PROMPT = list(range(100, 110))  # page_size 4: pages [100..103], [104..107], tail [108, 109]


def test_framing_separates_field_boundaries() -> None:
    assert b"org_1" + b"2345" == b"org_12345" + b""  # what framing must prevent
    assert frame(b"org_1", b"2345") != frame(b"org_12345", b"")
    key = hashlib.sha256(b"k").digest()
    mac = [
        hmac.new(key, frame(*f), hashlib.sha256).digest()
        for f in ((b"org_1", b"2345"), (b"org_12345", b""))
    ]
    assert mac[0] != mac[1]


def derive_tenant_key(secret: bytes, tenant: str) -> bytes:
    return derive_namespace_key(secret, Namespace(tenant))


def test_tenant_keys_differ_for_concatenation_lookalikes() -> None:
    assert derive_tenant_key(SECRET, "org_1") != derive_tenant_key(SECRET, "org_12345")
    assert derive_tenant_key(SECRET, "a") != derive_tenant_key(b"other-secret", "a")


def test_namespace_fields_are_each_framed() -> None:
    """Moving bytes between tenant, adapter and salt gives another key."""
    keys = {
        derive_namespace_key(SECRET, ns)
        for ns in (
            Namespace("t", "", "ab"),
            Namespace("t", "a", "b"),
            Namespace("ta", "", "b"),
            Namespace("tab"),
            Namespace("t", "ab"),
        )
    }
    assert len(keys) == 5


def test_two_salts_of_one_tenant_share_no_pages() -> None:
    mgr, _ = make_manager()
    assert prefill(mgr, "a", "t", PROMPT, salt="user-1") == 0
    mgr.free("a")
    assert mgr.open("b", "t", PROMPT, salt="user-2") == 0
    assert mgr.open("c", "t", PROMPT) == 0  # no salt is a namespace of its own
    assert mgr.open("d", "t", PROMPT, salt="user-1") == 8  # the same salt hits
    assert mgr.usage("t").hit_tokens == 8


def test_a_salt_never_reaches_another_tenants_pages() -> None:
    mgr, _ = make_manager()
    prefill(mgr, "a", "victim", PROMPT, salt="s")
    mgr.free("a")
    for i, salt in enumerate(("s", "", "victim", "victim\x00s")):
        assert mgr.open(f"b{i}", "attacker", PROMPT, salt=salt) == 0
    assert mgr.usage("attacker").hit_tokens == 0


def test_chain_key_depends_on_parent_and_tokens() -> None:
    tk = derive_tenant_key(SECRET, "t")
    assert chain_key(tk, b"", [1, 2]) != chain_key(tk, b"x", [1, 2])
    assert chain_key(tk, b"", [1, 2]) != chain_key(tk, b"", [2, 1])
    assert chain_key(tk, b"", [1, 2]) != chain_key(derive_tenant_key(SECRET, "u"), b"", [1, 2])
    assert frame(b"", encode_tokens([1, 2])) == (0).to_bytes(8, "big") + (16).to_bytes(
        8, "big"
    ) + encode_tokens([1, 2])


def test_chain_key_framing_separates_parent_from_tokens() -> None:
    """Unframed, (parent=K, tokens=[]) and (parent=b"", tokens=bytes of K) would collide."""
    tk = derive_tenant_key(SECRET, "t")
    parent = chain_key(tk, b"", [1, 2, 3])
    tokens = [int.from_bytes(parent[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]
    assert encode_tokens(tokens) == parent
    assert chain_key(tk, parent, []) != chain_key(tk, b"", tokens)


def test_same_tenant_hits_full_pages_and_keeps_one_token() -> None:
    mgr, _ = make_manager()
    assert prefill(mgr, "a", "t", PROMPT) == 0
    assert mgr.open("b", "t", PROMPT) == 8
    assert mgr.sequence_pages("b") == mgr.sequence_pages("a")[:2]
    # a prompt of exactly two pages reuses only the first: one token must be computed
    assert mgr.open("c", "t", PROMPT[:8]) == 4
    usage = mgr.usage("t")
    assert (usage.hit_tokens, usage.miss_tokens) == (12, 10 + 2 + 4)


def test_cross_tenant_prefix_never_hits() -> None:
    mgr, _ = make_manager()
    prefill(mgr, "a", "org_1", PROMPT)
    mgr.free("a")
    assert mgr.open("b", "org_12345", PROMPT) == 0
    assert mgr.open("c", "org_2", PROMPT) == 0
    assert mgr.usage("org_12345").hit_tokens == 0
    assert mgr.open("d", "org_1", PROMPT) == 8  # the owner still hits


def test_owner_check_backs_up_the_key_spaces() -> None:
    """If a foreign entry ever landed in a tenant's key space, share() refuses it."""
    mgr, _ = make_manager()
    prefill(mgr, "a", "victim", PROMPT)
    mgr.free("a")
    # fault injection: plant the victim's first-page entry in the attacker's key space
    entry = next(e for e in mgr.prefix.entries("victim").values() if e.parent_serial == 0)
    planted = replace(entry, namespace=Namespace("attacker"))  # passes the namespace check
    assert not mgr.prefix.entries("attacker")
    key = mgr.prefix.key(Namespace("attacker"), b"", PROMPT[:4])
    mgr.prefix.inject_entry("attacker", key, planted)
    free_before = mgr.num_free_pages()
    with pytest.raises(FenceViolation, match="another tenant"):
        mgr.open("b", "attacker", PROMPT)
    assert mgr.num_free_pages() == free_before
    assert mgr.stats().fence_violations == 1


def test_failed_match_rolls_back_pages_already_shared() -> None:
    mgr, _ = make_manager()
    prefill(mgr, "a", "victim", PROMPT)
    prefill(mgr, "b", "attacker", PROMPT)
    mgr.free("a")
    mgr.free("b")
    # fault injection: the attacker's second-page entry points at the victim's page
    victim_entry = next(e for e in mgr.prefix.entries("victim").values() if e.parent_serial)
    attacker = mgr.prefix.entries("attacker")
    second = next(k for k, e in attacker.items() if e.parent_serial)
    mgr.prefix.inject_entry("attacker", second, replace(attacker[second], page_id=victim_entry.page_id))
    with pytest.raises(FenceViolation, match="another tenant"):
        mgr.open("c", "attacker", PROMPT)
    assert mgr.usage("attacker").pages_in_use == 0  # the first page's ref was released
    assert mgr.usage("attacker").pages_cached == 2


def test_use_prefix_cache_false_neither_reads_nor_writes() -> None:
    mgr, _ = make_manager()
    prefill(mgr, "a", "t", PROMPT, use_prefix_cache=False)
    assert mgr.usage("t").cached_prefixes == 0
    prefill(mgr, "b", "t", PROMPT)
    assert mgr.open("c", "t", PROMPT, use_prefix_cache=False) == 0
    assert mgr.usage("t").hit_tokens == 0


T = Namespace("t")


def constant_key(tenant_key: bytes, parent: bytes, tokens: Sequence[int]) -> bytes:
    return b"\x00"


def test_forced_collisions_are_all_caught_by_token_comparison() -> None:
    mgr, _ = make_manager(num_pages=64, key_fn=constant_key)
    prompts = [[p] * 4 + [p + 1] * 4 + [0] for p in range(1, 30, 2)]
    for i, prompt in enumerate(prompts[:4]):
        assert prefill(mgr, f"w{i}", "t", prompt) == 0
    # Every page of every prompt maps to one key. w0 cached its page 0; its page 1 collided
    # at insert; w1..w3 collided once at lookup and once at insert: 1 + 3 * 2, none reused.
    assert mgr.stats().hash_collisions == 7
    assert mgr.usage("t").cached_prefixes == 1
    for i, prompt in enumerate(prompts):
        cached = mgr.open(f"r{i}", "t", prompt)
        assert cached == (4 if i == 0 else 0)
        for ref in mgr.sequence_pages(f"r{i}")[: cached // 4]:
            found = mgr.prefix.entry_for_page(ref.page_id)
            assert found is not None and found[1].token_ids == tuple(prompt[:4])
    # r0 collides on page 1; r1..r14 on page 0: each one detected, none reused
    assert mgr.stats().hash_collisions == 7 + 1 + (len(prompts) - 1)
    assert mgr.usage("t").hit_tokens == 4


def test_collision_on_a_child_page_cannot_splice_a_foreign_prefix() -> None:
    """Same page-1 tokens after different page-0 tokens must not hit, even if keys collide."""
    cache = PrefixCache(SECRET, constant_key)  # maximal collisions
    root = ChainPos()
    e0 = cache.insert(T, root, [1, 1], page_id=0)
    assert e0 is not None
    e1 = cache.insert(T, ChainPos(e0.key, e0.serial), [2, 2], page_id=1)
    assert e1 is None  # same key as e0, different tokens and parent: not inserted
    other_root_entry = cache.lookup(T, root, [9, 9])
    assert other_root_entry is None
    assert cache.collisions == 2


def test_a_forced_key_collision_across_salts_is_refused() -> None:
    """Same tokens, same parent, same key (the hash forced to collide): only the stored
    namespace tells the salts apart, and it does."""
    cache = PrefixCache(SECRET, constant_key)
    mine = cache.insert(Namespace("t", salt="a"), ChainPos(), [1, 1], page_id=0)
    assert mine is not None
    assert cache.lookup(Namespace("t", salt="b"), ChainPos(), [1, 1]) is None
    assert cache.insert(Namespace("t", salt="b"), ChainPos(), [1, 1], page_id=1) is None
    assert cache.lookup(Namespace("t", salt="a"), ChainPos(), [1, 1]) == mine
    assert cache.collisions == 2


def test_parent_serial_check_rejects_same_tokens_under_other_parent() -> None:
    keys: dict[tuple[int, ...], bytes] = {}

    def by_tokens(tenant_key: bytes, parent: bytes, tokens: Sequence[int]) -> bytes:
        return keys.setdefault(tuple(tokens), bytes([len(keys)]))  # ignores the parent

    cache = PrefixCache(SECRET, by_tokens)
    a0 = cache.insert(T, ChainPos(), [1], 0)
    b0 = cache.insert(T, ChainPos(), [2], 1)
    assert a0 is not None and b0 is not None
    a1 = cache.insert(T, ChainPos(a0.key, a0.serial), [3], 2)
    assert a1 is not None
    # page [3] after page [2] has the same key as after [1]; the parent check refuses it
    assert cache.lookup(T, ChainPos(b0.key, b0.serial), [3]) is None
    assert cache.lookup(T, ChainPos(a0.key, a0.serial), [3]) == a1
    assert cache.collisions == 1


def test_hit_pages_hold_the_cached_kv() -> None:
    mgr, _ = make_manager()
    prefill(mgr, "a", "t", PROMPT, fill=3.0)
    mgr.free("a")
    mgr.open("b", "t", PROMPT)
    for ref in mgr.sequence_pages("b"):
        assert torch.all(page_data(mgr, ref.page_id) == 3.0)
