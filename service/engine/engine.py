"""The engine the service talks to: one engine thread that owns an ``EngineCore``, its inbox,
and the asyncio bridge.

Single owner: only the engine thread touches the core (and, through its scheduler, the KV
cache). Every other thread talks to it by putting a command in the inbox, which the thread
drains at each step boundary and while idle. Results come back through per-request sinks
(``loop.call_soon_threadsafe`` into an ``asyncio.Queue``), futures for queries, and
``counters()``, a snapshot published after every step. No lock of the engine is visible
outside this module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import structlog
import torch

from kvcache.config import TenantCachePolicy
from kvcache.manager import KVCacheManager
from kvcache.results import SharedPublish
from kvcache.stats import TenantUsage
from service.engine import compiled
from service.engine.core import EngineCore, check_policy
from service.engine.cuda_graphs import DecodeGraphs
from service.engine.tokens import TokenizerLike
from service.engine.types import (
    EngineConfig,
    EngineCounters,
    EngineEvent,
    EngineStats,
    EngineStopped,
    Finished,
    Request,
    TenantSchedPolicy,
)
from service.engine.warmup import WarmupProgress, run_warmup
from service.model.decoder import DecoderModel

if TYPE_CHECKING:
    from service.engine.hooks import EngineHooks

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class _Command:
    fn: Callable[[EngineCore], object]
    future: concurrent.futures.Future[object]


class Engine:
    """Continuous-batching engine. Every public method may be called from any thread;
    the coroutines must be awaited on the asyncio loop that streams the results.
    ``hooks``: its debug and test hooks, set by the factory that built it
    (``service.engine.factory.build_engine``)."""

    hooks: EngineHooks

    def __init__(
        self,
        model: DecoderModel,
        tokenizer: TokenizerLike,
        cache: KVCacheManager,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        sampler_seed: int | None = None,
    ) -> None:
        self._core = EngineCore.for_model(model, tokenizer, cache, config, clock, sampler_seed)
        self._model = model
        self.compiled: DecodeGraphs | None = None  # set on start where --compile applies
        self.config = self._core.config  # max_model_len capped to the model
        self.page_size = cache.page_size
        self.num_pages = cache.num_pages
        self.shared_pages = cache.config.shared_pages  # the shared prefixes' budget of them
        self.tier_bytes = 0 if cache.tier is None else cache.tier.budget_bytes
        self.vocab_size = model.config.vocab_size
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._counters = self._core.counters()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = False  # the engine thread has exited; commands run on the caller
        self._num_threads = torch.get_num_threads()  # the creator's; OpenMP's is per thread

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, progress: WarmupProgress | None = None) -> None:
        """Start the engine thread, which warms up first (if configured; ``progress(done,
        total)`` after each warm-up batch, called on that thread). Returns when it is ready;
        a warm-up error is raised here.
        NOTE: the warm-up runs on the engine thread so that no other thread keeps an OpenMP
        pool from it (see service.model.threads)."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready, progress), name="kvfence-engine", daemon=True
        )
        self._thread.start()
        try:
            ready.result()
        except BaseException:
            self._thread.join()
            self._thread = None
            raise

    def _run(
        self, ready: concurrent.futures.Future[None], progress: WarmupProgress | None
    ) -> None:
        torch.set_num_threads(self._num_threads)
        try:
            with torch.inference_mode():
                # Compiled on this thread, before any request holds a page (see compiled.py).
                self.compiled = compiled.attach(self._core, self._model, self.config.compile)
                if self.config.warmup:
                    run_warmup(self._core, progress)
        except BaseException as err:
            ready.set_exception(err)
            return
        self._counters = self._core.counters()
        ready.set_result(None)
        self._loop()

    def shutdown(self) -> None:
        """Abort everything and join the engine thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._done = True
        self._drain()
        self._core.finish_all("abort")
        self._counters = self._core.counters()

    # ---- requests ----------------------------------------------------------------------------
    async def submit(self, request: Request) -> AsyncGenerator[EngineEvent, None]:
        """Queue ``request`` and return its event stream: Admitted, Delta..., Finished.

        Raises QueueFull, InvalidRequest or RequestTooLarge once the engine thread has
        looked at it (at the next step boundary). Closing the stream before Finished aborts
        the request.
        """
        if self._thread is None or self._stop.is_set():
            raise EngineStopped("engine is not running")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def sink(event: EngineEvent) -> None:
            # A closed loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            await self._ask(lambda core: core.add(request, sink))
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise
        return self._stream(request.request_id, events)

    async def _stream(
        self, request_id: str, events: asyncio.Queue[EngineEvent]
    ) -> AsyncGenerator[EngineEvent, None]:
        finished = False
        try:
            while True:
                event = await events.get()
                finished = isinstance(event, Finished)
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Finish the request with reason "abort" at the next step boundary. Unknown ids
        are ignored. Does not wait."""
        self._post(lambda core: core.abort(request_id))

    def charge_cpu(self, tenant: str, seconds: float) -> None:
        """Charge ``tenant``'s fair share for CPU work done for it off the engine thread
        (grammar compiles, tokenization), at the next step boundary. Any thread; does not
        wait."""
        self._post(lambda core: core.charge_cpu(tenant, seconds))

    async def abort_all(self) -> int:
        """Finish every request with reason "abort" (drain); returns how many there were."""
        return await self._ask(lambda core: core.finish_all("abort"))

    # ---- tenants and queries -----------------------------------------------------------------
    def set_tenant_policy(
        self,
        tenant: str,
        sched: TenantSchedPolicy | None = None,
        cache: TenantCachePolicy | None = None,
    ) -> None:
        """Scheduling and/or KV policy for ``tenant``; applies to requests submitted after
        this call (commands run in order). Raises ValueError at once on a bad policy."""
        if sched is not None:
            check_policy(sched)
        self._post(lambda core: core.set_tenant_policy(tenant, sched, cache))

    def publish_shared(
        self, name: str, token_ids: Sequence[int]
    ) -> concurrent.futures.Future[SharedPublish]:
        """Declare (or replace) the operator's shared prefix ``name`` and prefill it on the
        engine thread at the next step boundary (``EngineCore.publish_shared``). Any thread;
        does not wait: the future answers."""
        ids = list(token_ids)
        return self._post(lambda core: core.publish_shared(name, ids))

    def withdraw_shared(self, name: str) -> concurrent.futures.Future[bool]:
        """Stop hits on the shared prefix ``name`` at the next step boundary. Any thread."""
        return self._post(lambda core: core.withdraw_shared(name))

    async def usage(self, tenant: str) -> TenantUsage:
        """The tenant's own KV pages and hit counters."""
        return await self._ask(lambda core: core.usage(tenant))

    async def purge(self, tenant: str) -> int:
        """Drop the tenant's cached prefixes; returns how many entries went."""
        return await self._ask(lambda core: core.purge(tenant))

    async def stats(self) -> EngineStats:
        """Counters and cache stats, taken together on the engine thread."""
        return await self._ask(lambda core: core.stats())

    def counters(self) -> EngineCounters:
        """The counters published after the last step (never waits)."""
        return self._counters

    def num_waiting(self) -> int:
        return self._counters.num_waiting

    def num_running(self) -> int:
        return self._counters.num_running

    # ---- documented test hooks ---------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Test hook: hold the engine thread at a step boundary. While paused no step runs
        and commands queue up (``submit`` and queries wait; ``abort`` does not)."""
        entered, release = threading.Event(), threading.Event()

        def hold(core: EngineCore) -> None:
            entered.set()
            release.wait()

        self._post(hold)
        entered.wait()
        try:
            yield
        finally:
            release.set()

    def at_step_boundary(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the engine thread at the next step boundary (tools and the
        factory's hooks, ``service.engine.hooks``); its result or exception settles the
        future."""
        return self._post(fn)

    # ---- the inbox and the engine thread --------------------------------------------------------
    def _post(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inbox.put(_Command(fn, future))  # type: ignore[arg-type]
        if self._thread is None or self._done:
            self._drain()  # no engine thread: this thread is the only one using the core
        else:
            self._wake.set()
        return future

    async def _ask(self, fn: Callable[[EngineCore], T]) -> T:
        return await asyncio.wrap_future(self._post(fn))

    def _drain(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not command.future.set_running_or_notify_cancel():
                continue
            try:
                command.future.set_result(command.fn(self._core))
            except BaseException as err:  # the caller gets it; the engine keeps going
                command.future.set_exception(err)

    def _loop(self) -> None:
        core = self._core
        with torch.inference_mode():
            while not self._stop.is_set():
                self._drain()
                ran = 0
                if core.has_work():
                    try:
                        ran = core.step().num_seqs
                    except Exception as err:  # fail what was in flight, keep serving
                        log.exception("engine_step_failed", error=type(err).__name__)
                        core.fail_running(err)
                self._counters = core.counters()
                if ran == 0 and self._inbox.empty():
                    # Idle, or everything waiting is blocked: sleep until a command arrives
                    # or the idle tick (deadlines, TTL eviction) instead of spinning.
                    self._wake.wait(self.config.idle_wait_s)
                    self._wake.clear()
                    core.idle_tick()
