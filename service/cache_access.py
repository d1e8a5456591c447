"""Calls into ``KVCacheManager`` from the event loop, made safe against the engine thread.

The manager is not thread-safe. The engine thread touches it only while holding the engine
core's lock (schedule, commit, finish), so taking the same lock makes usage, stats and purge
consistent with the engine's view. Lock waits happen in a worker thread so a long engine
step never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from kvcache.stats import CacheStats, TenantUsage
from service.protocols import CacheLike

T = TypeVar("T")


class CacheAccess:
    def __init__(self, cache: CacheLike, lock: threading.Lock | threading.RLock) -> None:
        self._cache = cache
        self._lock = lock
        self.page_size: int = cache.page_size

    async def _call(self, fn: Callable[[], T]) -> T:
        def locked() -> T:
            with self._lock:
                return fn()

        return await asyncio.to_thread(locked)

    async def usage(self, tenant: str) -> TenantUsage:
        return await self._call(lambda: self._cache.usage(tenant))

    async def stats(self) -> CacheStats:
        return await self._call(self._cache.stats)

    async def purge(self, tenant: str) -> int:
        """Drop the tenant's unreferenced cached prefix pages; returns how many."""
        return await self._call(lambda: self._cache.purge_tenant(tenant))
