"""What the engine core asks of the KV cache outside scheduling.

The scheduler alone calls the cache's scheduling API: a sequence's ``open``, its slots
(``allocate_slots``), the step's fence and attention (``begin_step``), ``commit`` and
``free``, and the prefill of an operator's shared prefix. Everything else the engine needs
of the cache, a tenant's usage, purge and policy, stats, TTL housekeeping, withdrawing a
shared prefix, goes through this narrow view, which the core holds beside the scheduler:
the scheduler forwards nothing it does not decide.
"""

from __future__ import annotations

from typing import Protocol

from kvcache.config import TenantCachePolicy
from kvcache.stats import CacheStats, TenantUsage


class CacheQueries(Protocol):
    """The cache's queries and housekeeping (``KVCacheManager`` implements them)."""

    @property
    def page_size(self) -> int: ...

    def num_free_pages(self) -> int: ...

    def evict_expired(self) -> int: ...

    def set_tenant_policy(self, tenant: str, policy: TenantCachePolicy) -> None: ...

    def usage(self, tenant: str) -> TenantUsage: ...

    def purge_tenant(self, tenant: str) -> int: ...

    def stats(self) -> CacheStats: ...

    def withdraw_shared(self, name: str) -> bool: ...
