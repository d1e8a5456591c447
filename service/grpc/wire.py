"""Service registration with request parsing that cannot fail as UNKNOWN.

The generated ``add_*Servicer_to_server`` helpers hand raw bytes to ``Message.FromString``;
bytes that do not parse then surface as gRPC UNKNOWN from inside the library. Here the
deserializer returns a sentinel instead, and the handler answers INVALID_ARGUMENT with a
``BadRequest`` detail, so every malformed request gets the documented status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from protos.kvfence.v1 import adapters_pb2, cache_pb2, inference_pb2
from service.admission.tenants import Tenant
from service.errors import abort, invalid_argument


class _Malformed:
    """Stands in for a request message whose bytes did not parse."""


MALFORMED = _Malformed()

# Handlers take the tenant explicitly: the auth interceptor calls them with it.
UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext, Tenant], Awaitable[Any]]
# A streaming handler may also take keyword arguments from the interceptor (``auth_ns``).
StreamBehavior = Callable[..., AsyncIterator[Any]]


def _parser(message: type[Message]) -> Callable[[bytes], Message | _Malformed]:
    def parse(data: bytes) -> Message | _Malformed:
        try:
            return message.FromString(data)
        except (DecodeError, RuntimeError, ValueError):
            return MALFORMED

    return parse


async def _refuse(context: grpc.aio.ServicerContext) -> None:
    await abort(context, invalid_argument([("request", "the request message does not parse")]))


def _unary(behavior: UnaryBehavior) -> UnaryBehavior:
    async def handler(request: Any, context: grpc.aio.ServicerContext, tenant: Tenant) -> Any:
        if request is MALFORMED:
            await _refuse(context)
        return await behavior(request, context, tenant)

    return handler


def _stream(behavior: StreamBehavior) -> StreamBehavior:
    async def handler(
        request: Any, context: grpc.aio.ServicerContext, tenant: Tenant, **extra: Any
    ) -> AsyncIterator[Any]:
        if request is MALFORMED:
            await _refuse(context)
        async for response in behavior(request, context, tenant, **extra):
            yield response

    return handler


def _unary_handler(
    behavior: UnaryBehavior, request: type[Message], response: type[Message]
) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        _unary(behavior),
        request_deserializer=_parser(request),
        response_serializer=response.SerializeToString,
    )


def add_inference_service(servicer: Any, server: grpc.aio.Server) -> None:
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _stream(servicer.Generate),
            request_deserializer=_parser(inference_pb2.GenerateRequest),
            response_serializer=inference_pb2.GenerateResponse.SerializeToString,
        ),
        "Tokenize": _unary_handler(
            servicer.Tokenize, inference_pb2.TokenizeRequest, inference_pb2.TokenizeResponse
        ),
        "ListModels": _unary_handler(
            servicer.ListModels, inference_pb2.ListModelsRequest, inference_pb2.ListModelsResponse
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvfence.v1.Inference", handlers),)
    )


def add_cache_service(servicer: Any, server: grpc.aio.Server) -> None:
    handlers = {
        "GetUsage": _unary_handler(
            servicer.GetUsage, cache_pb2.GetUsageRequest, cache_pb2.GetUsageResponse
        ),
        "Purge": _unary_handler(servicer.Purge, cache_pb2.PurgeRequest, cache_pb2.PurgeResponse),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvfence.v1.Cache", handlers),)
    )


def add_adapters_service(servicer: Any, server: grpc.aio.Server) -> None:
    handlers = {
        "ListAdapters": _unary_handler(
            servicer.ListAdapters, adapters_pb2.ListAdaptersRequest,
            adapters_pb2.ListAdaptersResponse,
        ),
        "LoadAdapter": _unary_handler(
            servicer.LoadAdapter, adapters_pb2.LoadAdapterRequest, adapters_pb2.LoadAdapterResponse
        ),
        "UnloadAdapter": _unary_handler(
            servicer.UnloadAdapter, adapters_pb2.UnloadAdapterRequest,
            adapters_pb2.UnloadAdapterResponse,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvfence.v1.Adapters", handlers),)
    )
