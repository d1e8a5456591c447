"""The frame of the small authenticated JSON routes (token and adapter routes): the caller's
tenant, its body within a limit, the work, and one answer and one request count however it
ends."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from service.admission.tenants import Tenant
from service.errors import ServiceError, internal
from service.http.body import BodyTooLarge, Describe, read_body
from service.http.deps import FrontDeps, tenant_of
from service.http.error_replies import error_response
from service.http.replies import where

Work = Callable[[Tenant, bytes], Awaitable[dict[str, Any]]]
# The most body bytes a tenant's call may send, and the words past it (None: the default).
BodyLimit = Callable[[Tenant], tuple[int, Describe | None]]


async def answer_json(
    d: FrontDeps, request: HttpRequest, method: str, work: Work, limit: BodyLimit
) -> Response:
    """``work``'s JSON answer for the caller's tenant and body, or its error response."""
    code, tenant_name = "OK", ""
    try:
        tenant = tenant_of(d, request)
        tenant_name = tenant.name
        raw = await read_body(request, *limit(tenant))
        return JSONResponse(await work(tenant, raw))
    except ServiceError as err:
        code = err.code.name
        return error_response(err)
    except BodyTooLarge as big:
        code = big.error.code.name
        return error_response(big.error, status=413, close=True)
    except Exception as exc:  # a bug: 500, and nothing of the request in the log
        code = "INTERNAL"
        d.log.error("http.failed", method=method, **where(exc))
        return error_response(internal("SERVER"))
    finally:
        d.metrics.requests.labels(d.metrics.label(tenant_name), method, code, "http").inc()
