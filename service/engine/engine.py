"""The engine the service talks to: an engine thread driving ``EngineCore`` plus the
asyncio bridge.

``submit`` must be called on the asyncio loop. Each request gets an ``asyncio.Queue``; the
engine thread hands events over with ``loop.call_soon_threadsafe`` so the loop never blocks
on the model and the engine never blocks on a slow consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncGenerator, Callable

import structlog
import torch

from service.engine.cache_api import CacheManager
from service.engine.core import EngineCore
from service.engine.tokens import TokenizerLike, TokenSource
from service.engine.types import (
    EngineConfig,
    EngineEvent,
    EngineStopped,
    Finished,
    Request,
    TenantSchedPolicy,
)
from service.engine.warmup import WarmupProgress, run_warmup
from service.model.llama import LlamaModel

log = structlog.get_logger(__name__)


class Engine:
    """Continuous-batching engine. Thread-safe except where noted."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: TokenizerLike,
        cache: CacheManager,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        sampler_seed: int | None = None,
    ) -> None:
        model_config = model.config
        # Positions past the model's RoPE table do not exist: cap the context length.
        config = dataclasses.replace(
            config, max_model_len=min(config.max_model_len, model_config.max_position_embeddings)
        )
        device = model.device
        tokens = TokenSource(tokenizer, model_config.vocab_size, model_config.eos_token_ids)
        self.config = config
        self.core = EngineCore(model, tokens, cache, config, clock, device, sampler_seed)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_tenant_policy(self, tenant: str, policy: TenantSchedPolicy) -> None:
        self.core.set_tenant_policy(tenant, policy)

    def start(self, progress: WarmupProgress | None = None) -> None:
        """Warm up (if configured; ``progress(done, total)`` after each warm-up batch), then
        start the engine thread. Returns when ready."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        if self.config.warmup:
            run_warmup(self.core, progress)
        self._thread = threading.Thread(target=self._loop, name="kvfence-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> AsyncGenerator[EngineEvent, None]:
        """Queue ``request`` and return its event stream: Admitted, Delta..., Finished.

        Raises QueueFull, InvalidRequest or RequestTooLarge at once. Closing the iterator
        before Finished aborts the request.
        """
        if self._thread is None or self._stop.is_set():
            raise EngineStopped("engine is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def sink(event: EngineEvent) -> None:
            # A closed loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, event)

        self.core.add(request, sink)
        self._wake.set()
        return self._stream(request.request_id, queue)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[EngineEvent]
    ) -> AsyncGenerator[EngineEvent, None]:
        finished = False
        try:
            while True:
                event = await queue.get()
                if isinstance(event, Finished):
                    finished = True
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Finish the request with reason "abort" within one step. Unknown ids are ignored."""
        self.core.abort(request_id)
        self._wake.set()

    def shutdown(self) -> None:
        """Abort everything and join the engine thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.core.finish_all("abort")

    def num_waiting(self) -> int:
        return self.core.num_waiting()

    def num_running(self) -> int:
        return self.core.num_running()

    def _loop(self) -> None:
        core = self.core
        with torch.inference_mode():
            while not self._stop.is_set():
                ran = 0
                if core.has_work():
                    try:
                        ran = core.step().num_seqs
                    except Exception as err:  # fail what was in flight, keep serving
                        log.exception("engine_step_failed", error=type(err).__name__)
                        core.fail_running(err)
                if ran == 0:
                    # Idle, or everything waiting is blocked: sleep until a submit/abort or
                    # the idle tick (deadlines, TTL eviction) instead of spinning.
                    self._wake.wait(self.config.idle_wait_s)
                    self._wake.clear()
                    core.idle_tick()
