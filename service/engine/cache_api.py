"""The part of ``kvcache.KVCacheManager`` the engine uses, as a Protocol.

The engine is written against this so its dependency on kvcache is exactly these calls
(see docs/interfaces.md); ``KVCacheManager`` satisfies it structurally.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvcache.attention import AttentionFn
from kvcache.metadata import StepEntry


class TenantUsageView(Protocol):
    @property
    def max_pages(self) -> int | None: ...


class CacheManager(Protocol):
    @property
    def page_size(self) -> int: ...

    @property
    def num_pages(self) -> int: ...

    def open(
        self, seq_id: str, tenant: str, token_ids: Sequence[int], *, use_prefix_cache: bool = True
    ) -> int: ...

    def append_token(self, seq_id: str, token_id: int) -> None: ...

    def allocate_slots(self, seq_id: str, num_new_tokens: int) -> None: ...

    def begin_step(self, entries: Sequence[StepEntry]) -> AttentionFn: ...

    def commit(self, seq_id: str, num_computed: int) -> None: ...

    def free(self, seq_id: str) -> None: ...

    def evict_expired(self) -> int: ...

    def purge_tenant(self, tenant: str) -> int: ...

    def usage(self, tenant: str) -> TenantUsageView: ...

    def num_free_pages(self) -> int: ...
