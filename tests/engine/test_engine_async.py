"""The threaded Engine and its asyncio bridge (tiny model)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvcache import CacheConfig
from service.engine import (
    Admitted,
    Delta,
    Engine,
    EngineConfig,
    EngineStopped,
    Finished,
    QueueFull,
    TenantSchedPolicy,
    build_engine,
)
from service.engine.tuning import SchedulerTuning
from service.engine.types import WARMUP_TENANT, EngineEvent
from service.engine.warmup import run_warmup
from service.model import LoadedModel
from tests.engine.conftest import (
    Recorder,
    assert_at_baseline,
    make_core,
    prompt_ids,
    req,
    run_all,
    untimed,
)

V = 384


def started(tiny: LoadedModel, **config: Any) -> Engine:
    engine = build_engine(
        tiny,
        dataclasses.replace(EngineConfig(warmup=False), **config),
        CacheConfig(page_size=16),
        kv_pages=256,
    )
    engine.start()
    return engine


async def collect(stream: AsyncIterator[EngineEvent]) -> list[EngineEvent]:
    return [event async for event in stream]


def test_warmup_runs_before_start_returns_and_leaves_pool_at_baseline(tiny: LoadedModel) -> None:
    engine = build_engine(tiny, EngineConfig(tuning=untimed(max_num_batched_tokens=64)), CacheConfig(), kv_pages=64)
    engine.start()
    try:
        stats = asyncio.run(engine.stats())
        # one prefill + 5 decode batch sizes x 3 tokens
        assert engine.counters().num_steps >= 1 + 5 * 3
        assert stats.cache.free_pages == 64
        usage = asyncio.run(engine.usage(WARMUP_TENANT))
        assert usage.pages_in_use == 0 and usage.pages_cached == 0 and usage.cached_prefixes == 0
        assert_at_baseline(stats)
    finally:
        engine.shutdown()


def test_streams_match_the_core_and_events_are_ordered(tiny: LoadedModel) -> None:
    requests = [req(f"r{i}", prompt_ids(i, 5 + 20 * i, V), max_tokens=4 + i) for i in range(6)]
    reference = Recorder()
    run_all(make_core(tiny), reference, requests)
    engine = started(tiny)
    try:

        async def main() -> list[list[EngineEvent]]:
            streams = [await engine.submit(r) for r in requests]
            return await asyncio.gather(*(collect(s) for s in streams))

        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for r, events in zip(requests, results, strict=True):
        assert isinstance(events[0], Admitted) and isinstance(events[-1], Finished)
        deltas = [e for e in events[1:-1] if isinstance(e, Delta)]
        assert len(deltas) == len(events) - 2
        tokens = [t for e in deltas for t in e.token_ids]
        assert tokens == reference.tokens(r.request_id)
        assert events[-1].completion_tokens == len(tokens)
    assert_at_baseline(asyncio.run(engine.stats()))


def test_abort_and_closing_the_stream_free_the_request(tiny: LoadedModel) -> None:
    engine = started(tiny)
    try:

        async def main() -> tuple[list[EngineEvent], int]:
            long = req("long", prompt_ids(1, 10, V), max_tokens=500, ignore_eos=True)
            gone = req("gone", prompt_ids(2, 10, V), max_tokens=500, ignore_eos=True)
            events: list[EngineEvent] = []
            stream = await engine.submit(long)
            closed = await engine.submit(gone)
            async for event in stream:
                events.append(event)
                if len(events) == 3:
                    engine.abort("long")
            first = [await closed.__anext__() for _ in range(3)]
            await closed.aclose()  # the client went away
            return events, len(first)

        events, _ = asyncio.run(main())
        fin = events[-1]
        assert isinstance(fin, Finished) and fin.reason == "abort"
        assert 2 <= fin.completion_tokens < 500
        deadline = time.monotonic() + 5
        while engine.counters().num_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert_at_baseline(asyncio.run(engine.stats()))
    finally:
        engine.shutdown()


def test_abort_all_finishes_running_and_waiting_requests(tiny: LoadedModel) -> None:
    """Drain's one call: every request, running or queued, ends with Finished(abort) and
    its pages go back; the engine keeps serving afterwards."""
    engine = started(tiny, max_num_seqs=1)
    try:

        async def main() -> tuple[int, list[EngineEvent], list[EngineEvent], list[EngineEvent]]:
            run = await engine.submit(
                req("run", prompt_ids(1, 10, V), max_tokens=10_000, ignore_eos=True)
            )
            await run.__anext__()  # admitted
            queued = await engine.submit(req("queued", [5, 6], max_tokens=3))
            aborted = await engine.abort_all()
            ran, waited = await collect(run), await collect(queued)
            after = await collect(await engine.submit(req("after", [7], max_tokens=2)))
            return aborted, ran, waited, after

        aborted, ran, waited, after = asyncio.run(main())
        assert aborted == 2
        assert isinstance(ran[-1], Finished) and ran[-1].reason == "abort"
        assert isinstance(waited[-1], Finished) and waited[-1].reason == "abort"
        assert isinstance(after[-1], Finished) and after[-1].reason == "length"
        assert asyncio.run(engine.abort_all()) == 0
        assert_at_baseline(asyncio.run(engine.stats()))
    finally:
        engine.shutdown()


def test_queue_full_raises_from_submit_and_shutdown_aborts(tiny: LoadedModel) -> None:
    engine = started(tiny, max_num_seqs=1)
    engine.set_tenant_policy("t1", TenantSchedPolicy(max_waiting=1))

    async def main() -> list[EngineEvent]:
        busy = await engine.submit(
            req("busy", prompt_ids(1, 10, V), max_tokens=10_000, ignore_eos=True)
        )
        await busy.__anext__()  # admitted: the queue is empty again
        waiting = await engine.submit(req("w", [5], max_tokens=1))
        with pytest.raises(QueueFull):
            await engine.submit(req("x", [5], max_tokens=1))
        engine.shutdown()
        rest = await collect(busy)
        last = (await collect(waiting))[-1]
        assert isinstance(last, Finished) and last.reason == "abort"
        with pytest.raises(EngineStopped):
            await engine.submit(req("y", [5]))
        return rest

    rest = asyncio.run(main())
    assert isinstance(rest[-1], Finished) and rest[-1].reason == "abort"
    assert_at_baseline(asyncio.run(engine.stats()))


def test_the_warm_up_tenant_does_not_stay_present_after_warm_up(tiny: LoadedModel) -> None:
    """Present for ``idle_grace_s``, it would time the first real tenant's steps as if
    another tenant had work."""
    core = make_core(tiny, config=EngineConfig(tuning=SchedulerTuning(idle_grace_s=1e6)))
    run_warmup(core)
    assert core.num_steps > 0
    assert WARMUP_TENANT not in core.scheduler.present()
