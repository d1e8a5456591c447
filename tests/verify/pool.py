"""Is the server back at baseline? And when did the engine free each request's pages?

Baseline means: no request state anywhere (engine sequences, waiting and running queues,
tenant stream leases) and every KV page in exactly one state: free, or cached (an entry of a
tenant's prefix index). No page is referenced by a sequence, and no page is owned by a tenant
without being in its prefix index: such a page is in no state (an orphan; it would never be
reused). Cached prefix pages are allowed: they are the cache.
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
    requests: int  # requests the engine still knows
    sequences: int  # sequences the KV cache still has open
    waiting: int
    running: int
    leases: int  # Generate streams the limiter still counts
    pages_in_use: int  # pages referenced by sequences, all tenants
    pages_owned_idle: int  # pages owned by a tenant and referenced by no sequence
    pages_indexed: int  # entries of the tenants' prefix indexes (one page each)
    free_pages: int
    total_pages: int
    fence_violations: int

    @property
    def at_baseline(self) -> bool:
        return (
            self.requests == 0
            and self.sequences == 0
            and self.waiting == 0
            and self.running == 0
            and self.leases == 0
            and self.pages_in_use == 0
            and self.pages_in_no_state == 0
            and self.pages_owned_idle == self.pages_indexed
        )

    @property
    def pages_in_no_state(self) -> int:
        """Pages neither free, nor referenced, nor in a prefix index (exact when no page is
        in use; negative if a page is counted in two states)."""
        return self.total_pages - self.free_pages - self.pages_in_use - self.pages_indexed

    def describe(self) -> str:
        return (
            f"requests={self.requests} sequences={self.sequences} waiting={self.waiting} running={self.running} "
            f"leases={self.leases} in_use={self.pages_in_use} free={self.free_pages} "
            f"indexed={self.pages_indexed} owned_idle={self.pages_owned_idle} "
            f"in_no_state={self.pages_in_no_state} total={self.total_pages}"
        )


def pool_state(srv: ServerHandle) -> PoolState:
    engine = srv.engine
    stats = srv.stats()
    return PoolState(
        requests=engine.counters().num_requests,
        sequences=stats.open_sequences,
        waiting=engine.num_waiting(),
        running=engine.num_running(),
        leases=srv.server.limiter.total_active(),
        pages_in_use=sum(u.pages_in_use for u in stats.tenants.values()),
        pages_owned_idle=sum(u.pages_cached for u in stats.tenants.values()),
        pages_indexed=sum(u.cached_prefixes for u in stats.tenants.values()),
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
        self._guard = threading.Lock()
        self.freed: dict[str, list[float]] = {}

    def free_after(self, request_id: str, t: float) -> float | None:
        """The first free of ``request_id`` at or after ``t``."""
        with self._guard:
            times = [x for x in self.freed.get(request_id, ()) if x >= t]
        return min(times) if times else None

    @contextmanager
    def installed(self, srv: ServerHandle) -> Iterator[FreeProbe]:
        def freed(seq_id: str) -> None:
            with self._guard:
                self.freed.setdefault(seq_id, []).append(self._clock())

        srv.engine.hooks.observe_frees(freed)
        try:
            yield self
        finally:
            srv.engine.hooks.observe_frees(None)
