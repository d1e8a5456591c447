"""The blocking kvfence client.

    with Client("127.0.0.1:50051", api_key="...") as client:
        for event in client.generate("Hello", max_tokens=32):
            if isinstance(event, Chunk):
                print(event.text, end="", flush=True)

Retries follow clients/retry.py: only before anything of a call reached the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from types import TracebackType
from typing import Any, TypeVar, Unpack

import grpc

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
    Clock,
    RetryPolicy,
    Sleep,
    as_policy,
    call_with_retries,
)
from clients.types import (
    CacheUsage,
    Finished,
    GenerateEvent,
    GenerateResult,
    ModelInfo,
    ProtocolError,
    Started,
    Tokenized,
    collect,
    event_from_proto,
    models_from_proto,
    tokenized_from_proto,
    usage_from_proto,
)
from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc

T = TypeVar("T")


class Client:
    """A blocking client. Thread-safe; one channel per client; close() or use `with`.

    `timeout` (seconds) is the default deadline of every call, retries included; each method's
    own `timeout=` overrides it, and None means no deadline. For Generate the deadline covers
    the whole stream.
    """

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
        sleep: Sleep = time.sleep,
    ) -> None:
        self._config = ChannelConfig(target, resolve_api_key(api_key), tls, tuple(options))
        self._policy = as_policy(retries)
        self._timeout = timeout
        self._clock = clock
        self._sleep = sleep
        self._metadata = self._config.call_metadata()
        self._channel = self._config.open()
        self._inference = inference_pb2_grpc.InferenceStub(self._channel)
        self._cache = cache_pb2_grpc.CacheStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

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
    ) -> Generator[GenerateEvent, None, None]:
        """Stream Started, then Chunks, then Finished. Bad arguments raise here, not later.

        Close the iterator (or let it be collected) to cancel the call on the server.
        """
        request = build_generate_request(
            prompt,
            token_ids=token_ids,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            options=options,
        )
        return self._stream(request, timeout)

    def generate_text(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Messages | None = None,
        add_generation_prompt: bool = True,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """Run a generation to the end and return its text, finish reason and usage."""
        return collect(
            self.generate(
                prompt,
                token_ids=token_ids,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                timeout=timeout,
                **options,
            )
        )

    def chat(
        self,
        messages: Messages,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """One assistant turn rendered by the server's chat template.

        To stream a turn, use `generate(messages=...)`.
        """
        return self.generate_text(messages=messages, timeout=timeout, **options)

    def _stream(
        self, request: inference_pb2.GenerateRequest, timeout: float | None
    ) -> Generator[GenerateEvent, None, None]:
        deadline = self._deadline(timeout)  # the clock starts at the first next()
        call, held = call_with_retries(
            lambda: self._open_stream(request, deadline),
            method="Generate",
            deadline=deadline,
            policy=self._policy,
            clock=self._clock,
            sleep=self._sleep,
        )
        finished = any(isinstance(e, Finished) for e in held)
        try:
            yield from held
            for response in call:
                event = event_from_proto(response)
                finished = finished or isinstance(event, Finished)
                yield event
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once the stream is done; cancels it if the caller stopped
        if not finished:
            raise ProtocolError("Generate stream ended without a finished event")

    def _open_stream(
        self, request: inference_pb2.GenerateRequest, deadline: float | None
    ) -> tuple[Any, list[GenerateEvent]]:
        """One attempt: start the call and read up to the first Chunk or Finished.

        Started is held back so that an attempt that fails before its first Chunk can be
        retried without the caller having seen anything of it.
        """
        call = self._inference.Generate(
            request, timeout=self._remaining(deadline), metadata=self._metadata
        )
        held: list[GenerateEvent] = []
        try:
            for response in call:
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

    def tokenize(
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
        return tokenized_from_proto(
            self._unary("Tokenize", self._inference.Tokenize, request, timeout)
        )

    def models(self, *, timeout: float | None = None) -> tuple[ModelInfo, ...]:
        response = self._unary(
            "ListModels", self._inference.ListModels, inference_pb2.ListModelsRequest(), timeout
        )
        return models_from_proto(response)

    def usage(self, *, timeout: float | None = None) -> CacheUsage:
        """The caller's own KV usage and quotas."""
        response = self._unary(
            "GetUsage", self._cache.GetUsage, cache_pb2.GetUsageRequest(), timeout
        )
        return usage_from_proto(response)

    def purge(self, *, timeout: float | None = None) -> int:
        """Drop the caller's cached prefixes; returns the number of pages purged."""
        response = self._unary("Purge", self._cache.Purge, cache_pb2.PurgeRequest(), timeout)
        return int(response.pages_purged)

    def _unary(
        self, name: str, method: Callable[..., T], request: object, timeout: float | None
    ) -> T:
        deadline = self._deadline(timeout)

        def attempt() -> T:
            try:
                return method(request, timeout=self._remaining(deadline), metadata=self._metadata)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None

        return call_with_retries(
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
