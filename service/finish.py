"""How an engine ``Finished`` event that is not a normal stop maps to a service error."""

from __future__ import annotations

from kvcache.errors import FenceViolation, OutOfPages, QuotaExceeded
from service.engine.types import EngineStopped, Finished, RequestTooLarge
from service.errors import (
    ServiceError,
    cancelled,
    deadline_exceeded,
    fence_violation,
    internal,
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
    if isinstance(error, FenceViolation):
        return fence_violation()
    if isinstance(error, QuotaExceeded):
        return resource_exhausted(
            "max_kv_pages", f"tenant KV page quota exceeded (limit {error.limit_pages} pages)"
        )
    if isinstance(error, RequestTooLarge | OutOfPages):
        return resource_exhausted("kv_pages", str(error))
    if isinstance(error, EngineStopped):
        return unavailable("engine stopped")
    return internal()
