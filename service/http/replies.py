"""The answer to one OpenAI request, from its engine sequences' events: one JSON body
(``collect``) or a server-sent event stream (``sse``), the same for both endpoints.

Each sequence's events go through a ``ToolSplitter`` (tool calls out of the text, as on
gRPC) and are counted by the request's metrics exactly as the gRPC front counts them.
"""

from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from structlog.typing import FilteringBoundLogger

from service.admission.generation import Generation
from service.admission.outcomes import finish_error
from service.admission.tenant_adapters import Adapters
from service.engine.types import Admitted, Delta, EngineEvent, Finished, Request
from service.errors import ServiceError, internal
from service.http import render
from service.http.error_replies import error_body
from service.http.parse import HttpOptions
from service.structured.tool_calls import CallsMade, ToolSplitter
from service.structured.tools import ToolPlan
from service.telemetry.request_metrics import RequestMetrics, SequenceMetrics


class Replies:
    """Builds answers; ``token_text`` renders a token id, ``is_draining`` words refusals,
    ``adapters`` counts each finished sequence's adapter usage."""

    def __init__(
        self,
        token_text: Callable[[int], str],
        is_draining: Callable[[], bool],
        clock: Callable[[], float],
        adapters: Adapters,
    ) -> None:
        self._text = token_text
        self._is_draining = is_draining
        self._clock = clock
        self._adapters = adapters

    async def collect(
        self,
        gen: Generation,
        head: render.ChunkHeader,
        opts: HttpOptions,
        recorder: RequestMetrics,
        plan: ToolPlan | None,
    ) -> dict[str, Any]:
        """The whole non-streaming body, once every sequence finished."""
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
            head.endpoint, head.ident, head.created, head.model, choices, opts, self._text
        )

    async def sse(
        self,
        gen: Generation,
        head: render.ChunkHeader,
        opts: HttpOptions,
        recorder: RequestMetrics,
        method: str,
        log: FilteringBoundLogger,
        plan: ToolPlan | None,
    ) -> AsyncIterator[bytes]:
        """The event stream; it closes ``gen`` and records the outcome however it ends."""
        failed = False
        # aclosing: a client gone mid-stream closes the chunks too (gen closed, outcome recorded).
        async with contextlib.aclosing(
            self.chunks(gen, head, opts, recorder, method, log, plan)
        ) as chunks:
            async for chunk in chunks:
                failed = "error" in chunk
                yield sse_data(chunk)
        if not failed:
            yield b"data: [DONE]\n\n"

    async def chunks(
        self,
        gen: Generation,
        head: render.ChunkHeader,
        opts: HttpOptions,
        recorder: RequestMetrics,
        method: str,
        log: FilteringBoundLogger,
        plan: ToolPlan | None,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The stream's chunks as objects, an error body last when it fails (headers are
        out by then); it closes ``gen`` and records the outcome however it ends."""
        code = "CANCELLED"
        error: ServiceError | None = None
        choices = [render.Choice(i) for i in range(len(gen.requests))]
        seqs = self._sequences(gen, recorder)
        splitters = [ToolSplitter(plan) for _ in choices]
        offsets = [0] * len(choices)
        text = self._text

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
                        yield render.delta_chunk(
                            head, choice, event, opts, text, offsets[i], live(choices)
                        )
                        offsets[i] += sum(len(text(lp.token_id)) for lp in event.logprobs)
                    elif isinstance(event, CallsMade):
                        for chunk in render.tool_call_chunks(
                            head, choice, event.calls, live(choices)
                        ):
                            yield chunk
                    else:
                        self._check_finish(event)
                        choice.finish = event
                        yield render.finish_chunk(head, choice, event, live(choices))
            if opts.include_usage:
                yield head.wrap([], render.total_usage(choices))
            code = "OK"
        except ServiceError as err:
            # Headers are out: the error goes in the stream, as OpenAI's API does.
            code = err.code.name
            error = err
            yield error_body(err)
        except Exception as exc:
            log.error("http.failed", **where(exc))
            code = "INTERNAL"
            yield error_body(internal("SERVER"))
        finally:
            gen.close()
            recorder.done(method, code, error)

    def _sequences(self, gen: Generation, recorder: RequestMetrics) -> list[SequenceMetrics]:
        return [recorder.sequence(len(r.prompt_ids), self._clock, i)
                for i, r in enumerate(gen.requests)]

    def _record(self, event: EngineEvent, seq: SequenceMetrics, req: Request) -> None:
        """The engine's own events are what the metrics count, as on gRPC."""
        if isinstance(event, Delta):
            seq.delta(len(event.token_ids))
        elif isinstance(event, Finished):
            seq.finished(event)
            self._adapters.record(req, event)

    def _check_finish(self, event: Finished) -> None:
        if event.reason in ("stop", "length"):
            return
        raise finish_error(event, self._is_draining())


def sse_data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def where(exc: BaseException) -> dict[str, str]:
    """The exception type and the innermost frame, without the message (it may quote input)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return {"error": type(exc).__name__, "at": f"{frames[-1].filename}:{frames[-1].lineno}"
            if frames else ""}
