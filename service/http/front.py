"""The OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models`` and ``GET /health``.

The tenant comes only from ``Authorization: Bearer <key>``, checked by the same
``Authenticator`` (same key hashes) as gRPC; no body field can name a tenant. A request is
translated to the gRPC ``GenerateRequest`` and goes through the gRPC front's validator, so
both fronts accept and refuse exactly the same things.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import secrets
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive
from structlog.typing import FilteringBoundLogger

from protos.kvfence.v1 import inference_pb2
from service.adapters import Adapters, BoundLease
from service.auth import Authenticator
from service.engine.grammar import GrammarCompiler
from service.engine.types import Admitted, Delta, EngineEvent, Finished, Request
from service.errors import ServiceError, internal, invalid_argument, unavailable
from service.finish import finish_error
from service.http import render
from service.http.errors import error_body, error_response
from service.http.generation import Generation, admit_all
from service.http.parse import HttpOptions, load_body, parse_chat, parse_completion
from service.limits import Limiter
from service.metrics import Metrics
from service.prepare import check_request, finish_request
from service.prompt import PromptBuilder
from service.protocols import EngineLike
from service.request_metrics import PageAlert, RequestMetrics, SequenceMetrics
from service.tenants import Tenant
from service.tool_calls import CallsMade, ToolSplitter
from service.tools import ToolPlan
from service.tracing import RequestTrace, Tracing

T = TypeVar("T")
TIMEOUT_HEADER = "x-kvfence-timeout"
MAX_BODY_BYTES = 8 * 1024 * 1024  # as gRPC's receive limit


@dataclass(frozen=True, slots=True)
class FrontDeps:
    """Everything the HTTP front shares with the gRPC server."""

    engine: EngineLike
    prompts: PromptBuilder
    limiter: Limiter
    authenticator: Authenticator
    metrics: Metrics
    log: FilteringBoundLogger
    grammars: GrammarCompiler | None
    is_draining: Callable[[], bool]
    clock: Callable[[], float] = time.monotonic
    alert: PageAlert = field(default_factory=lambda: PageAlert(page_size=1))  # off
    tracing: Tracing = field(default_factory=Tracing.off)
    adapters: Adapters | None = None  # None = the base model alone
    wall: Callable[[], float] = time.time
    # Keys the hashed end-user ids in the log: stable for the process's life, and without it
    # a log reader cannot confirm a guessed user id.
    user_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)


class OpenAIFront:
    def __init__(self, deps: FrontDeps) -> None:
        self._d = deps
        self._adapters = deps.adapters or Adapters(None, deps.prompts.model.name, deps.log)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={404: _not_found, 405: _not_allowed},
        )

    async def health(self, request: HttpRequest) -> Response:
        if self._d.is_draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def _tenant(self, request: HttpRequest) -> Tenant:
        if self._d.is_draining():
            raise unavailable("server is shutting down")
        headers = [("authorization", v) for v in request.headers.getlist("authorization")]
        return self._d.authenticator.authenticate(headers, {})

    async def models(self, request: HttpRequest) -> Response:
        try:
            tenant = self._tenant(request)
        except ServiceError as err:
            return error_response(err)
        model = self._d.prompts.model
        if not tenant.may_use_model(model.name):
            return JSONResponse({"object": "list", "data": []})
        data = [
            {"id": model.name, "object": "model", "created": 0, "owned_by": "kvfence",
             "max_model_len": model.max_model_len}
        ] + [
            {"id": name, "object": "model", "created": 0, "owned_by": tenant.name,
             "parent": model.name, "max_model_len": model.max_model_len}
            for name in self._adapters.names(tenant)
        ]
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request: HttpRequest) -> Response:
        return await self._generate(request, "chat", parse_chat)

    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, "completion", parse_completion)

    async def _generate(
        self,
        request: HttpRequest,
        endpoint: render.Endpoint,
        parse: Callable[[Mapping[str, Any]], tuple[inference_pb2.GenerateRequest, HttpOptions]],
    ) -> Response:
        request_id = uuid.uuid4().hex
        method = "chat.completions" if endpoint == "chat" else "completions"
        tenant_name = ""
        log = self._d.log.bind(request_id=request_id, front="http")
        trace: RequestTrace = RequestTrace()
        recorder = RequestMetrics(self._d.metrics, "", "http", self._d.alert, log)
        try:
            auth_start = time.time_ns()
            tenant = self._tenant(request)
            tenant_name = tenant.name
            log = log.bind(tenant=tenant.name)
            # NOTE: the trace starts once the tenant is known (it is the trace's attribute);
            # the auth it just passed is recorded as its first span, timed as it ran.
            trace = self._d.tracing.request(tenant.name, "http", request_id, auth_start)
            trace.timed("auth", auth_start, time.time_ns())
            recorder = RequestMetrics(
                self._d.metrics, tenant.name, "http", self._d.alert, log, trace
            )
            raw = await _read_body(request)
            message, opts = parse(load_body(raw))
            checked = check_request(self._d.prompts, tenant, message)
            adapter = await self._adapters.select(tenant, message.model)
            # Charged before any work (tokenizing included), as the gRPC front does: the
            # input by its size, for each of the n sequences.
            cost = checked.input_cost + checked.stopping.max_tokens
            try:
                leases = await admit_all(self._d.limiter, tenant.name, cost, opts.n)
            except BaseException:
                adapter.release()
                raise
            leases[0] = BoundLease(leases[0], adapter)  # the adapter is held while any runs
            try:
                with trace.span("tokenize"):
                    base = adapter.applied_to(await finish_request(
                        self._d.prompts, self._d.grammars, tenant, message, checked,
                        request_id, self._deadline(request),
                    ))
            except BaseException:
                for lease in leases:
                    lease.release()
                raise
            gen = Generation(self._d.engine, base, leases)
            plan = checked.tool_plan
            trace.submitted()
            await gen.start()
        except ServiceError as err:
            recorder.done(method, err.code.name, err)
            return error_response(err)
        except Exception as exc:  # a bug: 500, and nothing of the request in the log
            self._d.log.error("http.failed", request_id=request_id, **_where(exc))
            recorder.done(method, "INTERNAL")
            return error_response(internal("SERVER"))
        log.info("http.accepted", endpoint=endpoint, prompt_tokens=len(base.prompt_ids),
                 max_tokens=base.stopping.max_tokens, n=opts.n, stream=opts.stream,
                 end_user=self._end_user(tenant_name, opts.user))
        ident = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id
        head = render.ChunkHeader(
            endpoint, ident, int(self._d.wall()), message.model or self._d.prompts.model.name,
            opts.include_usage,
        )
        if opts.stream:
            return StreamingResponse(
                self._sse(gen, head, opts, recorder, method, log, plan),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            body = await _until_disconnect(
                request.receive, self._collect(gen, head, opts, recorder, plan)
            )
        except ServiceError as err:
            recorder.done(method, err.code.name, err)
            return error_response(err)
        except Exception as exc:
            log.error("http.failed", **_where(exc))
            recorder.done(method, "INTERNAL")
            return error_response(internal("SERVER"))
        finally:
            gen.close()
        if body is None:  # the client went away; its pages are already being freed
            recorder.done(method, "CANCELLED")
            return Response(status_code=499)
        recorder.done(method, "OK")
        return JSONResponse(body)

    def _record(self, event: EngineEvent, seq: SequenceMetrics, req: Request) -> None:
        """The engine's own events are what the metrics count, as on gRPC."""
        if isinstance(event, Delta):
            seq.delta(len(event.token_ids))
        elif isinstance(event, Finished):
            seq.finished(event)
            self._adapters.record(req, event)

    def _sequences(self, gen: Generation, recorder: RequestMetrics) -> list[SequenceMetrics]:
        return [recorder.sequence(len(r.prompt_ids), self._d.clock, i)
                for i, r in enumerate(gen.requests)]

    async def _collect(
        self,
        gen: Generation,
        head: render.ChunkHeader,
        opts: HttpOptions,
        recorder: RequestMetrics,
        plan: ToolPlan | None,
    ) -> dict[str, Any]:
        choices = [render.Choice(i) for i in range(len(gen.requests))]
        seqs = self._sequences(gen, recorder)
        splitters = [ToolSplitter(plan) for _ in choices]
        async for i, raw in gen.events():
            choice = choices[i]
            self._record(raw, seqs[i], gen.requests[i])
            for event in splitters[i].split(raw):
                if isinstance(event, Admitted):
                    choice.cached_tokens = event.cached_tokens
                elif isinstance(event, Delta):
                    choice.text.append(event.text)
                    choice.logprobs.extend(event.logprobs)
                elif isinstance(event, CallsMade):
                    choice.tool_calls.extend(event.calls)
                else:
                    self._check_finish(event)
                    choice.finish = event
        return render.complete_body(
            head.endpoint, head.ident, head.created, head.model, choices, opts,
            self._d.prompts.token_text,
        )

    async def _sse(
        self,
        gen: Generation,
        head: render.ChunkHeader,
        opts: HttpOptions,
        recorder: RequestMetrics,
        method: str,
        log: FilteringBoundLogger,
        plan: ToolPlan | None,
    ) -> AsyncIterator[bytes]:
        code = "CANCELLED"
        error: ServiceError | None = None
        choices = [render.Choice(i) for i in range(len(gen.requests))]
        seqs = self._sequences(gen, recorder)
        splitters = [ToolSplitter(plan) for _ in choices]
        offsets = [0] * len(choices)
        text = self._d.prompts.token_text

        def live(chs: list[render.Choice]) -> dict[str, Any] | None:
            return render.running_usage(chs) if opts.continuous_usage else None

        try:
            async for i, raw in gen.events():
                choice = choices[i]
                self._record(raw, seqs[i], gen.requests[i])
                for event in splitters[i].split(raw):
                    if isinstance(event, Admitted):
                        choice.cached_tokens = event.cached_tokens
                        choice.prompt_tokens = event.prompt_tokens
                    elif isinstance(event, Delta):
                        choice.completion_tokens += len(event.token_ids)
                        yield _sse_data(render.delta_chunk(
                            head, choice, event, opts, text, offsets[i], live(choices)
                        ))
                        offsets[i] += sum(len(text(lp.token_id)) for lp in event.logprobs)
                    elif isinstance(event, CallsMade):
                        for chunk in render.tool_call_chunks(
                            head, choice, event.calls, live(choices)
                        ):
                            yield _sse_data(chunk)
                    else:
                        self._check_finish(event)
                        choice.finish = event
                        yield _sse_data(render.finish_chunk(head, choice, event, live(choices)))
            if opts.include_usage:
                yield _sse_data(head.wrap([], render.total_usage(choices)))
            yield b"data: [DONE]\n\n"
            code = "OK"
        except ServiceError as err:
            # Headers are out: the error goes in the stream, as OpenAI's API does.
            code = err.code.name
            error = err
            yield _sse_data(error_body(err))
        except Exception as exc:
            log.error("http.failed", **_where(exc))
            code = "INTERNAL"
            yield _sse_data(error_body(internal("SERVER")))
        finally:
            gen.close()
            recorder.done(method, code, error)

    def _check_finish(self, event: Finished) -> None:
        if event.reason in ("stop", "length"):
            return
        raise finish_error(event, self._d.is_draining())

    def _deadline(self, request: HttpRequest) -> float | None:
        value = request.headers.get(TIMEOUT_HEADER)
        if value is None:
            return None
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds <= 0:
            raise invalid_argument([(TIMEOUT_HEADER, "must be a positive number of seconds")])
        return self._d.clock() + seconds

    def _end_user(self, tenant: str, user: str) -> str | None:
        """The request's end-user id as a keyed hash (16 hex digits), None when unset."""
        if not user:
            return None
        framed = b"".join(len(x).to_bytes(8, "big") + x for x in (tenant.encode(), user.encode()))
        return hmac.new(self._d.user_key, framed, hashlib.sha256).hexdigest()[:16]


def _where(exc: BaseException) -> dict[str, str]:
    """The exception type and the innermost frame, without the message (it may quote input)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return {"error": type(exc).__name__, "at": f"{frames[-1].filename}:{frames[-1].lineno}"
            if frames else ""}


def _sse_data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _read_body(request: HttpRequest) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise invalid_argument([("body", f"is larger than {MAX_BODY_BYTES} bytes")])
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise invalid_argument([("body", f"is larger than {MAX_BODY_BYTES} bytes")])
        chunks.append(chunk)
    return b"".join(chunks)


async def _until_disconnect(receive: Receive, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None (``work`` cancelled) if the client disconnects first.

    With the body read, the server's next ``receive`` message is the disconnect."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if task.done():
        watch.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _not_found(request: HttpRequest, exc: Exception) -> Response:
    body = {"error": {"message": f"no route {request.url.path}", "type": "not_found_error",
                      "param": None, "code": None}}
    return JSONResponse(body, status_code=404)


async def _not_allowed(request: HttpRequest, exc: Exception) -> Response:
    body = {"error": {"message": f"{request.method} is not allowed on {request.url.path}",
                      "type": "invalid_request_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=405)
