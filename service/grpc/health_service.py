"""``grpc.health.v1.Health``, the one unauthenticated service, with its streams capped.

``Check`` is one small unary call. ``Watch`` holds a stream (and a watcher entry) open for as
long as the caller likes, so anyone who can reach the port could open them without end; at
most ``max_watches`` are open at a time and the next one gets RESOURCE_EXHAUSTED. Load
balancers and orchestrators need one or two each.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service.errors import abort, resource_exhausted

DEFAULT_MAX_WATCHES = 64


class BoundedHealth(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Serves the statuses held by ``inner``; ``Watch`` streams are counted and capped."""

    def __init__(self, inner: health.aio.HealthServicer, max_watches: int) -> None:
        self._inner = inner
        self._max_watches = max_watches
        self._watching = 0  # event-loop thread only

    @property
    def watching(self) -> int:
        return self._watching

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        response: health_pb2.HealthCheckResponse = await self._inner.Check(request, context)
        return response

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        if self._watching >= self._max_watches:
            await abort(
                context,
                resource_exhausted(
                    "health_watch_streams",
                    f"{self._max_watches} health Watch streams are already open",
                    retry_after_s=5.0,
                ),
            )
        self._watching += 1
        try:
            await self._inner.Watch(request, context)
        finally:
            self._watching -= 1
