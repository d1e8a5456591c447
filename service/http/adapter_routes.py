"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` in vLLM's shapes:
``{"lora_name": str, "lora_path": str}`` and ``{"lora_name": str}``, answered
``{"lora_name": ..., "loaded": true}`` / ``{"lora_name": ..., "unloaded": true}``. The work
and every refusal are ``Adapters``' (``load_runtime``, ``unload_runtime``), the same as gRPC
``kvfence.v1.Adapters``; a loaded adapter then shows in the caller's ``GET /v1/models``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from service.adapters import Adapters
from service.errors import ServiceError, Violations, internal, invalid_argument
from service.http.body import BodyTooLarge, read_body
from service.http.deps import FrontDeps, tenant_of
from service.http.errors import error_response
from service.http.parse import load_body
from service.http.replies import where
from service.tenants import Tenant

MAX_BODY_BYTES = 8 * 1024  # a name and a path


def _fields(raw: bytes, names: tuple[str, ...]) -> list[str]:
    """The body's string fields ``names`` (each required); raises INVALID_ARGUMENT."""
    body: Mapping[str, Any] = load_body(raw)
    out: Violations = [(k, "unknown field") for k in sorted(body) if k not in names]
    values = []
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            out.append((name, "must be a non-empty string"))
        values.append(value if isinstance(value, str) else "")
    if out:
        raise invalid_argument(out)
    return values


class AdapterRoutes:
    def __init__(self, deps: FrontDeps, adapters: Adapters) -> None:
        self._d = deps
        self._adapters = adapters

    async def load(self, request: HttpRequest) -> Response:
        async def work(tenant: Tenant, raw: bytes) -> dict[str, Any]:
            name, path = _fields(raw, ("lora_name", "lora_path"))
            await self._adapters.load_runtime(tenant, name, path)
            return {"lora_name": name, "loaded": True}

        return await self._call(request, "LoadAdapter", work)

    async def unload(self, request: HttpRequest) -> Response:
        async def work(tenant: Tenant, raw: bytes) -> dict[str, Any]:
            [name] = _fields(raw, ("lora_name",))
            self._adapters.unload_runtime(tenant, name)
            return {"lora_name": name, "unloaded": True}

        return await self._call(request, "UnloadAdapter", work)

    async def _call(
        self, request: HttpRequest, method: str,
        work: Callable[[Tenant, bytes], Awaitable[dict[str, Any]]],
    ) -> Response:
        code, tenant_name = "OK", ""
        try:
            tenant = tenant_of(self._d, request)
            tenant_name = tenant.name
            raw = await read_body(request, MAX_BODY_BYTES)
            return JSONResponse(await work(tenant, raw))
        except ServiceError as err:
            code = err.code.name
            return error_response(err)
        except BodyTooLarge as big:
            code = big.error.code.name
            return error_response(big.error, status=413, close=True)
        except Exception as exc:
            code = "INTERNAL"
            self._d.log.error("http.failed", method=method, **where(exc))
            return error_response(internal("SERVER"))
        finally:
            label = self._d.metrics.label(tenant_name)
            self._d.metrics.requests.labels(label, method, code, "http").inc()
