"""The HTTP request body and the client's presence: the body read under a size limit, and
work cancelled when the client disconnects before its answer is ready."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request as HttpRequest
from starlette.types import Receive

from service.errors import invalid_argument

T = TypeVar("T")
MAX_BODY_BYTES = 8 * 1024 * 1024  # as gRPC's receive limit


async def read_body(request: HttpRequest) -> bytes:
    """The whole body; INVALID_ARGUMENT (field ``body``) past ``MAX_BODY_BYTES``, declared
    or sent."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise invalid_argument([("body", f"is larger than {MAX_BODY_BYTES} bytes")])
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise invalid_argument([("body", f"is larger than {MAX_BODY_BYTES} bytes")])
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None (``work`` cancelled) if the client disconnects first.

    With the body read, the server's next ``receive`` message is the disconnect."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if task.done():
        watch.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
