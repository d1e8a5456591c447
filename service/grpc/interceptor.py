"""The interceptor that authenticates every RPC but ``grpc.health.v1.Health``.

Two steps, because gRPC hands the two halves of a credential to different places:

1. ``intercept_service`` sees only the method and the headers, before the request body is
   received and parsed. A malformed or unknown API key, or no credential where the server
   takes no client certificates, is refused here by a handler that never parses the body, so
   an unauthenticated caller cannot make the server decode an 8 MiB message.
2. The wrapped handler has the servicer context (the TLS auth context too), resolves the
   tenant with the certificate check, and hands it to kvfence's own handlers as an explicit
   third argument, ``handler(request, context, tenant)`` (see ``service/grpc/wire.py``); other
   services' handlers (reflection) are called as usual once the tenant passes.

gRPC still reads the refused message off the wire (up to the receive limit), but never hands
it to Python; refusals are paced per peer host (``service/admission/refusal_pace.py``), so a client that
retries at once on every refusal cannot keep the server busy reading bodies. The cheap
authenticated calls (``CHEAP_METHODS``) are paced per tenant the same way, and so is every
answer that refuses an authenticated call (``PACED_CODES``: INVALID_ARGUMENT and the like),
as the HTTP front paces its 4xx: sixteen threads of invalid Generate calls were answered
986 times a second otherwise.

A ``Generate`` or ``Tokenize`` message larger than its tenant may send
(``service/admission/request_size.py``; the tenant is known from the API key in the headers) is never
decoded: its deserializer answers a marker, and the call is refused with INVALID_ARGUMENT
on ``request``, naming the limit.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
import structlog

from service.admission.auth import Authenticator
from service.admission.refusal_pace import RefusalPace
from service.admission.request_size import GRPC_BYTES_PER_TOKEN, request_limit, too_large
from service.admission.tenants import Tenant
from service.errors import (
    ServiceError,
    abort,
    invalid_argument,
    permission_denied,
    unavailable,
)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."
KVFENCE_PREFIX = "/kvfence."  # handlers of these services take the tenant explicitly
# Calls that cost the server little and touch no engine work: paced per tenant (``cheap``),
# so a tenant answering each with the next cannot keep a core busy with them.
CHEAP_METHODS = frozenset({"/kvfence.v1.Inference/ListModels", "/kvfence.v1.Cache/GetUsage",
                           "/kvfence.v1.Adapters/ListAdapters"})
# Handlers that trace their requests: they also get ``auth_ns``, the (start, end) wall-clock
# nanoseconds of the tenant check, so the trace's ``auth`` span is timed as it ran.
TRACED_METHODS = frozenset({"/kvfence.v1.Inference/Generate"})
# Calls whose message is bounded by the tenant's prompt limit before it is decoded.
SIZED_METHODS = frozenset({"/kvfence.v1.Inference/Generate", "/kvfence.v1.Inference/Tokenize"})
# Answers that refuse an authenticated call; paced per tenant (``cheap``) like HTTP's 4xx.
PACED_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})

Check = Callable[[grpc.aio.ServicerContext, str], Awaitable[Tenant]]
Authorize = Callable[
    [grpc.aio.ServicerContext], Awaitable[tuple[Any, tuple[Tenant, ...], dict[str, Any]]]
]
Deny = Callable[[grpc.aio.ServicerContext, str, ServiceError], Awaitable[NoReturn]]
Pace = Callable[[Tenant, grpc.StatusCode], Awaitable[None]]


class _PacedContext:
    """The servicer context a handler gets: its refusals are held per ``pace`` before they
    are sent (gRPC sends a status as soon as ``abort`` is called)."""

    def __init__(self, context: grpc.aio.ServicerContext, tenant: Tenant, pace: Pace) -> None:
        self._context = context
        self._tenant = tenant
        self._pace = pace

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        await self._pace(self._tenant, code)
        await self._context.abort(code, details, trailing_metadata)
        raise AssertionError("abort returned")  # pragma: no cover

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        await self._pace(self._tenant, status.code)
        await self._context.abort_with_status(status)
        raise AssertionError("abort_with_status returned")  # pragma: no cover


class Oversized:
    """What the deserializer of a sized call answers for a message past its tenant's limit:
    the refusal, with nothing of the message."""

    __slots__ = ("error",)

    def __init__(self, error: ServiceError) -> None:
        self.error = error


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates every RPC but health; refuses all of them while the server drains.

    ``client_certs`` says whether the server asks for client certificates (mTLS): without
    it, a call that carries no API key can be refused from its headers alone.
    """

    def __init__(
        self,
        authenticator: Authenticator,
        is_draining: Callable[[], bool],
        log: structlog.typing.FilteringBoundLogger,
        on_denied: Callable[[str], None] = lambda _code: None,
        client_certs: bool = False,
        pace: RefusalPace | None = None,
        cheap: RefusalPace | None = None,
        prompt_tokens: Callable[[Tenant], int] | None = None,
        max_message_bytes: int = 0,
    ) -> None:
        """``prompt_tokens``: the prompt tokens a tenant may send, which bound its sized
        calls' messages (None: only gRPC's ``max_message_bytes`` applies)."""
        self._auth = authenticator
        self._is_draining = is_draining
        self._log = log
        self._on_denied = on_denied
        self._client_certs = client_certs
        self._pace = pace
        self._cheap = cheap
        self._prompt_tokens = prompt_tokens
        self._max_message_bytes = max_message_bytes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        try:
            if self._is_draining():
                raise unavailable("server is shutting down")
            self._auth.precheck(handler_call_details.invocation_metadata, self._client_certs)
        except ServiceError as err:
            return _refuse(handler, method, err, self._deny)
        if method in SIZED_METHODS:
            handler = self._sized(handler, handler_call_details.invocation_metadata)
        return _wrap(handler, method, self._check, self._paced)

    def _sized(
        self, handler: grpc.RpcMethodHandler, metadata: Any
    ) -> grpc.RpcMethodHandler:
        """``handler`` whose deserializer answers ``Oversized`` for a message past the
        limit of the tenant the API key names (unchanged when no key names one)."""
        if self._prompt_tokens is None or handler.request_deserializer is None:
            return handler
        try:
            tenant = self._auth.authenticate(metadata, {})
        except ServiceError:
            return handler  # a client certificate's tenant: checked in the handler
        tokens = self._prompt_tokens(tenant)
        limit = request_limit(tokens, GRPC_BYTES_PER_TOKEN, self._max_message_bytes)
        decode = handler.request_deserializer

        def read(raw: bytes) -> Any:
            if len(raw) > limit:
                description = too_large(len(raw), limit, tokens, GRPC_BYTES_PER_TOKEN)
                return Oversized(invalid_argument([("request", description)]))
            return decode(raw)

        return handler._replace(request_deserializer=read)

    async def _paced(self, tenant: Tenant, code: grpc.StatusCode) -> None:
        """Hold a refusal (``code``) of ``tenant``'s call per the tenant's pace."""
        if code in PACED_CODES:
            await self._hold(tenant)

    async def _hold(self, tenant: Tenant) -> None:
        """Wait for ``tenant``'s turn in the per-tenant pace (service/admission/refusal_pace.py)."""
        if self._cheap is None:
            return
        key = f"tenant:{tenant.name}"
        wait = self._cheap.hold(key)
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            finally:
                self._cheap.release(key)

    async def _check(self, context: grpc.aio.ServicerContext, method: str) -> Tenant:
        try:
            if self._is_draining():
                raise unavailable("server is shutting down")
            tenant = self._auth.authenticate(context.invocation_metadata(), context.auth_context())
            if method.startswith(REFLECTION_PREFIX) and not tenant.allow_reflection:
                raise permission_denied("tenant may not use server reflection", "REFLECTION")
        except ServiceError as err:
            await self._deny(context, method, err)
        if method in CHEAP_METHODS:
            await self._hold(tenant)
        return tenant

    async def _deny(
        self, context: grpc.aio.ServicerContext, method: str, err: ServiceError
    ) -> NoReturn:
        if err.code != grpc.StatusCode.UNAVAILABLE:
            peer = context.peer()
            # One event per denial; the reason is in ErrorInfo, never the key itself.
            reason = err.details[0].reason if err.details else ""  # type: ignore[attr-defined]
            self._log.warning(
                "auth.denied", method=method, peer=peer, code=err.code.name, reason=reason
            )
            self._on_denied(err.code.name)
            wait = self._pace.reserve(peer) if self._pace is not None else 0.0
            if wait > 0:
                try:
                    await asyncio.sleep(wait)  # paced (service/admission/refusal_pace.py)
                finally:
                    self._pace.release(peer)  # type: ignore[union-attr]
        await abort(context, err)


def _skip_body(_raw: bytes) -> None:
    """The deserializer of a refused call: the body is never parsed."""
    return None


def _refuse(
    handler: grpc.RpcMethodHandler, method: str, err: ServiceError, deny: Deny
) -> grpc.RpcMethodHandler:
    """A handler that answers ``err`` without reading the request.

    NOTE: it is registered as a client-streaming handler whatever the method's kind: gRPC
    reads a unary request's whole message into a Python bytes object before it calls the
    handler, but starts a streaming handler at once and reads only what it asks for. The
    wire is the same for every kind, so the caller sees its status either way; the body it
    sent is dropped when the stream closes, never copied out of the transport."""

    async def refuse(_requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await deny(context, method, err)

    return grpc.stream_stream_rpc_method_handler(
        refuse,
        request_deserializer=_skip_body,
        response_serializer=handler.response_serializer,
    )


def _wrap(
    handler: grpc.RpcMethodHandler, method: str, check: Check, pace: Pace
) -> grpc.RpcMethodHandler:
    explicit = method.startswith(KVFENCE_PREFIX)
    traced = method in TRACED_METHODS

    async def authorize(
        context: grpc.aio.ServicerContext,
    ) -> tuple[Any, tuple[Tenant, ...], dict[str, Any]]:
        """The context the handler gets (refusals paced per the checked tenant) and the
        extra handler arguments: the tenant for kvfence's own handlers, and the check's
        timing for the traced ones."""
        start = time.time_ns()
        tenant = await check(context, method)
        extra = {"auth_ns": (start, time.time_ns())} if traced else {}
        return _PacedContext(context, tenant, pace), ((tenant,) if explicit else ()), extra

    kwargs: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            paced, args, extra = await authorize(context)
            if isinstance(request, Oversized):
                await abort(paced, request.error)
            return await inner_uu(request, paced, *args, **extra)

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
        paced, args, extra = await authorize(context)
        return await inner_su(request_iterator, paced, *args, **extra)

    return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)


def _streaming(inner: Any, authorize: Authorize) -> Any:
    if inspect.isasyncgenfunction(inner):

        async def gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            paced, args, extra = await authorize(context)
            if isinstance(request, Oversized):
                await abort(paced, request.error)
            async for item in inner(request, paced, *args, **extra):
                yield item

        return gen

    async def coro(request: Any, context: grpc.aio.ServicerContext) -> Any:
        paced, args, extra = await authorize(context)
        if isinstance(request, Oversized):
            await abort(paced, request.error)
        return await inner(request, paced, *args, **extra)

    return coro
