"""Shared builders for the kvcache tests (small tensors, injected clock)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache import CacheConfig, FenceViolation, KVCacheManager, PagePool, StepAttention, StepEntry
from kvcache.config import ScrubPolicy
from kvcache.prefix_cache import KeyFn, chain_key
from kvcache.tier import KVTier

SECRET = b"test-secret-0123456789abcdef0123"


@dataclass(slots=True)
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_manager(
    *,
    num_pages: int = 16,
    page_size: int = 4,
    num_layers: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 4,
    scrub_policy: ScrubPolicy = "reassign",
    ttl: float = 600.0,
    clock: FakeClock | None = None,
    key_fn: KeyFn = chain_key,
    shared_pages: int = 0,
    tier: KVTier | None = None,
) -> tuple[KVCacheManager, FakeClock]:
    clock = clock or FakeClock()
    pool = PagePool(num_layers, num_pages, page_size, num_kv_heads, head_dim, torch.float32, "cpu")
    config = CacheConfig(
        page_size=page_size,
        scrub_policy=scrub_policy,
        default_ttl_s=ttl,
        secret=SECRET,
        shared_pages=shared_pages,
    )
    return KVCacheManager(pool, config, clock, key_fn=key_fn, tier=tier), clock


def prefill(
    mgr: KVCacheManager,
    seq_id: str,
    tenant: str,
    tokens: Sequence[int],
    *,
    fill: float = 1.0,
    use_prefix_cache: bool = True,
    salt: str = "",
) -> int:
    """Open, allocate, run one step that writes ``fill`` as K and V in every layer, commit.
    Returns the cached token count."""
    cached = mgr.open(seq_id, tenant, tokens, use_prefix_cache=use_prefix_cache, salt=salt)
    run_tokens(mgr, seq_id, tokens, cached, len(tokens) - cached, fill)
    return cached


def grow(mgr: KVCacheManager, seq_id: str, num_tokens: int) -> None:
    """``allocate_slots`` (tokens ``[0, num_tokens)``) that must fit."""
    fit = mgr.allocate_slots(seq_id, num_tokens)
    assert fit.ok, fit


def attn_of(mgr: KVCacheManager, entries: Sequence[StepEntry]) -> StepAttention:
    """``begin_step`` whose every entry must pass the fence; returns its attention."""
    plan = mgr.begin_step(entries)
    assert not plan.refused and plan.attn is not None, plan.refused
    return plan.attn


def refusal(mgr: KVCacheManager, entry: StepEntry) -> FenceViolation:
    """``begin_step`` of one entry that the fence must refuse; returns the violation."""
    plan = mgr.begin_step([entry])
    assert plan.attn is None and not plan.entries and len(plan.refused) == 1, plan
    return plan.refused[0][1]


def run_tokens(
    mgr: KVCacheManager, seq_id: str, tokens: Sequence[int], start: int, n: int, fill: float
) -> None:
    """Compute tokens ``[start, start + n)`` of ``tokens`` writing ``fill``, then commit."""
    grow(mgr, seq_id, start + n)
    step = attn_of(mgr, [StepEntry(seq_id, start, n)])
    pool = mgr.pool
    kv = torch.full((n, pool.num_kv_heads, pool.head_dim), fill)
    for layer in range(pool.num_layers):
        step(layer, kv.clone(), kv, kv)
    mgr.commit(seq_id, tokens, start + n)


def page_data(mgr: KVCacheManager, page_id: int) -> torch.Tensor:
    """All layers' K/V of one page."""
    return mgr.pool.kv[:, page_id]
