"""What the service layer needs from the engine (a structural type).

The real class is ``service.engine.Engine``; naming only the methods used keeps the
servicers testable and the dependency explicit. Everything goes through the engine's
inbox: the service never holds the KV cache.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

from service.engine import (
    EngineEvent,
    EngineStats,
    Request,
    SharedPublish,
    TenantCachePolicy,
    TenantSchedPolicy,
    TenantUsage,
)


class EngineLike(Protocol):
    page_size: int
    num_pages: int
    shared_pages: int  # of num_pages, the most the operator's shared prefixes may hold
    tier_bytes: int  # the KV tier's budget (0: no tier)

    async def submit(self, request: Request) -> AsyncGenerator[EngineEvent, None]: ...
    def abort(self, request_id: str) -> None: ...
    def charge_cpu(self, tenant: str, seconds: float) -> None: ...
    async def abort_all(self) -> int: ...
    def set_tenant_policy(
        self,
        tenant: str,
        sched: TenantSchedPolicy | None = None,
        cache: TenantCachePolicy | None = None,
    ) -> None: ...
    def publish_shared(
        self, name: str, token_ids: Sequence[int]
    ) -> concurrent.futures.Future[SharedPublish]: ...
    def withdraw_shared(self, name: str) -> concurrent.futures.Future[bool]: ...
    async def usage(self, tenant: str) -> TenantUsage: ...
    async def purge(self, tenant: str) -> int: ...
    async def stats(self) -> EngineStats: ...
    def num_waiting(self) -> int: ...
    def num_running(self) -> int: ...
