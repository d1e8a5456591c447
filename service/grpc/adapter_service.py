"""``kvfence.v1.Adapters``: a tenant lists, loads and unloads its own LoRA adapters.

The work is ``Adapters``' (``load_runtime``, ``unload_runtime``); this translates the wire.
Every answer concerns the caller's adapters alone.
"""

from __future__ import annotations

import grpc

from protos.kvfence.v1 import adapters_pb2
from service.admission.tenant_adapters import Adapters
from service.admission.tenants import Tenant
from service.errors import ServiceError, abort
from service.telemetry.metrics import Metrics


class AdaptersServicer:
    def __init__(self, adapters: Adapters, metrics: Metrics) -> None:
        self._adapters = adapters
        self._metrics = metrics

    async def ListAdapters(
        self,
        request: adapters_pb2.ListAdaptersRequest,
        context: grpc.aio.ServicerContext,
        tenant: Tenant,
    ) -> adapters_pb2.ListAdaptersResponse:
        self._count(tenant, "ListAdapters", "OK")
        return adapters_pb2.ListAdaptersResponse(adapters=self._infos(tenant))

    async def LoadAdapter(
        self,
        request: adapters_pb2.LoadAdapterRequest,
        context: grpc.aio.ServicerContext,
        tenant: Tenant,
    ) -> adapters_pb2.LoadAdapterResponse:
        try:
            await self._adapters.load_runtime(tenant, request.name, request.path)
        except ServiceError as err:
            self._count(tenant, "LoadAdapter", err.code.name)
            await abort(context, err)
        self._count(tenant, "LoadAdapter", "OK")
        [info] = [i for i in self._infos(tenant) if i.name == request.name]
        return adapters_pb2.LoadAdapterResponse(adapter=info)

    async def UnloadAdapter(
        self,
        request: adapters_pb2.UnloadAdapterRequest,
        context: grpc.aio.ServicerContext,
        tenant: Tenant,
    ) -> adapters_pb2.UnloadAdapterResponse:
        try:
            self._adapters.unload_runtime(tenant, request.name)
        except ServiceError as err:
            self._count(tenant, "UnloadAdapter", err.code.name)
            await abort(context, err)
        self._count(tenant, "UnloadAdapter", "OK")
        return adapters_pb2.UnloadAdapterResponse()

    def _infos(self, tenant: Tenant) -> list[adapters_pb2.AdapterInfo]:
        return [
            adapters_pb2.AdapterInfo(name=name, loaded_at_run_time=runtime, resident=resident)
            for name, runtime, resident in self._adapters.listing(tenant)
        ]

    def _count(self, tenant: Tenant, method: str, code: str) -> None:
        self._metrics.requests.labels(self._metrics.label(tenant.name), method, code, "grpc").inc()
