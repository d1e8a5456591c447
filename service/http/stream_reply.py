"""The streamed answer to an OpenAI generation (``"stream": true``): server-sent events,
one chunk per delta, tool call and finish, an error body last when it fails mid-stream."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from service.engine.types import Admitted, Delta
from service.errors import ServiceError, internal
from service.http import render
from service.http.error_replies import error_body
from service.http.replies import Started, where
from service.structured.tool_calls import CallsMade


class StreamReply:
    """Streams answers; ``token_text`` renders a token id."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self._text = token_text

    async def answer(self, request: HttpRequest, s: Started) -> Response:
        return StreamingResponse(
            self.sse(s), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def sse(self, s: Started) -> AsyncIterator[bytes]:
        """The event stream; it closes the generation and records the outcome however it
        ends."""
        failed = False
        # aclosing: a client gone mid-stream closes the chunks too (gen closed, outcome recorded).
        async with contextlib.aclosing(self.chunks(s)) as chunks:
            async for chunk in chunks:
                failed = "error" in chunk
                yield sse_data(chunk)
        if not failed:
            yield b"data: [DONE]\n\n"

    async def chunks(self, s: Started) -> AsyncGenerator[dict[str, Any], None]:
        """The stream's chunks as objects, an error body last when it fails (headers are
        out by then); it closes the generation and records the outcome however it ends."""
        head, opts = s.head, s.opts
        code = "CANCELLED"
        error: ServiceError | None = None
        choices = [render.Choice(i) for i in range(len(s.gen.requests))]
        offsets = [0] * len(choices)
        text = self._text

        def live(chs: list[render.Choice]) -> dict[str, Any] | None:
            return render.running_usage(chs) if opts.continuous_usage else None

        try:
            async with contextlib.aclosing(s.gen.events()) as events:
                async for i, event in events:
                    choice = choices[i]
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
            s.log.error("http.failed", **where(exc))
            code = "INTERNAL"
            yield error_body(internal("SERVER"))
        finally:
            s.recorder.done(s.method, code, error)


def sse_data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
