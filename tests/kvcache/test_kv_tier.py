"""The KV tier: evicted cached pages sealed per tenant on disk, restored through the fence
with identical bytes, refused (a miss) when altered or moved, deleted on purge and TTL,
each tenant's share evicted only by its own records."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvcache import KVCacheManager, KVTier, StepEntry, TenantCachePolicy, TierDirectoryRefused
from kvcache.prefix_cache import Namespace
from kvcache.tier_seal import TierRecord, TierSeal, associated_data, tenant_key

from .helpers import FakeClock, attn_of, grow, make_manager, page_data, prefill

PROMPT = list(range(100, 110))  # page_size 4: pages [100..103], [104..107], tail [108, 109]
TIER_SECRET = b"tier-secret-0123456789abcdef0123"


def tier_files(tier: KVTier) -> list[Path]:
    return sorted(p for p in tier.directory.iterdir() if p.is_file())


def tier_manager(
    tmp_path: Path, *, num_pages: int = 6, budget: int = 1 << 20, ttl: float = 600.0
) -> tuple[KVCacheManager, KVTier, FakeClock]:
    tier = KVTier(tmp_path / "tier", budget, TIER_SECRET)
    mgr, clock = make_manager(num_pages=num_pages, page_size=4, ttl=ttl, tier=tier)
    return mgr, tier, clock


def cache_then_push_out(mgr: KVCacheManager, tenant: str, fill: float = 3.0) -> list[torch.Tensor]:
    """``tenant`` caches PROMPT's two full pages; another tenant's load pushes them out.
    Returns the two pages' K/V as they were cached."""
    prefill(mgr, f"{tenant}-first", tenant, PROMPT, fill=fill)
    cached = [page_data(mgr, r.page_id).clone() for r in mgr.sequence_pages(f"{tenant}-first")[:2]]
    mgr.free(f"{tenant}-first")
    load = f"{tenant}-load"
    prefill(mgr, load, "load", list(range(4 * mgr.num_pages)), use_prefix_cache=False)
    mgr.free(load)
    return cached


def test_evicted_pages_come_back_with_identical_bytes_and_pass_the_fence(tmp_path: Path) -> None:
    mgr, tier, _ = tier_manager(tmp_path)
    cached = cache_then_push_out(mgr, "t")
    assert mgr.stats().evictions["lru"] == 2
    assert mgr.usage("t").cached_prefixes == 0 and mgr.usage("t").tier_prefixes == 2
    assert len(tier_files(tier)) == 2
    assert mgr.open("back", "t", PROMPT) == 8
    hit = mgr.prefix_hit("back")
    assert (hit.pool_tokens, hit.tier_tokens) == (0, 8)
    pages = mgr.sequence_pages("back")
    for ref, before in zip(pages, cached, strict=True):
        assert torch.equal(page_data(mgr, ref.page_id), before)
        assert mgr.allocator.state(ref.page_id).owner == "t"
    grow(mgr, "back", 10)
    attn_of(mgr, [StepEntry("back", 8, 2)])  # the fence passes them like any page
    assert tier_files(tier) == [] and mgr.usage("t").tier_prefixes == 0
    u = mgr.usage("t")
    assert (u.hit_tokens, u.tier_hit_tokens, u.cached_prefixes) == (8, 8, 2)
    assert mgr.stats().hit_tokens == {"pool": 0, "tier": 8, "shared": 0}


def test_quota_evictions_go_to_the_tier_too(tmp_path: Path) -> None:
    mgr, _, _ = tier_manager(tmp_path, num_pages=16)
    mgr.set_tenant_policy("t", TenantCachePolicy(max_pages=3))
    prefill(mgr, "a", "t", PROMPT, fill=2.0)
    mgr.free("a")
    prefill(mgr, "b", "t", [1] * 9)  # at its share: its own two cached pages go down
    assert mgr.stats().evictions["quota"] == 2
    assert mgr.usage("t").tier_prefixes == 2
    mgr.free("b")
    assert mgr.open("c", "t", PROMPT) == 8


def test_a_tampered_file_is_a_miss_and_counted(tmp_path: Path) -> None:
    mgr, tier, _ = tier_manager(tmp_path)
    cache_then_push_out(mgr, "t")
    first = tier.path_of(Namespace("t"), mgr.prefix.key(Namespace("t"), b"", PROMPT[:4]))
    assert first is not None
    blob = bytearray(first.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    first.write_bytes(bytes(blob))
    assert mgr.open("back", "t", PROMPT) == 0
    assert mgr.stats().tier_rejected == 1
    assert not first.exists()  # a refused record is deleted, never read again


def test_a_file_copied_into_another_tenants_name_is_a_miss(tmp_path: Path) -> None:
    mgr, tier, _ = tier_manager(tmp_path, num_pages=8)
    prefill(mgr, "a1", "alice", PROMPT, fill=5.0)
    prefill(mgr, "b1", "bob", PROMPT, fill=7.0)
    mgr.free("a1")
    mgr.free("b1")
    prefill(mgr, "load", "load", list(range(32)), use_prefix_cache=False)  # all four go down
    mgr.free("load")
    assert mgr.usage("alice").tier_prefixes == mgr.usage("bob").tier_prefixes == 2
    key = mgr.prefix.key(Namespace("alice"), b"", PROMPT[:4])
    alice = tier.path_of(Namespace("alice"), key)
    bob = tier.path_of(Namespace("bob"), mgr.prefix.key(Namespace("bob"), b"", PROMPT[:4]))
    assert alice is not None and bob is not None and alice != bob
    shutil.copyfile(alice, bob)
    os.chmod(bob, 0o600)
    assert mgr.open("b2", "bob", PROMPT) == 0
    assert mgr.stats().tier_rejected == 1
    assert mgr.open("a2", "alice", PROMPT) == 8  # alice's own record is intact


def test_purge_and_ttl_expiry_delete_tier_files(tmp_path: Path) -> None:
    mgr, tier, clock = tier_manager(tmp_path, ttl=30.0)
    cache_then_push_out(mgr, "t")
    cache_then_push_out(mgr, "u")
    assert mgr.usage("t").tier_prefixes == 2 and len(tier_files(tier)) >= 2
    assert mgr.purge_tenant("t") == 2
    assert mgr.usage("t").tier_prefixes == 0 and mgr.usage("t").tier_bytes == 0
    assert mgr.usage("u").tier_prefixes == 2
    files = tier_files(tier)
    clock.advance(30.0)
    mgr.evict_expired()
    assert tier_files(tier) == [] and files
    assert mgr.usage("u").tier_prefixes == 0
    assert mgr.open("u2", "u", PROMPT) == 0


def test_ttl_expiry_and_purge_in_the_pool_do_not_go_to_the_tier(tmp_path: Path) -> None:
    mgr, tier, clock = tier_manager(tmp_path, ttl=30.0)
    prefill(mgr, "a", "t", PROMPT)
    mgr.free("a")
    clock.advance(30.0)
    mgr.evict_expired()
    prefill(mgr, "b", "u", PROMPT)
    mgr.free("b")
    mgr.purge_tenant("u")
    assert tier_files(tier) == []
    assert mgr.stats().evictions == {"ttl": 2, "lru": 0, "quota": 0, "purge": 2}


def test_a_tenants_tier_share_evicts_only_its_own_records(tmp_path: Path) -> None:
    mgr, tier, _ = tier_manager(tmp_path, num_pages=6)
    cache_then_push_out(mgr, "big")
    record = tier.tenant_bytes("big") // 2
    mgr.set_tenant_policy("small", TenantCachePolicy(tier_bytes=record))
    cache_then_push_out(mgr, "small")
    # small's share holds one record: its second went down and pushed out its first
    assert mgr.usage("small").tier_prefixes == 1
    assert mgr.usage("small").tier_bytes <= record
    assert mgr.usage("big").tier_prefixes == 2  # never evicted for small's share
    assert mgr.usage("small").max_tier_bytes == record


def test_the_tier_budget_never_evicts_another_tenants_records(tmp_path: Path) -> None:
    (tmp_path / "probe").mkdir()
    probe, probe_tier, _ = tier_manager(tmp_path / "probe")
    cache_then_push_out(probe, "t")
    record = probe_tier.total_bytes // 2
    mgr, tier, _ = tier_manager(tmp_path, budget=3 * record)
    cache_then_push_out(mgr, "first")
    cache_then_push_out(mgr, "second")  # room for one: it evicts its own, not first's
    assert mgr.usage("first").tier_prefixes == 2
    assert mgr.usage("second").tier_prefixes == 1
    assert tier.total_bytes <= 3 * record


def test_files_are_owner_only_and_named_by_a_keyed_hash(tmp_path: Path) -> None:
    mgr, tier, _ = tier_manager(tmp_path)
    cache_then_push_out(mgr, "secret-tenant")
    assert stat.S_IMODE(os.stat(tier.directory).st_mode) == 0o700
    for path in tier_files(tier):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert "secret-tenant" not in path.name
        assert len(path.name) == 64 + 4 and path.name.endswith(".kvt")
        body = path.read_bytes()
        assert b"secret-tenant" not in body
        assert int(PROMPT[0]).to_bytes(8, "little") not in body  # token ids are sealed


def test_a_shared_or_loose_directory_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(TierDirectoryRefused):
        KVTier(loose, 1 << 20, TIER_SECRET)
    os.chmod(loose, 0o720)
    with pytest.raises(TierDirectoryRefused):
        KVTier(loose, 1 << 20, TIER_SECRET)
    link = tmp_path / "link"
    link.symlink_to(loose)
    os.chmod(loose, 0o700)
    with pytest.raises(TierDirectoryRefused):
        KVTier(link, 1 << 20, TIER_SECRET)
    narrowed = tmp_path / "readable"
    narrowed.mkdir(mode=0o755)
    KVTier(narrowed, 1 << 20, TIER_SECRET)
    assert stat.S_IMODE(narrowed.stat().st_mode) == 0o700


def test_a_new_process_starts_from_an_empty_tier(tmp_path: Path) -> None:
    mgr, tier, _ = tier_manager(tmp_path)
    cache_then_push_out(mgr, "t")
    keep = tier.directory / "operator-notes.txt"
    keep.write_text("not a tier file")
    assert len(tier_files(tier)) == 3
    again = KVTier(tier.directory, 1 << 20, TIER_SECRET)
    assert tier_files(again) == [keep]


def test_restored_pages_respect_the_tenants_quota(tmp_path: Path) -> None:
    mgr, _, _ = tier_manager(tmp_path, num_pages=8)
    cache_then_push_out(mgr, "t")
    mgr.set_tenant_policy("t", TenantCachePolicy(max_pages=1))
    assert mgr.open("back", "t", PROMPT) == 4  # one page fits its share; the next stays down
    assert mgr.usage("t").tier_prefixes == 1


def test_records_are_aes_gcm_under_the_tenants_own_key_and_bound_to_their_place() -> None:
    record = TierRecord(Namespace("alice"), b"k" * 32, b"p" * 32, 1, 2, (5, 6, 7, 8), 3, 9.5)
    seal = TierSeal(TIER_SECRET)
    blob = seal.seal(record, 7, b"kv-bytes")
    nonce, body = blob[4:16], blob[16:]
    aad = associated_data(Namespace("alice"), b"k" * 32, 7)
    AESGCM(tenant_key(TIER_SECRET, "alice")).decrypt(nonce, body, aad)  # the documented form
    with pytest.raises(InvalidTag):
        AESGCM(tenant_key(TIER_SECRET, "bob")).decrypt(nonce, body, aad)
    assert seal.open(Namespace("alice"), b"k" * 32, 7, blob) == (record, b"kv-bytes")
    for ns, key, number in (
        (Namespace("bob"), b"k" * 32, 7),  # another tenant
        (Namespace("alice", salt="s"), b"k" * 32, 7),  # another namespace of hers
        (Namespace("alice"), b"x" * 32, 7),  # another prefix
        (Namespace("alice"), b"k" * 32, 6),  # an older record put back in its place
    ):
        assert seal.open(ns, key, number, blob) is None
    assert tenant_key(TIER_SECRET, "alice") != tenant_key(b"another-secret-0123456789", "alice")


def test_a_tier_record_is_reused_only_after_its_tokens_are_compared(tmp_path: Path) -> None:
    def weak(tenant_key: bytes, parent: bytes, tokens: Sequence[int]) -> bytes:
        return b"same-key-for-every-page"

    tier = KVTier(tmp_path / "tier", 1 << 20, TIER_SECRET)
    mgr, _ = make_manager(num_pages=6, page_size=4, key_fn=weak, tier=tier)
    cache_then_push_out(mgr, "t")
    assert mgr.usage("t").tier_prefixes == 1  # one key for both pages: the last one stored
    assert mgr.open("other", "t", [9, 9, 9, 9, 9, 9, 9, 9, 9]) == 0
    assert mgr.stats().tier_rejected == 1
