"""The HTTP request body, read under a size limit."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from starlette.requests import Request as HttpRequest

from service.errors import ServiceError, invalid_argument

Describe = Callable[[int], str]

T = TypeVar("T")
MAX_BODY_BYTES = 8 * 1024 * 1024  # as gRPC's receive limit


class BodyTooLarge(Exception):
    """A body past its limit, declared or sent: answered 413 (``error`` names ``body`` and
    the limit) and the connection closed, the rest of the body unread."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


async def read_body(
    request: HttpRequest, limit: int = MAX_BODY_BYTES, describe: Describe | None = None
) -> bytes:
    """The whole body; ``BodyTooLarge`` past ``limit`` bytes, judged from
    ``Content-Length`` before any byte is read, then from the bytes as they arrive.
    ``describe(size)`` words the violation (``size``: the bytes declared or seen so far)."""

    def too_large(size: int) -> BodyTooLarge:
        text = describe(size) if describe is not None else f"is larger than {limit} bytes"
        return BodyTooLarge(invalid_argument([("body", text)]))

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size)
        chunks.append(chunk)
    return b"".join(chunks)
