"""kvcache: KV memory and everything that touches it.

Page pool, allocator with generation fences, per-tenant prefix cache, TTL/LRU eviction,
quotas, scrubbing, the operator's shared prefixes, the KV tier, attention metadata and the
paged-attention backends. No gRPC, no model.

Modules (one noun each):
- ``attention``: the AttentionFn protocol the model calls; LayerAttention, a layer's
  attention facts (its sliding window, its logit softcap) that the pool holds and every
  backend honours.
- ``dense``: contiguous single-sequence reference attention (test oracle).
- ``config``: CacheConfig, TenantCachePolicy.
- ``errors``: KVCacheError and its typed subclasses (raised only on bugs).
- ``results``: Allocation, StepPlan, PrefixHit, SharedPublish (expected outcomes, returned).
- ``pool``: PagePool (the KV tensor) and sizing helpers.
- ``allocator``: PageRef, refcounts, owners (SHARED_OWNER for shared pages), generations,
  the fence, the LRU free list.
- ``eviction``: EvictionQueue of unreferenced cached pages (LRU + TTL).
- ``prefix_cache``: per-tenant chained-HMAC prefix cache over full pages.
- ``shared_prefix``: SharedPrefixes, the operator's declared read-only prefixes.
- ``tier``: KVTier, evicted cached pages in sealed per-tenant files (off by default).
- ``tier_seal``: TierRecord and its sealing (AES-GCM per tenant, keyed file names).
- ``page_table``: one sequence's tokens and page refs.
- ``metadata``: StepEntry, AttentionMetadata (FlashInfer CSR), write_kv.
- ``step``: StepAttention, the per-step AttentionFn.
- ``graph_step``: GraphDecodeAttention, the AttentionFn of a captured CUDA-graph decode step.
- ``backends``: torch (default) and flashinfer paged attention; the C decode kernel.
- ``native_build``: builds C kernels into a private, owner-only cache and loads them.
- ``stats``: TenantUsage, CacheStats.
- ``page_store``: PageStore, page transitions: take, release, evict, scrub, tier in and out.
- ``manager``: KVCacheManager, the engine's only entry point.
"""

from kvcache.allocator import SHARED_OWNER, PageRef
from kvcache.attention import AttentionFn, LayerAttention
from kvcache.backends import AttentionBackend, TorchBackend
from kvcache.config import CacheConfig, ScrubPolicy, TenantCachePolicy
from kvcache.errors import (
    FenceViolation,
    InvalidRequest,
    KernelRefused,
    KVCacheError,
    UnknownSequence,
)
from kvcache.manager import KVCacheManager
from kvcache.metadata import AttentionMetadata, StepEntry, write_kv
from kvcache.pool import PagePool, pages_for_budget, pages_for_fraction, size_pool
from kvcache.results import Allocation, PrefixHit, SharedPublish, StepPlan
from kvcache.stats import CacheStats, TenantUsage
from kvcache.step import StepAttention
from kvcache.tier import KVTier, TierDirectoryRefused

__all__ = [
    "SHARED_OWNER",
    "Allocation",
    "AttentionBackend",
    "AttentionFn",
    "AttentionMetadata",
    "CacheConfig",
    "CacheStats",
    "FenceViolation",
    "InvalidRequest",
    "KVCacheError",
    "KVCacheManager",
    "KVTier",
    "KernelRefused",
    "LayerAttention",
    "PagePool",
    "PageRef",
    "PrefixHit",
    "ScrubPolicy",
    "SharedPublish",
    "StepAttention",
    "StepEntry",
    "StepPlan",
    "TenantCachePolicy",
    "TenantUsage",
    "TierDirectoryRefused",
    "TorchBackend",
    "UnknownSequence",
    "pages_for_budget",
    "pages_for_fraction",
    "size_pool",
    "write_kv",
]
