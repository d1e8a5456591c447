"""What a connection to the HTTP front may hold: descriptors, time, and pipelined requests.

uvicorn alone has no header-read timeout, no per-peer cap and no connection cap: about
20,000 TCP connections that each sent only a request line and ``Host:`` used up the
process's descriptors, and new gRPC calls (same process) failed. ``GuardedHttpTools`` is
uvicorn's httptools protocol with these rules:

- **Connections.** At most ``max_connections`` open at once (never more than what
  ``RLIMIT_NOFILE`` leaves after ``spare_fds``, halved, so gRPC, Redis, model and log files
  keep descriptors), and at most ``max_per_peer`` from one peer address. A connection past
  either cap takes the place of the oldest *idle* one (no request of it being served: it is
  still sending its headers, or waits between keep-alive requests) of that peer (or of any
  peer, for the total cap), one that never carried an authenticated request first; only
  when every connection is busy is the new one closed as soon as it is accepted. So no number
  of idle connections, from one address or from many, keeps an authenticated client out:
  behind a proxy, where every client has the proxy's address, the per-peer cap bounds what
  the proxy may hold open and its idle connections make room for its new ones.
- **Authentication first.** The tenant is checked from ``Authorization`` as soon as a
  request's headers are in (``gate``), for the routes that need one. A request it refuses is
  answered 401 after the peer's pace allows (``pace``), with ``Connection: close``: its body
  and anything pipelined behind it are never read or parsed, and no ASGI task is started.
- **Headers.** A request's headers must arrive within ``header_timeout_s`` of its first
  byte (or of the connection, for the first request); otherwise the connection is closed.
- **Body.** Once the headers are in, the body may pause at most ``body_idle_s`` between
  chunks.
- **Pipelining.** A connection with ``max_pipelined`` requests queued stops being read
  until they are answered (uvicorn would parse and queue every pipelined request at once).

- **Concurrency.** ``limit_concurrency``: with that many requests being served, a new
  request is answered 503 at once. Idle connections do not count (uvicorn's own check
  counted every open connection, so 1,024 idle ones denied every request).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http
import json
import resource
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.admission.refusal_pace import RefusalPace
from service.errors import ServiceError
from service.http.error_replies import error_body, http_status

# Routes whose requests need a tenant: refused from their headers when the key is wrong.
GATED_PATHS = frozenset({
    b"/v1/chat/completions", b"/v1/completions", b"/v1/responses", b"/v1/models",
    b"/v1/embeddings", b"/tokenize", b"/detokenize",
    b"/v1/load_lora_adapter", b"/v1/unload_lora_adapter",
})
# The ``Authorization`` values of a request -> the refusal, or None to serve it.
Gate = Callable[[list[tuple[str, str]]], ServiceError | None]


class _Refused(Exception):
    """Raised from the parser's headers callback to stop it parsing the connection."""


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
    """Open connections per peer address, and the idle ones oldest first (never
    authenticated, then authenticated), shared by one server's protocols."""

    def __init__(self) -> None:
        self.by_peer: Counter[str] = Counter()
        self.total = 0
        # (peer or "", authenticated) -> idle connections, oldest first; "" = any peer.
        self._idle: dict[tuple[str, bool], dict[GuardedHttpTools, None]] = {}

    def add(self, peer: str) -> None:
        self.by_peer[peer] += 1
        self.total += 1

    def discard(self, peer: str) -> None:
        self.total -= 1
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]

    def idle(self, conn: GuardedHttpTools, peer: str, authenticated: bool) -> None:
        self.busy(conn, peer)
        for key in ((peer, authenticated), ("", authenticated)):
            self._idle.setdefault(key, {})[conn] = None

    def busy(self, conn: GuardedHttpTools, peer: str) -> None:
        for key in ((peer, False), (peer, True), ("", False), ("", True)):
            idle = self._idle.get(key)
            if idle is not None and idle.pop(conn, 0) is None and not idle:
                del self._idle[key]

    def oldest_idle(self, peer: str = "") -> GuardedHttpTools | None:
        """The connection to close for a new one: the peer's (any peer's, for ``""``)
        oldest idle connection, one never authenticated first."""
        for authenticated in (False, True):
            idle = self._idle.get((peer, authenticated))
            if idle:
                return next(iter(idle))
        return None


def guarded_protocol(
    guard: HttpGuard, cap: int, gate: Gate | None = None, pace: RefusalPace | None = None
) -> Callable[..., HttpToolsProtocol]:
    """The protocol factory for one server (uvicorn's ``http``): its connections share one
    ``PeerCount``; ``gate`` refuses unauthenticated requests from their headers, each answer
    held per peer by ``pace``."""
    return functools.partial(
        GuardedHttpTools, guard=guard, cap=cap, peers=PeerCount(), gate=gate, pace=pace
    )


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol (the C HTTP parser), with TCP_NODELAY and the guard.

    NOTE: TCP_NODELAY: uvicorn writes a response's head and body in separate sends, and
    Nagle held the body for the client's delayed ACK: every request after the first on a
    keep-alive connection took 40 ms longer (measured: 80 ms back-to-back vs 40 over gRPC)."""

    def __init__(
        self,
        *args: Any,
        guard: HttpGuard,
        cap: int,
        peers: PeerCount,
        gate: Gate | None = None,
        pace: RefusalPace | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.guard = guard
        self.cap = cap
        self.peers = peers
        self.gate = gate
        self.pace = pace
        self._peer: str | None = None  # set once the connection is taken, until forgotten
        self._taken = False  # accepted: uvicorn sees it
        self._timer: asyncio.TimerHandle | None = None
        self._authenticated = False  # a request of it passed the gate
        self._refused = False  # answered 401 from its headers: nothing more is read
        self._held: str | None = None  # the pace key its held refusal waits on

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        if not self._make_room(peer):
            transport.abort()  # its descriptor goes back at once; nothing of it is read
            return
        self._peer = peer
        self._taken = True
        self.peers.add(peer)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        self.peers.idle(self, peer, False)
        self._arm(self.guard.header_timeout_s)

    def _make_room(self, peer: str) -> bool:
        """Whether a new connection from ``peer`` fits, closing an idle one if it must."""
        for over, of in ((self.peers.by_peer[peer] >= self.guard.max_per_peer, peer),
                         (self.peers.total >= self.cap, "")):
            if over:
                oldest = self.peers.oldest_idle(of)
                if oldest is None:
                    return False
                oldest._evict()
        return True

    def _evict(self) -> None:
        """Close this idle connection to make room for a new one; its count goes at once."""
        self._forget()
        self.transport.abort()

    def _forget(self) -> None:
        if self._peer is not None:
            self.peers.busy(self, self._peer)
            self.peers.discard(self._peer)
            self._peer = None
        self._disarm()
        if self._held is not None and self.pace is not None:
            self.pace.release(self._held)
            self._held = None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._taken:
            return  # refused in connection_made: uvicorn never saw it
        self._forget()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered from its headers: the rest is never parsed
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as err:
            if not isinstance(err.__context__, _Refused):
                self._bad_request()
        except httptools.HttpParserError:
            self._bad_request()
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        if len(self.pipeline) >= self.guard.max_pipelined and self.flow is not None:
            self.flow.pause_reading()  # uvicorn resumes reading as each response completes

    def _bad_request(self) -> None:
        """What uvicorn answers a request its parser refuses."""
        message = "Invalid HTTP request received."
        self.logger.warning(message)
        self.send_400_response(message)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.guard.header_timeout_s)

    def on_headers_complete(self) -> None:
        refusal = self._gated()
        if refusal is not None:
            self._refuse(refusal)
            raise _Refused  # stops the parser: nothing after these headers is parsed
        if self._peer is not None:
            self.peers.busy(self, self._peer)
        self._arm(self.guard.body_idle_s)
        # Only requests being served count against limit_concurrency, not open connections.
        busy = len(self.tasks) >= self.guard.limit_concurrency
        self.limit_concurrency = 0 if busy else None
        super().on_headers_complete()

    def _gated(self) -> ServiceError | None:
        """The refusal of a request that needs a tenant and names none (None: serve it). A
        request pipelined behind one still being served goes to the app like any other."""
        if self.gate is None or (self.cycle is not None and not self.cycle.response_complete):
            return None
        if httptools.parse_url(self.url).path not in GATED_PATHS:
            return None
        refusal = self.gate(
            [("authorization", v.decode("latin-1")) for n, v in self.headers
             if n == b"authorization"]
        )
        self._authenticated = self._authenticated or refusal is None
        return refusal

    def _refuse(self, err: ServiceError) -> None:
        """Answer ``err`` and close once the peer's pace allows; read nothing more."""
        self._refused = True
        self._disarm()
        if self._peer is not None:
            self.peers.busy(self, self._peer)
        self.transport.pause_reading()
        status = http_status(err)
        body = json.dumps(error_body(err)).encode()
        head = (
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        key = f"http:{self._peer}"
        wait = self.pace.hold(key) if self.pace is not None else 0.0
        if wait > 0:
            self._held = key
            self._timer = self.loop.call_later(wait, self._answer, head + body)
        else:
            self._answer(head + body)

    def _answer(self, response: bytes) -> None:
        self._timer = None
        if self._held is not None and self.pace is not None:
            self.pace.release(self._held)
            self._held = None
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        self._arm(self.guard.body_idle_s)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        idle = not self.pipeline and not self.transport.is_closing()
        if idle and self._peer is not None:
            self.peers.idle(self, self._peer, self._authenticated)

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
