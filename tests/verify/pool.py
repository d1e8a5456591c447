"""Is the server back at baseline? And when did the engine free each request's pages?

Baseline means: no request state anywhere (engine sequences, waiting and running queues,
tenant stream leases) and every KV page either free or held by a tenant's prefix cache
(no page referenced by a sequence). Cached prefix pages are allowed: they are the cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.serverutil import ServerHandle


@dataclass(frozen=True, slots=True)
class PoolState:
    requests: int  # sequences the engine still knows
    waiting: int
    running: int
    leases: int  # Generate streams the limiter still counts
    pages_in_use: int  # pages referenced by sequences, all tenants
    pages_cached: int
    free_pages: int
    total_pages: int
    fence_violations: int

    @property
    def at_baseline(self) -> bool:
        return (
            self.requests == 0
            and self.waiting == 0
            and self.running == 0
            and self.leases == 0
            and self.pages_in_use == 0
            and self.free_pages + self.pages_cached == self.total_pages
        )

    def describe(self) -> str:
        return (
            f"requests={self.requests} waiting={self.waiting} running={self.running} "
            f"leases={self.leases} in_use={self.pages_in_use} cached={self.pages_cached} "
            f"free={self.free_pages}/{self.total_pages}"
        )


def pool_state(srv: ServerHandle) -> PoolState:
    engine = srv.engine
    stats = srv.stats()
    return PoolState(
        requests=engine.counters().num_requests,
        waiting=engine.num_waiting(),
        running=engine.num_running(),
        leases=srv.server.limiter.total_active(),
        pages_in_use=sum(u.pages_in_use for u in stats.tenants.values()),
        pages_cached=sum(u.pages_cached for u in stats.tenants.values()),
        free_pages=stats.free_pages,
        total_pages=stats.total_pages,
        fence_violations=stats.fence_violations,
    )


def wait_for_baseline(srv: ServerHandle, timeout: float = 10.0) -> PoolState:
    """Poll until the server is at baseline (or ``timeout``); returns the last state."""
    deadline = time.monotonic() + timeout
    state = pool_state(srv)
    while not state.at_baseline and time.monotonic() < deadline:
        time.sleep(0.005)
        state = pool_state(srv)
    return state


class FreeProbe:
    """Records when the KV cache manager frees each sequence (the engine thread calls
    ``free`` on finish, cancel, deadline and preemption). Install with ``installed``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.freed: dict[str, list[float]] = {}

    def free_after(self, request_id: str, t: float) -> float | None:
        """The first free of ``request_id`` at or after ``t``."""
        with self._lock:
            times = [x for x in self.freed.get(request_id, ()) if x >= t]
        return min(times) if times else None

    @contextmanager
    def installed(self, srv: ServerHandle) -> Iterator[FreeProbe]:
        def freed(seq_id: str) -> None:
            with self._lock:
                self.freed.setdefault(seq_id, []).append(self._clock())

        srv.engine.observe_frees(freed)
        try:
            yield self
        finally:
            srv.engine.observe_frees(None)
