"""uvicorn serving the HTTP front as a task in the gRPC server's asyncio loop.

One loop means one thread hands engine events to both fronts the same way. The server's
TLS files apply here too (with a client CA, client certificates are required). Connections
are bounded by ``service.http.guard`` (descriptors, per-peer count with idle connections
making room for new ones, header, body and keep-alive time, authentication from the headers).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Generator
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from service.admission.refusal_pace import RefusalPace
from service.http.guard import Gate, HttpGuard, guarded_protocol


class _InLoopServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The kvfence process owns SIGTERM/SIGINT (drain); uvicorn must not take them.
        yield


class HttpServer:
    """``start`` binds and serves; ``stop`` closes the listener and open connections."""

    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        *,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        client_ca: Path | None = None,
        guard: HttpGuard | None = None,
        gate: Gate | None = None,
        pace: RefusalPace | None = None,
    ) -> None:
        """``gate`` and ``pace``: see ``service.http.guard`` (authentication first)."""
        guard = guard or HttpGuard()
        self.connection_cap = guard.connection_cap()
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
            http=guarded_protocol(  # type: ignore[arg-type]
                guard, self.connection_cap, gate, pace
            ),
            # GuardedHttpTools counts requests being served against guard.limit_concurrency;
            # uvicorn's own check counted idle connections too.
            limit_concurrency=None,
            ssl_certfile=str(tls_cert) if tls_cert else None,
            ssl_keyfile=str(tls_key) if tls_key else None,
            ssl_ca_certs=str(client_ca) if client_ca else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE,
            timeout_graceful_shutdown=1,
            timeout_keep_alive=30,
        )
        self._server = _InLoopServer(config)
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> int:
        """Bind (raises OSError if it cannot) and serve in the running loop; returns the port."""
        # NOTE: bound here, not by uvicorn, whose bind failure is sys.exit: that would escape
        # the task and stop the whole process's loop.
        config = self._server.config
        sock = socket.create_server((config.host, config.port), reuse_port=False)
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()
                raise OSError("HTTP front stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await self._task
        self._task = None
