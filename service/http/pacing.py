"""Pacing of the HTTP front's cheap answers: refusals and health per peer, cheap calls per
tenant.

An answer that costs the server little still costs it something, and a client that sends
the next request as soon as it has the answer turns that into a core: pipelined wrong-key
requests (9,752/s from 4 connections), unauthenticated ``GET /health`` (17,660/s),
authenticated ``/v1/models`` and 400s each stretched another tenant's inter-token gap
tenfold. gRPC paces its refusals (``RefusalPace``); this middleware does the same for HTTP,
holding the answer (never the work of a generation) until the key's token bucket allows it:

- ``/health``, ``/metrics``, 401 and 403: keyed by the peer address (nobody is
  authenticated);
- any other 4xx, and ``/v1/models``, ``/tokenize``, ``/detokenize``: keyed by the tenant the ``Authorization`` header names,
  or by the peer when it names none.

Generations are not paced here: the tenant's limits and the fair scheduler charge them. A
held answer holds its connection, and ``HttpGuard`` caps connections per peer and in all, so
a flood's sender waits for each answer and cannot open more waiting calls than that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.admission.refusal_pace import RefusalPace
from service.admission.tenants import Tenant
from service.errors import ServiceError

Authenticate = Callable[[list[tuple[str, str]]], Tenant]
# Unauthenticated routes: paced by the peer address (``/metrics`` only with --metrics-on-http).
PEER_PACED = frozenset({"/health", "/metrics"})
# Cheap authenticated answers: paced per tenant (their token work is also charged).
TENANT_PACED = frozenset({"/v1/models", "/tokenize", "/detokenize"})


class PacedAnswers:
    """ASGI middleware holding cheap answers per ``RefusalPace.hold``."""

    def __init__(
        self, app: ASGIApp, authenticate: Authenticate, peers: RefusalPace, tenants: RefusalPace
    ) -> None:
        self._app = app
        self._authenticate = authenticate
        self._peers = peers
        self._tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def paced(message: Message) -> None:
            if message["type"] == "http.response.start":
                pace, key = self._key(scope, int(message["status"]))
                if pace is not None:
                    wait = pace.hold(key)
                    if wait > 0:
                        try:
                            await asyncio.sleep(wait)
                        finally:
                            pace.release(key)
            await send(message)

        await self._app(scope, receive, paced)

    def _key(self, scope: Scope, status: int) -> tuple[RefusalPace | None, str]:
        client = scope.get("client")
        peer = f"http:{client[0]}" if client else "http:?"
        path = scope.get("path", "")
        if path in PEER_PACED or status in (401, 403):
            return self._peers, peer
        if not (400 <= status < 500 or path in TENANT_PACED):
            return None, ""
        headers = [
            ("authorization", value.decode("latin-1"))
            for name, value in scope.get("headers", ())
            if name == b"authorization"
        ]
        try:
            tenant = self._authenticate(headers)
        except ServiceError:
            return self._peers, peer
        return self._tenants, f"tenant:{tenant.name}"
