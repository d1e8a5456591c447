"""The whole answer to an OpenAI generation (``"stream"`` unset or false): one JSON body
once every sequence finished, or the answer of its failure, or 499 when the client went
away first (its pages are then already being freed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from service.engine.types import Admitted, Delta
from service.errors import ServiceError, internal
from service.http import render
from service.http.error_replies import error_response
from service.http.replies import Started, where
from service.structured.tool_calls import CallsMade

T = TypeVar("T")


class BodyReply:
    """Answers with one body; ``token_text`` renders a token id."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self._text = token_text

    async def answer(self, request: HttpRequest, s: Started) -> Response:
        body = await self.collect(request, s)
        return body if isinstance(body, Response) else JSONResponse(body)

    async def collect(self, request: HttpRequest, s: Started) -> dict[str, Any] | Response:
        """The body, or the answer of its failure (or of a client gone). The generation is
        closed on every way out: ``_body`` opens its events at its first step, which runs
        before the disconnect watch can answer (tasks start in the order they were made)."""
        try:
            body = await until_disconnect(request.receive, self._body(s))
        except ServiceError as err:
            s.recorder.done(s.method, err.code.name, err)
            return error_response(err)
        except Exception as exc:
            s.log.error("http.failed", **where(exc))
            s.recorder.done(s.method, "INTERNAL")
            return error_response(internal("SERVER"))
        if body is None:  # the client went away; its pages are already being freed
            s.recorder.done(s.method, "CANCELLED")
            return Response(status_code=499)
        s.recorder.done(s.method, "OK")
        return body

    async def _body(self, s: Started) -> dict[str, Any]:
        """The whole non-streaming body, once every sequence finished."""
        head, opts = s.head, s.opts
        choices = [render.Choice(i) for i in range(len(s.gen.requests))]
        async with contextlib.aclosing(s.gen.events()) as events:
            async for i, event in events:
                choice = choices[i]
                if isinstance(event, Admitted):
                    choice.cached_tokens = event.cached_tokens
                elif isinstance(event, Delta):
                    choice.text.append(event.text)
                    choice.logprobs.extend(event.logprobs)
                elif isinstance(event, CallsMade):
                    choice.tool_calls.extend(event.calls)
                else:
                    choice.finish = event
        return render.complete_body(
            head.endpoint, head.ident, head.created, head.model, choices, opts, self._text
        )



async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T | None:
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
