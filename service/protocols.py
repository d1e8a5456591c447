"""What the service layer needs from the engine and the KV cache (structural types).

The real classes are ``service.engine.Engine`` and ``kvcache.KVCacheManager``; naming only
the methods used keeps the servicers testable and the dependency explicit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from kvcache.stats import CacheStats, TenantUsage
from service.engine.types import EngineEvent, Request


class EngineLike(Protocol):
    def submit(self, request: Request) -> AsyncIterator[EngineEvent]: ...
    def abort(self, request_id: str) -> None: ...
    def num_waiting(self) -> int: ...
    def num_running(self) -> int: ...


class CacheLike(Protocol):
    page_size: int

    def usage(self, tenant: str) -> TenantUsage: ...
    def stats(self) -> CacheStats: ...
    def purge_tenant(self, tenant: str) -> int: ...
