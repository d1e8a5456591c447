"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` in vLLM's shapes:
``{"lora_name": str, "lora_path": str}`` and ``{"lora_name": str}``, answered
``{"lora_name": ..., "loaded": true}`` / ``{"lora_name": ..., "unloaded": true}``. The work
and every refusal are ``Adapters``' (``load_runtime``, ``unload_runtime``), the same as gRPC
``kvfence.v1.Adapters``; a loaded adapter then shows in the caller's ``GET /v1/models``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from service.admission.tenant_adapters import Adapters
from service.admission.tenants import Tenant
from service.errors import Violations, invalid_argument
from service.http.deps import FrontDeps
from service.http.json_route import answer_json
from service.http.parse import load_body

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

        return await answer_json(self._d, request, "LoadAdapter", work, _small_body)

    async def unload(self, request: HttpRequest) -> Response:
        async def work(tenant: Tenant, raw: bytes) -> dict[str, Any]:
            [name] = _fields(raw, ("lora_name",))
            self._adapters.unload_runtime(tenant, name)
            return {"lora_name": name, "unloaded": True}

        return await answer_json(self._d, request, "UnloadAdapter", work, _small_body)


def _small_body(_: Tenant) -> tuple[int, None]:
    return MAX_BODY_BYTES, None
