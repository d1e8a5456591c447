"""Debug and test hooks on one engine's KV cache, made by the factory that built the engine
(``service.engine.factory``), which holds the cache: no layer between the engine and the
cache carries them.

- ``inject_stale_page``: recycle the first page under a running request of a tenant, as a
  page that changed hands would be (the fence tests: the request must end with INTERNAL
  ``KV_FENCE`` and nothing of it read);
- ``observe_frees``: call an observer each time a sequence's pages are freed (the verify
  probes time frees).

``CoreHooks`` acts on a thread-free ``EngineCore`` directly; ``EngineHooks`` runs the same
on a threaded ``Engine``'s engine thread at a step boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcache.manager import KVCacheManager

if TYPE_CHECKING:
    from service.engine.core import EngineCore
    from service.engine.engine import Engine


class CoreHooks:
    """The hooks of ``core`` over ``cache`` (the one it was built with)."""

    def __init__(self, core: EngineCore, cache: KVCacheManager) -> None:
        self._core = core
        self._cache = cache

    def inject_stale_page(self, tenant: str, request_id: str | None = None) -> tuple[str, int]:
        """Recycle the first page under a running request of ``tenant`` (``request_id``, or
        its oldest). Returns the request's id and how many tokens it had generated."""
        seq = next(
            s
            for s in self._core.scheduler.running
            if s.tenant == tenant and request_id in (None, s.seq_id)
        )
        self._cache.inject_stale_page(seq.seq_id)
        return seq.seq_id, seq.num_output

    def observe_frees(self, observer: Callable[[str], None] | None) -> None:
        """``observer(request_id)`` after every free of a sequence's pages (finish, abort,
        deadline, preemption); None removes it."""
        self._cache.on_free = observer


class EngineHooks:
    """The hooks of a threaded ``engine`` over ``cache``, each run on its engine thread."""

    def __init__(self, engine: Engine, cache: KVCacheManager) -> None:
        self._engine = engine
        self._cache = cache

    async def inject_stale_page(self, tenant: str) -> tuple[str, int]:
        """``CoreHooks.inject_stale_page`` on the tenant's oldest running request."""
        future = self._engine.at_step_boundary(
            lambda core: CoreHooks(core, self._cache).inject_stale_page(tenant)
        )
        return await asyncio.wrap_future(future)

    def observe_frees(self, observer: Callable[[str], None] | None) -> None:
        """As ``CoreHooks.observe_frees``; blocks until the engine thread installed it."""
        self._engine.at_step_boundary(
            lambda core: CoreHooks(core, self._cache).observe_frees(observer)
        ).result()
