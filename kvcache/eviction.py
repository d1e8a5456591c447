"""The queue of evictable pages: cached in a prefix cache, referenced by no sequence.

Two orders over the same set: least recently released first (memory pressure and quota)
and earliest expiry first (TTL). The expiry heap is lazy; entries that no longer match the
queue are skipped when popped.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict


class EvictionQueue:
    def __init__(self) -> None:
        self._lru: OrderedDict[int, float] = OrderedDict()  # page_id -> expires_at
        self._tenant: dict[int, str] = {}
        self._by_tenant: dict[str, OrderedDict[int, None]] = {}
        self._heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, page_id: int) -> bool:
        return page_id in self._lru

    def count(self, tenant: str) -> int:
        q = self._by_tenant.get(tenant)
        return 0 if q is None else len(q)

    def page_ids(self) -> list[int]:
        return list(self._lru)

    def expires_at(self, page_id: int) -> float:
        return self._lru[page_id]

    def push(self, page_id: int, tenant: str, expires_at: float) -> None:
        """Queue a page that just became unreferenced (most recently used end)."""
        self._lru[page_id] = expires_at
        self._tenant[page_id] = tenant
        self._by_tenant.setdefault(tenant, OrderedDict())[page_id] = None
        heapq.heappush(self._heap, (expires_at, page_id))
        if len(self._heap) > 4 * len(self._lru) + 64:
            # NOTE: compact the lazy heap so re-queued pages cannot grow it without bound.
            self._heap = [(e, p) for p, e in self._lru.items()]
            heapq.heapify(self._heap)

    def remove(self, page_id: int) -> None:
        """Take a page out (it was referenced again, or is being evicted)."""
        del self._lru[page_id]
        tenant = self._tenant.pop(page_id)
        q = self._by_tenant[tenant]
        del q[page_id]
        if not q:
            del self._by_tenant[tenant]

    def oldest(self, tenant: str | None = None) -> int | None:
        """Least recently released page, globally or of one tenant."""
        if tenant is None:
            return next(iter(self._lru), None)
        q = self._by_tenant.get(tenant)
        return None if not q else next(iter(q))

    def pop_expired(self, now: float) -> list[int]:
        """Remove and return every page whose expiry is at or before ``now``."""
        out: list[int] = []
        while self._heap and self._heap[0][0] <= now:
            expires_at, page_id = heapq.heappop(self._heap)
            if self._lru.get(page_id) == expires_at:
                self.remove(page_id)
                out.append(page_id)
        if not self._lru:
            self._heap.clear()
        return out
