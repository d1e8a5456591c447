"""Who is calling: API key or mTLS client identity -> ``Tenant``, and the interceptor that asks.

The interceptor wraps every handler except ``grpc.health.v1.Health``. The wrapper has the
servicer context (metadata *and* the TLS auth context, which ``handler_call_details`` lacks),
resolves the tenant, and hands it to kvfence's own handlers as an explicit third argument,
``handler(request, context, tenant)`` (see ``service/wire.py``); other services' handlers
(reflection) are called as usual once the tenant passes.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc
import structlog

from service.errors import ServiceError, abort, permission_denied, unauthenticated, unavailable
from service.tenants import Tenant, TenantRegistry

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."
KVFENCE_PREFIX = "/kvfence."  # handlers of these services take the tenant explicitly
_SAN_KEYS = ("x509_subject_alternative_name", "peer_uri", "peer_dns")


class Authenticator:
    """Maps credentials to tenants. ``replace`` swaps in a reloaded tenants file atomically."""

    def __init__(self, registry: TenantRegistry) -> None:
        self._registry = registry

    @property
    def registry(self) -> TenantRegistry:
        return self._registry

    def replace(self, registry: TenantRegistry) -> None:
        self._registry = registry

    def authenticate(
        self,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        auth_context: Mapping[str, Iterable[bytes]],
    ) -> Tenant:
        """Resolve the caller. Raises ``ServiceError(UNAUTHENTICATED)``; never logs the key."""
        registry = self._registry  # one snapshot for the whole decision
        headers = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
        identities = _client_identities(auth_context)
        by_cert = registry.by_identity(identities) if identities else None
        if len(headers) > 1:
            raise unauthenticated("duplicate authorization headers", "DUPLICATE_CREDENTIALS")
        if headers:
            value = headers[0]
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, key = value.partition(" ")
            if scheme.lower() != "bearer" or not key.strip():
                raise unauthenticated("authorization must be 'Bearer <api key>'", "MALFORMED")
            by_key = registry.by_key(key.strip())
            if by_key is None:
                raise unauthenticated("invalid API key", "INVALID_KEY")
            if identities and (by_cert is None or by_cert.name != by_key.name):
                raise unauthenticated("API key and client certificate disagree", "MISMATCH")
            return by_key
        if by_cert is not None:
            return by_cert
        if identities:
            raise unauthenticated("client certificate is not mapped to a tenant", "UNKNOWN_CERT")
        raise unauthenticated("missing credentials: send 'authorization: Bearer <api key>'")


def _client_identities(auth_context: Mapping[str, Iterable[bytes]]) -> tuple[str, ...]:
    found: list[str] = []
    for key in _SAN_KEYS:
        for raw in auth_context.get(key, ()):
            ident = raw.decode("utf-8", "replace")
            if ident not in found:
                found.append(ident)
    return tuple(found)


Check = Callable[[grpc.aio.ServicerContext, str], Awaitable[Tenant]]
Authorize = Callable[[grpc.aio.ServicerContext], Awaitable[tuple[Tenant, ...]]]


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates every RPC but health; refuses all of them while the server drains."""

    def __init__(
        self,
        authenticator: Authenticator,
        is_draining: Callable[[], bool],
        log: structlog.typing.FilteringBoundLogger,
        on_denied: Callable[[str], None] = lambda _code: None,
    ) -> None:
        self._auth = authenticator
        self._is_draining = is_draining
        self._log = log
        self._on_denied = on_denied

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        return _wrap(handler, method, self._check)

    async def _check(self, context: grpc.aio.ServicerContext, method: str) -> Tenant:
        try:
            if self._is_draining():
                raise unavailable("server is shutting down")
            tenant = self._auth.authenticate(context.invocation_metadata(), context.auth_context())
            if method.startswith(REFLECTION_PREFIX) and not tenant.allow_reflection:
                raise permission_denied("tenant may not use server reflection", "REFLECTION")
        except ServiceError as err:
            if err.code != grpc.StatusCode.UNAVAILABLE:
                # One event per denial; the reason is in ErrorInfo, never the key itself.
                reason = err.details[0].reason if err.details else ""  # type: ignore[attr-defined]
                self._log.warning(
                    "auth.denied",
                    method=method,
                    peer=context.peer(),
                    code=err.code.name,
                    reason=reason,
                )
                self._on_denied(err.code.name)
            await abort(context, err)
        return tenant


def _wrap(handler: grpc.RpcMethodHandler, method: str, check: Check) -> grpc.RpcMethodHandler:
    explicit = method.startswith(KVFENCE_PREFIX)

    async def authorize(context: grpc.aio.ServicerContext) -> tuple[Tenant, ...]:
        """The extra handler arguments: the checked tenant for kvfence's own handlers."""
        tenant = await check(context, method)
        return (tenant,) if explicit else ()

    kwargs: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await inner_uu(request, context, *await authorize(context))

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _streaming(handler.unary_stream, authorize), **kwargs
        )
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            _streaming(handler.stream_stream, authorize), **kwargs
        )
    inner_su = handler.stream_unary

    async def stream_unary(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        return await inner_su(request_iterator, context, *await authorize(context))

    return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)


def _streaming(inner: Any, authorize: Authorize) -> Any:
    if inspect.isasyncgenfunction(inner):

        async def gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in inner(request, context, *await authorize(context)):
                yield item

        return gen

    async def coro(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await inner(request, context, *await authorize(context))

    return coro
