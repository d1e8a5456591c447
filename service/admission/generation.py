"""The ``n`` engine sequences of one admitted request, merged into one event stream: what
``Admission.start`` returns to both fronts (gRPC runs one sequence, OpenAI's ``n`` more).

Sequence 0 is submitted first; the others are submitted once it has produced its first
token, when its full prompt pages are in the tenant's prefix cache, so sequences 1..n-1 map
those same pages instead of computing and storing the prompt again. Each sequence takes
its own concurrency slot and token budget from the tenant's limiter; admission takes them
with ``admit_all`` before it tokenizes (the input charged by its size), and the
``Generation`` holds them. ``close`` (always called) aborts whatever has not finished,
which frees its pages in the engine's next step, and releases the slots.

The events a front reads are counted here, once for both fronts: each sequence's engine
events go to the request's metrics and its adapter's usage (``Recording``), then through a
``ToolSplitter`` (tool calls out of the text), so a front only renders them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from service.admission.limiter import LeaseLike, Limiter
from service.admission.outcomes import finish_error, submit_error
from service.admission.request_fields import Fields
from service.admission.tenant_adapters import Adapters
from service.engine.types import Delta, EngineError, EngineEvent, Finished, Request
from service.errors import ServiceError
from service.protocols import EngineLike
from service.structured.tool_calls import CallsMade, ToolSplitter
from service.telemetry.request_metrics import RequestMetrics, SequenceMetrics

#: What a front reads: an engine event, or the tool calls a delta completed.
StreamEvent = EngineEvent | CallsMade


@dataclass(frozen=True, slots=True)
class Recording:
    """Where a generation's engine events are counted: the request's metrics (timed by
    ``clock``) and each finished sequence's adapter usage."""

    metrics: RequestMetrics
    adapters: Adapters
    clock: Callable[[], float]


async def admit_all(limiter: Limiter, tenant: str, cost: int, n: int) -> list[LeaseLike]:
    """``n`` slots of ``cost`` tokens each from the tenant's limiter, all or none. Raises
    ServiceError (nothing held)."""
    leases: list[LeaseLike] = []
    try:
        for _ in range(n):
            leases.append(await limiter.admit(tenant, cost))
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    return leases


class Generation:
    """The sequences of ``base``, one per lease in ``leases`` (taken by ``admit_all``);
    ``fields``: the request as admission read it; ``recording``: where its events are
    counted (None: nowhere); ``is_draining`` words an abort (UNAVAILABLE while the server
    drains, else CANCELLED)."""

    def __init__(
        self,
        engine: EngineLike,
        base: Request,
        leases: list[LeaseLike],
        fields: Fields | None = None,
        recording: Recording | None = None,
        is_draining: Callable[[], bool] | None = None,
    ) -> None:
        n = len(leases)
        self._engine = engine
        self._is_draining = is_draining or _never
        self.fields = fields
        self._requests = [_nth(base, i, n) for i in range(n)]
        self._recording = recording
        # Started before the first submit, so a sequence's time to first token includes
        # its wait in the engine's queue.
        self._sequence_metrics: list[SequenceMetrics] = [] if recording is None else [
            recording.metrics.sequence(len(r.prompt_ids), recording.clock, i)
            for i, r in enumerate(self._requests)
        ]
        plan = fields.tool_plan if fields is not None else None
        self._splitters = [ToolSplitter(plan) for _ in self._requests]
        self._leases = leases
        self._queue: asyncio.Queue[tuple[int, EngineEvent | ServiceError]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._finished: set[int] = set()
        self._rest_started = False
        self._only: AsyncIterator[EngineEvent] | None = None  # n == 1: read with no pump

    @property
    def requests(self) -> Sequence[Request]:
        return self._requests

    async def start(self) -> None:
        """Submit sequence 0. Raises ServiceError (then nothing is held any more)."""
        try:
            await self._submit(0)
        except BaseException:
            self.close()
            raise

    async def _submit(self, i: int) -> None:
        try:
            stream = await self._engine.submit(self._requests[i])
        except EngineError as exc:
            raise submit_error(exc) from None
        if len(self._requests) == 1:  # one sequence: events() reads it in the caller's task
            self._only = stream
            return
        self._tasks.append(asyncio.create_task(self._pump(i, stream)))

    async def _pump(self, i: int, stream: AsyncIterator[EngineEvent]) -> None:
        async for event in stream:
            if isinstance(event, Finished):
                self._finished.add(i)
            self._queue.put_nowait((i, event))
            if i == 0 and not self._rest_started and isinstance(event, Delta | Finished):
                self._rest_started = True
                if isinstance(event, Finished) and event.reason not in ("stop", "length"):
                    # Aborted (drain, deadline) or failed: the caller ends the response on
                    # this event; submitting the rest would only start work nobody reads.
                    continue
                for j in range(1, len(self._requests)):
                    try:
                        await self._submit(j)
                    except ServiceError as err:  # raised by ``events`` in the caller's task
                        self._finished.add(j)
                        self._queue.put_nowait((j, err))

    def tool_called(self, i: int) -> bool:
        """Whether sequence ``i`` made a tool call (its finish reason is then
        ``tool_calls`` where it would be ``stop``)."""
        return self._splitters[i].called

    def events(self) -> GenerationEvents:
        """(sequence index, event) until every sequence has finished, each engine event
        counted, then split by the sequence's ``ToolSplitter``. A sequence that finishes
        other than by ``stop`` or ``length`` raises its ServiceError (``finish_error``), as
        does a later sequence's refused submit. Closing the stream (``contextlib.aclosing``)
        closes the generation, read or not."""
        return GenerationEvents(self, self._split_events())

    async def _split_events(self) -> AsyncGenerator[tuple[int, StreamEvent], None]:
        async for i, raw in self._engine_events():
            self._record(i, raw)
            for event in self._splitters[i].split(raw):
                if isinstance(event, Finished) and event.reason not in ("stop", "length"):
                    raise finish_error(event, self._is_draining())
                yield i, event

    def _record(self, i: int, event: EngineEvent) -> None:
        """The engine's own events are what the metrics count, on both fronts."""
        if self._recording is None:
            return
        if isinstance(event, Delta):
            self._sequence_metrics[i].delta(len(event.token_ids))
        elif isinstance(event, Finished):
            self._sequence_metrics[i].finished(event)
            self._recording.adapters.record(self._requests[i], event)

    async def _engine_events(self) -> AsyncIterator[tuple[int, EngineEvent]]:
        if self._only is not None:  # no task and no queue between the engine and the caller
            async for only in self._only:
                if isinstance(only, Finished):
                    self._finished.add(0)
                yield 0, only
                if isinstance(only, Finished):
                    return
            return
        done = 0
        while done < len(self._requests):
            i, event = await self._queue.get()
            if isinstance(event, ServiceError):
                raise event
            if isinstance(event, Finished):
                done += 1
            yield i, event

    def abort(self) -> None:
        """Abort the unfinished sequences; each still ends with its ``Finished`` event."""
        for i, req in enumerate(self._requests):
            if i not in self._finished:
                self._engine.abort(req.request_id)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.abort()
        for lease in self._leases:
            lease.release()
        self._leases.clear()


def _nth(base: Request, i: int, n: int) -> Request:
    """Sequence ``i``: its own id, and its own seed so seeded sequences differ."""
    if n == 1:
        return base
    seed = base.sampling.seed
    sampling = base.sampling
    if seed is not None:
        sampling = dataclasses.replace(sampling, seed=(seed + i) % 2**64)
    return dataclasses.replace(base, request_id=f"{base.request_id}-{i}", sampling=sampling)


def _never() -> bool:
    return False


class GenerationEvents:
    """The event stream of one ``Generation``: an async iterator whose ``aclose`` closes
    the generation (aborts what has not finished, releases the limiter's slots) even when
    the stream was never read, so a caller that opens it with ``contextlib.aclosing``
    holds nothing past its block however it leaves."""

    def __init__(self, gen: Generation, events: AsyncGenerator[tuple[int, StreamEvent], None]
                 ) -> None:
        self._gen = gen
        self._events = events

    def __aiter__(self) -> GenerationEvents:
        return self

    async def __anext__(self) -> tuple[int, StreamEvent]:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            self._gen.close()
