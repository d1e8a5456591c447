"""A scripted in-test kvfence server (grpc.aio, in its own thread) for the client tests.

It speaks the real v1 protos, checks `authorization: Bearer <key>` the way the real server
does, and records what it received so that tests can assert on it.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import grpc.aio
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc

GOOD_KEY = "good-key"


@dataclass(frozen=True)
class Fail:
    """How one Generate attempt fails: after `after_chunks` chunks, with this status."""

    code: grpc.StatusCode
    message: str = "scripted failure"
    after_chunks: int = 0
    retry_delay_s: float | None = None
    details: tuple[Message, ...] = ()


@dataclass(frozen=True)
class ServerTls:
    cert_pem: bytes
    key_pem: bytes
    client_ca_pem: bytes | None = None  # set = mTLS: client certificates are required


def _status(fail: Fail) -> grpc.Status:
    details = list(fail.details)
    if fail.retry_delay_s is not None:
        delay = duration_pb2.Duration()
        delay.FromTimedelta(datetime.timedelta(seconds=fail.retry_delay_s))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    proto = status_pb2.Status(code=fail.code.value[0], message=fail.message, details=packed)
    return rpc_status.to_status(proto)


@dataclass
class Recorder:
    """What the server saw, per call (appended from the server thread)."""

    requests: list[Message] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    timeouts: list[float | None] = field(default_factory=list)
    peer_identities: list[list[bytes]] = field(default_factory=list)

    def generate_requests(self) -> list[inference_pb2.GenerateRequest]:
        """The Generate calls among ``requests``, in order."""
        return [r for r in self.requests if isinstance(r, inference_pb2.GenerateRequest)]


class FakeInference(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self,
        chunks: tuple[str, ...] = ("Hel", "lo", ", ", "wor", "ld"),
        failures: list[Fail] | None = None,
        keys: tuple[str, ...] = (GOOD_KEY,),
        first_chunk_delay_s: float = 0.0,
        gate: threading.Event | None = None,
    ) -> None:
        self.chunks = chunks
        self.failures = list(failures or [])  # one popped per Generate call
        self.keys = keys
        self.first_chunk_delay_s = first_chunk_delay_s
        self.gate = gate  # when set, chunk 2 waits for it (streaming tests)
        self.seen = Recorder()
        self.generate_calls = 0
        self.cancelled: list[bool] = []  # per Generate that ended without an error status
        self.hit_rate = 0.75  # what GetUsage reports

    async def auth(self, request: Message, context: grpc.aio.ServicerContext) -> None:
        """Record the call and refuse it unless it carries one of ``keys``."""
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.seen.requests.append(request)
        self.seen.metadata.append(md)
        self.seen.timeouts.append(context.time_remaining())
        self.seen.peer_identities.append(list(context.peer_identities() or []))
        if md.get("authorization") not in {f"Bearer {k}" for k in self.keys}:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")

    async def Generate(
        self,
        request: inference_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        try:
            async for response in self._generate(request, context):
                yield response
        except asyncio.CancelledError:  # the client cancelled the call
            self.cancelled.append(True)
            raise
        self.cancelled.append(False)

    async def _generate(
        self,
        request: inference_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        await self.auth(request, context)
        self.generate_calls += 1
        n = self.generate_calls
        fail = self.failures.pop(0) if self.failures else None
        yield inference_pb2.GenerateResponse(
            started=inference_pb2.Started(
                request_id=f"req-{n}",
                client_request_id=request.client_request_id,
                prompt_tokens=3,
                cached_prompt_tokens=1,
                model="fake",
            )
        )
        if self.first_chunk_delay_s:
            await asyncio.sleep(self.first_chunk_delay_s)
        for i, text in enumerate(self.chunks):
            if fail is not None and i == fail.after_chunks:
                await context.abort_with_status(_status(fail))
            if i == 1 and self.gate is not None:
                await asyncio.to_thread(self.gate.wait, 10.0)
            yield inference_pb2.GenerateResponse(
                chunk=inference_pb2.Chunk(token_ids=[100 + i], text=text)
            )
        if fail is not None:
            await context.abort_with_status(_status(fail))
        yield inference_pb2.GenerateResponse(
            finished=inference_pb2.Finished(
                reason=inference_pb2.FINISH_REASON_LENGTH,
                usage=inference_pb2.Usage(
                    prompt_tokens=3, completion_tokens=len(self.chunks), cached_prompt_tokens=1
                ),
                timings=inference_pb2.Timings(
                    queue_seconds=0.01, ttft_seconds=0.02, total_seconds=0.03
                ),
            )
        )

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        await self.auth(request, context)
        if self.failures:
            await context.abort_with_status(_status(self.failures.pop(0)))
        words = (
            request.text.split()
            if request.WhichOneof("input") == "text"
            else [m.content for m in request.chat.messages]
        )
        return inference_pb2.TokenizeResponse(token_ids=[len(w) for w in words], tokens=words)

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        await self.auth(request, context)
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(
                    name="fake",
                    architecture="llama",
                    max_model_len=2048,
                    vocab_size=49152,
                    dtype="float32",
                )
            ]
        )


class FakeCache(cache_pb2_grpc.CacheServicer):
    def __init__(self, inference: FakeInference) -> None:
        self._inference = inference  # shares its auth and recorder

    async def GetUsage(
        self, request: cache_pb2.GetUsageRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.GetUsageResponse:
        await self._inference.auth(request, context)
        return cache_pb2.GetUsageResponse(
            pages_in_use=2,
            pages_cached=5,
            cached_prefixes=1,
            prefix_hit_tokens=48,
            prefix_miss_tokens=16,
            hit_rate=self._inference.hit_rate,
            page_size=16,
            running_requests=1,
            quotas=cache_pb2.Quotas(
                max_kv_pages=100,
                max_concurrent_streams=4,
                max_prompt_tokens=1024,
                tokens_per_minute=0,
                prefix_cache_ttl_seconds=600.0,
            ),
        )

    async def Purge(
        self, request: cache_pb2.PurgeRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.PurgeResponse:
        await self._inference.auth(request, context)
        return cache_pb2.PurgeResponse(pages_purged=5)


@contextmanager
def serve(inference: FakeInference, tls: ServerTls | None = None) -> Iterator[str]:
    """Run the fake server on 127.0.0.1:<free port> in a thread; yields the target."""
    ready = threading.Event()
    box: dict[str, object] = {}

    async def main() -> None:
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(inference, server)
        cache_pb2_grpc.add_CacheServicer_to_server(FakeCache(inference), server)
        if tls is None:
            port = server.add_insecure_port("127.0.0.1:0")
        else:
            creds = grpc.ssl_server_credentials(
                [(tls.key_pem, tls.cert_pem)],
                root_certificates=tls.client_ca_pem,
                require_client_auth=tls.client_ca_pem is not None,
            )
            port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        stop = asyncio.Event()
        box.update(port=port, stop=stop, loop=asyncio.get_running_loop())
        ready.set()
        await stop.wait()
        await server.stop(grace=None)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    try:
        yield f"127.0.0.1:{box['port']}"
    finally:
        loop = box["loop"]
        assert isinstance(loop, asyncio.AbstractEventLoop)
        stop = box["stop"]
        assert isinstance(stop, asyncio.Event)
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
