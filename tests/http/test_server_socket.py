"""The HTTP front's accepted connections have TCP_NODELAY.

Without it, Nagle held a response body for the client's delayed ACK: each request after the
first on a keep-alive connection took 40 ms longer. The check reads the option on the
server's side of a real connection.
"""

from __future__ import annotations

import asyncio
import socket

from starlette.types import Receive, Scope, Send

from service.http.server import HttpServer


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _nodelay_of_served_connection() -> int:
    server = HttpServer(_ok, "127.0.0.1", 0)
    port = await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        connections = list(server._server.server_state.connections)  # uvicorn's open ones
        assert len(connections) == 1
        sock = connections[0].transport.get_extra_info("socket")
        value = int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()
        await writer.wait_closed()
        return value
    finally:
        await server.stop()


def test_accepted_connections_have_tcp_nodelay() -> None:
    assert asyncio.run(_nodelay_of_served_connection()) == 1
