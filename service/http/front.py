"""The OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/responses`` (``service.http.responses_request``, ``responses_reply``), ``GET /v1/models``,
``POST /tokenize`` and ``/detokenize`` (``service.http.token_routes``), ``POST /v1/embeddings``
(refused: the served models are decoder LMs), ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (``service.http.adapter_routes``), ``GET /health``, and ``GET /metrics`` with
``--metrics-on-http``.

The tenant comes only from ``Authorization: Bearer <key>``, checked by the same
``Authenticator`` (same key hashes) as gRPC; no body field can name a tenant. A request is
translated to the gRPC ``GenerateRequest`` and started by the same ``Admission.start``
(``service/admission/gate.py``) as gRPC, so both fronts accept and refuse exactly the same
things.
"""

from __future__ import annotations

import hashlib
import hmac
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from protos.kvfence.v1 import inference_pb2
from service.admission.tenant_adapters import Adapters
from service.errors import ServiceError, internal
from service.http import render, responses_reply, responses_request
from service.http.adapter_routes import AdapterRoutes
from service.http.body import BodyTooLarge, read_body
from service.http.body_reply import BodyReply
from service.http.deps import FrontDeps, body_limit, deadline_of, tenant_of
from service.http.error_replies import error_response
from service.http.parse import HttpOptions, load_body, parse_chat, parse_completion
from service.http.replies import Started, where
from service.http.stream_reply import StreamReply
from service.http.token_routes import TokenRoutes
from service.telemetry.request_metrics import RequestMetrics
from service.telemetry.tracing import RequestTrace

Parse = Callable[[Mapping[str, Any]], tuple[inference_pb2.GenerateRequest, HttpOptions]]


class OpenAIFront:
    def __init__(self, deps: FrontDeps) -> None:
        self._d = deps
        self._adapters = deps.adapters or Adapters(None, deps.prep.model.name, deps.log)
        self._stream_reply = StreamReply(deps.prep.token_text)
        self._body_reply = BodyReply(deps.prep.token_text)
        self._tokens = TokenRoutes(deps, self._adapters)
        self._adapter_routes = AdapterRoutes(deps, self._adapters)

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/tokenize", self._tokens.tokenize, methods=["POST"]),
            Route("/detokenize", self._tokens.detokenize, methods=["POST"]),
            Route("/v1/load_lora_adapter", self._adapter_routes.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self._adapter_routes.unload, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        if self._d.metrics_on_http:
            routes.append(Route("/metrics", self.metrics, methods=["GET"]))
        return Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_allowed})

    async def metrics(self, request: HttpRequest) -> Response:
        """The Prometheus exposition, as ``--metrics-port`` serves it: unauthenticated (a
        scraper holds no tenant key, and any tenant's key would show it every tenant's
        series), paced per peer like ``/health``."""
        return Response(generate_latest(self._d.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(self, request: HttpRequest) -> Response:
        if self._d.is_draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: HttpRequest) -> Response:
        try:
            tenant = tenant_of(self._d, request)
        except ServiceError as err:
            return error_response(err)
        model = self._d.prep.model
        if not tenant.may_use_model(model.name):
            return JSONResponse({"object": "list", "data": []})
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvfence",
             "max_model_len": model.max_model_len}
            for name in (model.name, *model.aliases)
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

    async def responses(self, request: HttpRequest) -> Response:
        translation = responses_request.ResponsesRequest()
        started = await self._start(request, "chat", "responses", translation.parse)
        if isinstance(started, Response):
            return started
        head = responses_reply.ResponseHead(
            "resp_" + started.head.ident.removeprefix("chatcmpl-"), started.head.created,
            started.head.model, translation.echo,
        )
        if started.opts.stream:
            return StreamingResponse(
                responses_reply.events(self._stream_reply.chunks(started), head),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            )
        body = await self._body_reply.collect(request, started)
        if isinstance(body, Response):
            return body
        return JSONResponse(responses_reply.response_object(body, head))

    async def _generate(self, request: HttpRequest, endpoint: render.Endpoint, parse: Parse
                        ) -> Response:
        method = "chat.completions" if endpoint == "chat" else "completions"
        started = await self._start(request, endpoint, method, parse)
        if isinstance(started, Response):
            return started
        # The one answer a request gets: streamed, or one body.
        reply = self._stream_reply if started.opts.stream else self._body_reply
        return await reply.answer(request, started)

    async def _start(
        self, request: HttpRequest, endpoint: render.Endpoint, method: str, parse: Parse
    ) -> Started | Response:
        """Authenticate, parse, admit and submit: the started generation, or the error's
        answer (nothing held then)."""
        request_id = uuid.uuid4().hex
        tenant_name = ""
        log = self._d.log.bind(request_id=request_id, front="http")
        trace: RequestTrace = RequestTrace()
        recorder = RequestMetrics(self._d.metrics, "", "http", self._d.alert, log)
        try:
            auth_start = time.time_ns()
            tenant = tenant_of(self._d, request)
            deadline = deadline_of(self._d, request)
            tenant_name = tenant.name
            log = log.bind(tenant=tenant.name)
            # NOTE: the trace starts once the tenant is known (it is the trace's attribute);
            # the auth it just passed is recorded as its first span, timed as it ran.
            trace = self._d.tracing.request(tenant.name, "http", request_id, auth_start)
            trace.timed("auth", auth_start, time.time_ns())
            recorder = RequestMetrics(
                self._d.metrics, tenant.name, "http", self._d.alert, log, trace
            )
            raw = await read_body(request, *body_limit(self._d, tenant))
            message, opts = parse(load_body(raw))
            gen = await self._d.admission.start(
                tenant, message, request_id, deadline, recorder,
                sequences=opts.n, to_context_end=True,
            )
        except ServiceError as err:
            recorder.done(method, err.code.name, err)
            return error_response(err)
        except BodyTooLarge as big:
            recorder.done(method, big.error.code.name, big.error)
            return error_response(big.error, status=413, close=True)
        except Exception as exc:  # a bug: 500, and nothing of the request in the log
            self._d.log.error("http.failed", request_id=request_id, **where(exc))
            recorder.done(method, "INTERNAL")
            return error_response(internal("SERVER"))
        base = gen.requests[0]
        log.info("http.accepted", endpoint=method, prompt_tokens=len(base.prompt_ids),
                 max_tokens=base.stopping.max_tokens, n=opts.n, stream=opts.stream,
                 end_user=self._end_user(tenant_name, opts.user))
        ident = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id
        head = render.ChunkHeader(
            endpoint, ident, int(self._d.wall()), message.model or self._d.prep.model.name,
            opts.include_usage,
        )
        return Started(gen, head, opts, recorder, method, log)

    async def embeddings(self, request: HttpRequest) -> Response:
        """Refused after authentication: a decoder LM's hidden states pooled into a vector
        are not embeddings any model was trained to give, so none are invented."""
        try:
            tenant_of(self._d, request)
        except ServiceError as err:
            return error_response(err)
        message = (f"{self._d.prep.model.name} is a decoder language model, not an embedding "
                   "model: kvfence serves no embeddings")
        body = {"error": {"message": message, "type": "invalid_request_error",
                          "param": "model", "code": "embeddings_not_supported"}}
        return JSONResponse(body, status_code=400)

    def _end_user(self, tenant: str, user: str) -> str | None:
        """The request's end-user id as a keyed hash (16 hex digits), None when unset."""
        if not user:
            return None
        framed = b"".join(len(x).to_bytes(8, "big") + x for x in (tenant.encode(), user.encode()))
        return hmac.new(self._d.user_key, framed, hashlib.sha256).hexdigest()[:16]


async def _not_found(request: HttpRequest, exc: Exception) -> Response:
    body = {"error": {"message": f"no route {request.url.path}", "type": "not_found_error",
                      "param": None, "code": None}}
    return JSONResponse(body, status_code=404)


async def _not_allowed(request: HttpRequest, exc: Exception) -> Response:
    body = {"error": {"message": f"{request.method} is not allowed on {request.url.path}",
                      "type": "invalid_request_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=405)
