"""``n`` sequences: the rest start after sequence 0's first token, never after its abort."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from service.admission.generation import Generation, admit_all
from service.admission.limiter import TenantLimiter
from service.admission.tenants import Quotas
from service.engine.types import Delta, EngineEvent, Finished, FinishReason, Request
from service.errors import ServiceError


def _finished(reason: FinishReason) -> Finished:
    return Finished(reason=reason, prompt_tokens=3, completion_tokens=0, cached_tokens=0,
                    queue_s=0.0, ttft_s=None, total_s=0.0)


class ScriptedEngine:
    """Sequence 0 ends with ``first``; every later sequence ends with "stop"."""

    def __init__(self, first: EngineEvent) -> None:
        self.first = first
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    async def submit(self, request: Request) -> AsyncIterator[EngineEvent]:
        self.submitted.append(request.request_id)
        event = self.first if len(self.submitted) == 1 else _finished("stop")

        async def stream() -> AsyncIterator[EngineEvent]:
            yield event
            if not isinstance(event, Finished):
                yield _finished("stop")

        return stream()

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def _started(engine: ScriptedEngine, limiter: TenantLimiter, n: int) -> Generation:
    leases = await admit_all(limiter, "t", 3, n)
    gen = Generation(engine, Request("r", "t", (1, 2, 3)), leases)  # type: ignore[arg-type]
    await gen.start()
    return gen


async def _run(first: EngineEvent) -> tuple[ScriptedEngine, list[tuple[int, object]]]:
    engine = ScriptedEngine(first)
    limiter = TenantLimiter(lambda: 0.0)
    limiter.configure("t", Quotas())
    gen = await _started(engine, limiter, 3)
    seen: list[tuple[int, object]] = []
    try:
        async with contextlib.aclosing(gen.events()) as events:
            async for i, event in events:
                seen.append((i, event))
    except ServiceError as err:  # an abnormal finish ends the response with its status
        seen.append((0, err))
    await asyncio.sleep(0)
    assert limiter.active("t") == 0  # closing the events released every slot
    return engine, seen


def test_rest_start_after_the_first_token() -> None:
    delta = Delta(token_ids=(7,), text="x")
    engine, seen = asyncio.run(_run(delta))
    assert engine.submitted == ["r-0", "r-1", "r-2"]
    assert sorted(i for i, e in seen if isinstance(e, Finished)) == [0, 1, 2]


def test_aborted_first_sequence_starts_no_more() -> None:
    engine, seen = asyncio.run(_run(_finished("abort")))
    assert engine.submitted == ["r-0"]
    assert [i for i, _ in seen] == [0]
    error = seen[0][1]
    assert isinstance(error, ServiceError) and error.code == grpc.StatusCode.CANCELLED


def test_closing_unread_events_releases_the_generation() -> None:
    """The events closed before anything was read (a client gone at once) still abort the
    sequence and release its slots."""

    async def run() -> tuple[ScriptedEngine, int]:
        engine = ScriptedEngine(Delta(token_ids=(7,), text="x"))
        limiter = TenantLimiter(lambda: 0.0)
        limiter.configure("t", Quotas())
        gen = await _started(engine, limiter, 1)
        await gen.events().aclose()
        return engine, limiter.active("t")

    engine, active = asyncio.run(run())
    assert active == 0
    assert engine.aborted == ["r"]
