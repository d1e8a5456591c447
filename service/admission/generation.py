"""The ``n`` engine sequences of one OpenAI request, merged into one event stream.

Sequence 0 is submitted first; the others are submitted once it has produced its first
token, when its full prompt pages are in the tenant's prefix cache, so sequences 1..n-1 map
those same pages instead of computing and storing the prompt again. Each sequence takes
its own concurrency slot and token budget from the tenant's limiter, as a gRPC stream does;
the front takes them with ``admit_all`` before it tokenizes (the input charged by its size),
and the ``Generation`` holds them. ``close`` (always called) aborts whatever has not
finished, which frees its pages in the engine's next step, and releases the slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from service.admission.limiter import LeaseLike, Limiter
from service.admission.outcomes import submit_error
from service.engine.types import Delta, EngineError, EngineEvent, Finished, Request
from service.errors import ServiceError
from service.protocols import EngineLike


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
    """The sequences of ``base``, one per lease in ``leases`` (taken by ``admit_all``)."""

    def __init__(self, engine: EngineLike, base: Request, leases: list[LeaseLike]) -> None:
        n = len(leases)
        self._engine = engine
        self._requests = [_nth(base, i, n) for i in range(n)]
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

    async def events(self) -> AsyncIterator[tuple[int, EngineEvent]]:
        """(sequence index, event) until every sequence has finished. Raises ServiceError if
        a later sequence's submit was refused."""
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
