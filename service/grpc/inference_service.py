"""``kvfence.v1.Inference``: Generate (server streaming), Tokenize, ListModels."""

from __future__ import annotations

import asyncio
import contextlib
import math
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from structlog.typing import FilteringBoundLogger

from protos.kvfence.v1 import inference_pb2
from service.admission.gate import Admission
from service.admission.limiter import Limiter
from service.admission.prep import RequestPrep
from service.admission.tenant_adapters import Adapters, model_infos
from service.admission.tenants import Tenant
from service.engine.types import Admitted, Delta, Finished
from service.errors import ServiceError, abort, internal
from service.grpc import stream_messages
from service.structured.tool_calls import CallsMade
from service.telemetry.metrics import Metrics
from service.telemetry.request_metrics import PageAlert, RequestMetrics
from service.telemetry.tracing import Tracing


@dataclass(frozen=True, slots=True)
class InferenceOptions:
    """Servicer settings from the command line."""

    model_info: inference_pb2.ModelInfo
    page_size: int
    log_content: bool = False
    alert_request_kv_pages: int = 0  # 0 = off


class InferenceServicer:
    def __init__(
        self,
        admission: Admission,
        prep: RequestPrep,
        limiter: Limiter,
        metrics: Metrics,
        log: FilteringBoundLogger,
        options: InferenceOptions,
        clock: Callable[[], float],
        tracing: Tracing | None = None,
        adapters: Adapters | None = None,
    ) -> None:
        # None: the base model alone (every adapter name is unknown)
        self._adapters = adapters or Adapters(None, prep.model.name, log)
        self._tracing = tracing if tracing is not None else Tracing.off()
        self._admission = admission
        self._prep = prep
        self._limiter = limiter
        self._metrics = metrics
        self._log = log
        self._opts = options
        self._clock = clock

    async def Generate(
        self,
        request: inference_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        tenant: Tenant,
        auth_ns: tuple[int, int] | None = None,
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """``auth_ns``: when the interceptor checked the tenant (wall-clock ns), for the
        trace's ``auth`` span; the trace starts there."""
        request_id = uuid.uuid4().hex
        log = self._log.bind(tenant=tenant.name, request_id=request_id, peer=context.peer())
        alert = PageAlert(self._opts.page_size, self._opts.alert_request_kv_pages)
        trace = self._tracing.request(
            tenant.name, "grpc", request_id, auth_ns[0] if auth_ns else None
        )
        if auth_ns is not None:
            trace.timed("auth", *auth_ns)
        recorder = RequestMetrics(self._metrics, tenant.name, "grpc", alert, log, trace)
        code = "CANCELLED"
        error: ServiceError | None = None
        try:
            async for response in self._generate(request, context, tenant, request_id, log, recorder):
                yield response
            code = "OK"
        except ServiceError as err:
            code = err.code.name
            error = err
            log.info("generate.error", code=code, message=err.message)
            await abort(context, err)
        except Exception as exc:  # a bug: INTERNAL, and nothing of the request in the log
            code = "INTERNAL"
            log.error("generate.failed", **_where(exc))
            await abort(context, internal("SERVER"))
        finally:
            if code == "CANCELLED":
                # gRPC cancels the handler both for a client cancel and a passed deadline.
                remaining = context.time_remaining()
                code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else code
                log.info("generate.cancelled", code=code)
            recorder.done("Generate", code, error)

    async def _generate(
        self,
        request: inference_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        tenant: Tenant,
        request_id: str,
        log: FilteringBoundLogger,
        recorder: RequestMetrics,
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        # The debug flag's prompt text, read from the message as the client sent it.
        prompt = self._prompt_text(request) if self._opts.log_content else None
        gen = await self._admission.start(
            tenant, request, request_id, self._deadline(context), recorder
        )
        # Closing the events closes the generation, the one abort path (Engine.abort frees
        # the pages at the next step boundary): when this RPC is cancelled, passes its
        # deadline, or the stream breaks. An abnormal finish raises its ServiceError.
        async with contextlib.aclosing(gen.events()) as events:
            req = gen.requests[0]
            fields = gen.fields
            assert fields is not None  # admission always reads the fields
            log.info(
                "generate.accepted",
                prompt_tokens=len(req.prompt_ids),
                max_tokens=fields.stopping.max_tokens,
                input=fields.input.which,
            )
            if prompt is not None:
                log.info("generate.content", prompt=prompt)
            output: list[str] = []
            async for _, event in events:
                if isinstance(event, Admitted):
                    yield stream_messages.started(
                        event, req.request_id, request.client_request_id,
                        self._prep.model.name if req.adapter is None else req.adapter.name,
                    )
                elif isinstance(event, Delta):
                    if self._opts.log_content:
                        output.append(event.text)
                    yield stream_messages.chunk(event, self._prep.token_text)
                elif isinstance(event, CallsMade):
                    yield stream_messages.tool_calls(event.calls)
                else:
                    yield self._finish(event, log, "".join(output), gen.tool_called(0))

    def _finish(
        self, event: Finished, log: FilteringBoundLogger, output: str, called: bool
    ) -> inference_pb2.GenerateResponse:
        log.info(
            "generate.finished",
            reason=event.reason,
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            cached_tokens=event.cached_tokens,
            queue_s=round(event.queue_s, 6),
            ttft_s=event.ttft_s,
            total_s=round(event.total_s, 6),
            error=type(event.error).__name__ if event.error else None,
        )
        if self._opts.log_content:
            log.info("generate.content", output=output)
        return stream_messages.finished(event, called)

    def _deadline(self, context: grpc.aio.ServicerContext) -> float | None:
        remaining: float | None = context.time_remaining()
        if remaining is None or not math.isfinite(remaining):
            return None
        return self._clock() + max(0.0, remaining)

    def _prompt_text(self, request: inference_pb2.GenerateRequest) -> str:
        which = request.WhichOneof("input")
        if which == "text":
            return request.text
        if which == "chat":
            return "\n".join(f"{m.role}: {m.content}" for m in request.chat.messages)
        return " ".join(map(str, request.token_ids.ids))

    async def Tokenize(
        self,
        request: inference_pb2.TokenizeRequest,
        context: grpc.aio.ServicerContext,
        tenant: Tenant,
    ) -> inference_pb2.TokenizeResponse:
        code = "OK"
        try:
            inp = self._prep.read_tokenize(tenant, request)
            # Limited like Generate: a concurrency slot, and the input charged by its size.
            lease = await self._limiter.admit(tenant.name, inp.cost)
            try:
                ids = await self._prep.tokenize(tenant, request, inp)
            finally:
                lease.release()
            return inference_pb2.TokenizeResponse(
                token_ids=ids, tokens=[self._prep.token_text(t) for t in ids]
            )
        except ServiceError as err:
            code = err.code.name
            await abort(context, err)
        except Exception as exc:
            code = "INTERNAL"
            self._log.error("tokenize.failed", tenant=tenant.name, **_where(exc))
            await abort(context, internal("SERVER"))
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            self._metrics.requests.labels(
                self._metrics.label(tenant.name), "Tokenize", code, "grpc"
            ).inc()

    async def ListModels(
        self,
        request: inference_pb2.ListModelsRequest,
        context: grpc.aio.ServicerContext,
        tenant: Tenant,
    ) -> inference_pb2.ListModelsResponse:
        self._metrics.requests.labels(
            self._metrics.label(tenant.name), "ListModels", "OK", "grpc"
        ).inc()
        base = self._opts.model_info
        if not tenant.may_use_model(base.name):
            return inference_pb2.ListModelsResponse()
        models = model_infos(base, self._adapters.names(tenant))
        for alias in reversed(self._prep.model.aliases):  # the model under its other names
            info = inference_pb2.ModelInfo()
            info.CopyFrom(base)
            info.name = alias
            models.insert(1, info)
        return inference_pb2.ListModelsResponse(models=models)


def _where(exc: BaseException) -> dict[str, str]:
    """The exception type and the innermost frame, without the message (it may quote input)."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return {"error": type(exc).__name__, "at": last}
