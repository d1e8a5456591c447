"""What a connection to the HTTP front may hold: descriptors, time, and pipelined requests.

uvicorn alone has no header-read timeout, no per-peer cap and no connection cap: about
20,000 TCP connections that each sent only a request line and ``Host:`` used up the
process's descriptors, and new gRPC calls (same process) failed. ``GuardedHttpTools`` is
uvicorn's httptools protocol with these rules:

- **Connections.** At most ``max_connections`` open at once (never more than what
  ``RLIMIT_NOFILE`` leaves after ``spare_fds``, halved, so gRPC, Redis, model and log files
  keep descriptors), and at most ``max_per_peer`` from one peer address. A connection past
  either cap is closed as soon as it is accepted, before any byte of it is read.
- **Headers.** A request's headers must arrive within ``header_timeout_s`` of its first
  byte (or of the connection, for the first request); otherwise the connection is closed.
- **Body.** Once the headers are in, the body may pause at most ``body_idle_s`` between
  chunks.
- **Pipelining.** A connection with ``max_pipelined`` requests queued stops being read
  until they are answered (uvicorn would parse and queue every pipelined request at once).

- **Concurrency.** uvicorn's ``limit_concurrency``: with that many connections or requests
  open, a request is answered 503 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import resource
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.refusal_pace import RefusalPace


@dataclass(frozen=True, slots=True)
class HttpGuard:
    """Bounds on the HTTP front's connections (``GuardedHttpTools``)."""

    header_timeout_s: float = 10.0
    body_idle_s: float = 15.0
    max_connections: int = 4096  # further capped by the descriptor limit
    max_per_peer: int = 64
    spare_fds: int = 256  # descriptors kept for everything else the process opens
    max_pipelined: int = 8
    limit_concurrency: int = 1024
    # Cheap answers (``service.http.pacing``): refusals and /health per peer, cheap calls
    # per tenant, each at this rate after a burst; one past it is held up to paced_wait_s.
    paced_per_s: float = 50.0
    paced_burst: int = 100
    paced_wait_s: float = 2.0

    def pace(self) -> RefusalPace:
        return RefusalPace(self.paced_per_s, self.paced_burst, max_wait_s=self.paced_wait_s)

    def connection_cap(self, nofile: int | None = None) -> int:
        """The connections the front accepts: ``max_connections``, or half of what the
        descriptor limit leaves after ``spare_fds`` if that is fewer (at least 1)."""
        if nofile is None:
            nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if nofile == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, (nofile - self.spare_fds) // 2))


class PeerCount:
    """Open connections per peer address, shared by one server's protocols."""

    def __init__(self) -> None:
        self.by_peer: Counter[str] = Counter()
        self.total = 0

    def add(self, peer: str) -> None:
        self.by_peer[peer] += 1
        self.total += 1

    def discard(self, peer: str) -> None:
        self.total -= 1
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]


def guarded_protocol(guard: HttpGuard, cap: int) -> Callable[..., HttpToolsProtocol]:
    """The protocol factory for one server (uvicorn's ``http``): its connections share one
    ``PeerCount``."""
    return functools.partial(GuardedHttpTools, guard=guard, cap=cap, peers=PeerCount())


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol (the C HTTP parser), with TCP_NODELAY and the guard.

    NOTE: TCP_NODELAY: uvicorn writes a response's head and body in separate sends, and
    Nagle held the body for the client's delayed ACK: every request after the first on a
    keep-alive connection took 40 ms longer (measured: 80 ms back-to-back vs 40 over gRPC)."""

    def __init__(self, *args: Any, guard: HttpGuard, cap: int, peers: PeerCount, **kw: Any):
        super().__init__(*args, **kw)
        self.guard = guard
        self.cap = cap
        self.peers = peers
        self._peer: str | None = None  # set once the connection is taken
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        if self.peers.total >= self.cap or self.peers.by_peer[peer] >= self.guard.max_per_peer:
            transport.abort()  # its descriptor goes back at once; nothing of it is read
            return
        self._peer = peer
        self.peers.add(peer)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        self._arm(self.guard.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is None:
            return  # refused in connection_made: uvicorn never saw it
        self.peers.discard(self._peer)
        self._peer = None
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if len(self.pipeline) >= self.guard.max_pipelined and self.flow is not None:
            self.flow.pause_reading()  # uvicorn resumes reading as each response completes

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.guard.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._arm(self.guard.body_idle_s)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._arm(self.guard.body_idle_s)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_slow(self) -> None:
        self._timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
