"""The asyncio kvfence client (grpc.aio), the same API as clients.client.Client.

    async with AsyncClient("127.0.0.1:50051", api_key="...") as client:
        async for event in client.generate("Hello", max_tokens=32):
            ...

The channel is opened on first use, inside the running event loop. If you stop iterating a
stream early, close it (`contextlib.aclosing`) so the server-side call is cancelled promptly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar, Unpack

import grpc
import grpc.aio

from clients.channel import DEFAULT_TARGET, ChannelConfig, TlsConfig, resolve_api_key
from clients.errors import from_rpc_error
from clients.requests import (
    GenerateOptions,
    Messages,
    build_generate_request,
    build_tokenize_request,
)
from clients.retry import (
    DEFAULT_RETRY_POLICY,
    AsyncSleep,
    Clock,
    RetryPolicy,
    acall_with_retries,
    as_policy,
)
from clients.types import (
    CacheUsage,
    Finished,
    GenerateEvent,
    GenerateResult,
    ModelInfo,
    ProtocolError,
    ResultBuilder,
    Started,
    Tokenized,
    event_from_proto,
    models_from_proto,
    tokenized_from_proto,
    usage_from_proto,
)
from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc

T = TypeVar("T")


class AsyncClient:
    """An asyncio client; see Client for the meaning of every argument."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls: TlsConfig | None = None,
        retries: int | RetryPolicy = DEFAULT_RETRY_POLICY,
        timeout: float | None = None,
        options: Sequence[tuple[str, str | int]] = (),
        clock: Clock = time.monotonic,
        sleep: AsyncSleep = asyncio.sleep,
    ) -> None:
        self._config = ChannelConfig(target, resolve_api_key(api_key), tls, tuple(options))
        if tls is not None:
            tls.channel_credentials()  # unreadable files fail here, not at the first call
        self._policy = as_policy(retries)
        self._timeout = timeout
        self._clock = clock
        self._sleep = sleep
        self._metadata = self._config.call_metadata()
        # Set by _stubs() on first use, so the channel binds to the loop that uses it.
        self._channel: grpc.aio.Channel | None = None
        self._inference: Any = None
        self._cache: Any = None

    def _stubs(self) -> tuple[Any, Any]:
        if self._channel is None:
            self._channel = self._config.open_aio()
            self._inference = inference_pb2_grpc.InferenceStub(self._channel)
            self._cache = cache_pb2_grpc.CacheStub(self._channel)
        return self._inference, self._cache

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- Generate ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Messages | None = None,
        add_generation_prompt: bool = True,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncGenerator[GenerateEvent, None]:
        """Stream Started, then Chunks, then Finished. Bad arguments raise here, not later."""
        request = build_generate_request(
            prompt,
            token_ids=token_ids,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            options=options,
        )
        return self._stream(request, timeout)

    async def generate_text(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Messages | None = None,
        add_generation_prompt: bool = True,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        builder = ResultBuilder()
        async for event in self.generate(
            prompt,
            token_ids=token_ids,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            timeout=timeout,
            **options,
        ):
            builder.add(event)
        return builder.result()

    async def chat(
        self,
        messages: Messages,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """One assistant turn; to stream it, use `generate(messages=...)`."""
        return await self.generate_text(messages=messages, timeout=timeout, **options)

    async def _stream(
        self, request: inference_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncGenerator[GenerateEvent, None]:
        deadline = self._deadline(timeout)  # the clock starts at the first next()
        call, held = await acall_with_retries(
            lambda: self._open_stream(request, deadline),
            method="Generate",
            deadline=deadline,
            policy=self._policy,
            clock=self._clock,
            sleep=self._sleep,
        )
        finished = any(isinstance(e, Finished) for e in held)
        try:
            for event in held:
                yield event
            while (response := await call.read()) is not grpc.aio.EOF:
                event = event_from_proto(response)
                finished = finished or isinstance(event, Finished)
                yield event
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()
        if not finished:
            raise ProtocolError("Generate stream ended without a finished event")

    async def _open_stream(
        self, request: inference_pb2.GenerateRequest, deadline: float | None
    ) -> tuple[Any, list[GenerateEvent]]:
        """One attempt, up to the first Chunk or Finished (see Client._open_stream)."""
        inference, _ = self._stubs()
        call = inference.Generate(
            request, timeout=self._remaining(deadline), metadata=self._metadata
        )
        held: list[GenerateEvent] = []
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                event = event_from_proto(response)
                held.append(event)
                if not isinstance(event, Started):
                    break
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except BaseException:
            call.cancel()
            raise
        return call, held

    # -- Unary calls ------------------------------------------------------------------------

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Messages | None = None,
        add_special_tokens: bool = False,
        timeout: float | None = None,
    ) -> Tokenized:
        request = build_tokenize_request(
            text, messages=messages, add_special_tokens=add_special_tokens
        )
        response = await self._unary(
            "Tokenize", lambda: self._stubs()[0].Tokenize, request, timeout
        )
        return tokenized_from_proto(response)

    async def models(self, *, timeout: float | None = None) -> tuple[ModelInfo, ...]:
        response = await self._unary(
            "ListModels",
            lambda: self._stubs()[0].ListModels,
            inference_pb2.ListModelsRequest(),
            timeout,
        )
        return models_from_proto(response)

    async def usage(self, *, timeout: float | None = None) -> CacheUsage:
        response = await self._unary(
            "GetUsage", lambda: self._stubs()[1].GetUsage, cache_pb2.GetUsageRequest(), timeout
        )
        return usage_from_proto(response)

    async def purge(self, *, timeout: float | None = None) -> int:
        response = await self._unary(
            "Purge", lambda: self._stubs()[1].Purge, cache_pb2.PurgeRequest(), timeout
        )
        return int(response.pages_purged)

    async def _unary(
        self,
        name: str,
        method: Callable[[], Callable[..., Awaitable[T]]],
        request: object,
        timeout: float | None,
    ) -> T:
        deadline = self._deadline(timeout)

        async def attempt() -> T:
            try:
                response: T = await method()(
                    request, timeout=self._remaining(deadline), metadata=self._metadata
                )
                return response
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None

        return await acall_with_retries(
            attempt,
            method=name,
            deadline=deadline,
            policy=self._policy,
            clock=self._clock,
            sleep=self._sleep,
        )

    def _deadline(self, timeout: float | None) -> float | None:
        timeout = self._timeout if timeout is None else timeout
        return None if timeout is None else self._clock() + timeout

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - self._clock())
