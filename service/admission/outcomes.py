"""How engine outcomes other than a normal stop map to service errors: a refused
``submit`` and a ``Finished`` event with reason abort, deadline or error."""

from __future__ import annotations

from service.engine.types import (
    EngineError,
    EngineStopped,
    Finished,
    InvalidRequest,
    QueueFull,
    RequestTooLarge,
)
from service.errors import (
    ServiceError,
    cancelled,
    deadline_exceeded,
    fence_violation,
    internal,
    invalid_argument,
    resource_exhausted,
    unavailable,
)


def finish_error(event: Finished, draining: bool) -> ServiceError:
    """The status for ``abort``, ``deadline`` and ``error`` finishes (see ``service.errors``).

    An abort while the server drains is UNAVAILABLE (retry elsewhere); otherwise the client
    cancelled. The messages name no prompt or output text.
    """
    if event.reason == "deadline":
        return deadline_exceeded()
    if event.reason == "abort":
        return unavailable("server is shutting down") if draining else cancelled()
    error = event.error
    if error is None:
        return internal()
    if error.kind == "internal":
        return internal(cause=error.cause)
    if error.kind == "kv_fence":
        return fence_violation()
    return resource_exhausted("kv_pages", error.message)  # too_large


def submit_error(exc: EngineError) -> ServiceError:
    """The status for an engine that refuses a request at ``submit``."""
    if isinstance(exc, QueueFull):
        return resource_exhausted("tenant_queue", str(exc), retry_after_s=1.0)
    if isinstance(exc, RequestTooLarge):
        return resource_exhausted("max_kv_pages", str(exc))
    if isinstance(exc, EngineStopped):
        return unavailable("engine is not running")
    if isinstance(exc, InvalidRequest):
        return invalid_argument([("request", str(exc))])
    return internal()
