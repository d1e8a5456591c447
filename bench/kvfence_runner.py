"""kvfence as the system under test: the engine in process, and the gRPC service.

Both drivers take the same `Work` list, send every request greedy with ignore_eos (so each
produces exactly its max_tokens), and return a client-side `RequestTrace` per request.
Arrival times and a concurrency cap are optional, as in vLLM `bench serve`.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import sys
import time
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import Work
from bench.traces import RequestTrace
from kvcache import CacheConfig
from kvcache.config import ScrubPolicy
from service.admission.tenants import (
    DeclaredPrefix,
    Quotas,
    Tenant,
    TenantRegistry,
    hash_key,
    new_api_key,
)
from service.engine.engine import Engine
from service.engine.factory import build_engine
from service.engine.tuning import SchedulerTuning
from service.engine.types import (
    Admitted,
    Delta,
    EngineConfig,
    Finished,
    Request,
    SamplingParams,
    StoppingParams,
)
from service.model.loader import LoadedModel, load_model
from service.serve.app import EngineSizing, build_server
from service.serve.kvfence_server import ServerOptions
from service.telemetry.logs import make_logger

if TYPE_CHECKING:
    from clients.aio import AsyncClient

GREEDY = SamplingParams(temperature=0.0)
# Every tenant may hold more streams than any suite sends, so the gRPC path is never throttled
# by quotas the in-process engine does not have.
STREAM_QUOTA = 1024


@dataclass(frozen=True, slots=True)
class Sizing:
    """Engine and KV settings shared by the in-process engine and the gRPC server."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = SchedulerTuning().max_num_batched_tokens
    max_model_len: int = 2048
    kv_bytes: int = 1 << 30
    kv_pages: int | None = None  # set: the in-process engine's pool has exactly this many pages
    scrub_policy: ScrubPolicy = "reassign"
    prefix_ttl_s: float = 600.0
    # The in-process engine's step budget: 0 = untimed (the whole token budget each step);
    # the served default is SchedulerTuning's (100 ms with decode_stretch 2).
    max_step_ms: float = 0.0
    decode_stretch: float = SchedulerTuning().decode_stretch
    compile: str = "off"  # --compile (service/engine/compiled.py)
    # The KV tier of the gRPC server (--kv-tier-dir, --kv-tier-bytes, --kv-tier-secret-file).
    kv_tier_dir: str | None = None
    kv_tier_bytes: str = "1GiB"
    kv_tier_secret_file: str | None = None

    def engine_config(self) -> EngineConfig:
        tuning = SchedulerTuning(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_step_ms=self.max_step_ms,
            decode_stretch=self.decode_stretch,
        )
        return EngineConfig(
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            tuning=tuning,
            compile=self.compile,
        )

    def cache_config(self) -> CacheConfig:
        return CacheConfig(scrub_policy=self.scrub_policy, default_ttl_s=self.prefix_ttl_s)

    def serve_sizing(self) -> EngineSizing:
        return EngineSizing(
            kv_memory=str(self.kv_bytes),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            scrub_policy=self.scrub_policy,
            prefix_ttl_s=self.prefix_ttl_s,
            sampler_seed=0,
            compile=self.compile,
            kv_tier_dir=self.kv_tier_dir,
            kv_tier_bytes=self.kv_tier_bytes,
            kv_tier_secret_file=self.kv_tier_secret_file,
        )


def load_kvfence(path: object, batch_invariant: str = "auto") -> LoadedModel:
    return load_model(str(path), progress=False, batch_invariant=batch_invariant)


@contextmanager
def started_engine(loaded: LoadedModel, sizing: Sizing = Sizing()) -> Iterator[Engine]:
    """A started engine (its warm-up included) that is shut down on exit."""
    engine = build_engine(
        loaded,
        sizing.engine_config(),
        sizing.cache_config(),
        kv_pages=sizing.kv_pages,
        kv_bytes=None if sizing.kv_pages else sizing.kv_bytes,
        sampler_seed=0,
    )
    engine.start()
    gc.freeze()  # as `kvfence serve` does once it serves (service/serve/app.py)
    try:
        yield engine
    finally:
        engine.shutdown()


@asynccontextmanager
async def grpc_server(
    loaded: LoadedModel,
    tenants: Sequence[str],
    sizing: Sizing = Sizing(),
    *,
    shared_prefixes: Mapping[str, str] | None = None,
    readers: Collection[str] = (),
    max_kv_pages: int = 0,
) -> AsyncIterator[tuple[str, dict[str, str], Engine]]:
    """An in-process server on 127.0.0.1:0 in the running loop, as tests/serverutil.py starts
    one; yields (target, {tenant: api key}, engine). ``shared_prefixes`` (name -> text) are
    the tenants file's, read by the tenants in ``readers``; ``max_kv_pages`` (0: a share of
    the pool by weight) is every tenant's KV share, overcommitted."""
    keys = {t: new_api_key() for t in tenants}
    declared = {n: DeclaredPrefix(text) for n, text in (shared_prefixes or {}).items()}
    quotas = Quotas(max_concurrent_streams=STREAM_QUOTA, max_kv_pages=max_kv_pages)
    registry = TenantRegistry(
        {
            t: Tenant(
                t,
                key_hashes=(hash_key(k),),
                quotas=quotas,
                shared_prefixes=tuple(declared) if t in readers else (),
            )
            for t, k in keys.items()
        },
        shared_prefixes=declared,
    )
    log = make_logger("json", io.StringIO())
    options = ServerOptions(kv_overcommit=bool(max_kv_pages))
    stack = await asyncio.to_thread(
        build_server, loaded, sizing.serve_sizing(), registry, options, log
    )
    try:
        port = await stack.server.start()
        gc.freeze()  # as `kvfence serve` does once it serves (service/serve/app.py)
        yield f"127.0.0.1:{port}", keys, stack.engine
    finally:
        await stack.server.close()
        if stack.grammars is not None:  # its compile thread holds the engine (and its pool)
            stack.grammars.shutdown()
        await asyncio.to_thread(stack.engine.shutdown)


async def drive(
    count: int,
    one: Callable[[int], Awaitable[RequestTrace]],
    arrivals: Sequence[float] | None = None,
    max_concurrency: int | None = None,
) -> tuple[float, list[RequestTrace]]:
    """Launch request i at arrivals[i] (seconds from start; all at once if None), at most
    max_concurrency in flight; returns (wall seconds, traces in request order)."""
    start = time.perf_counter()
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def launch(i: int) -> RequestTrace:
        if arrivals is not None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        if gate is None:
            return await one(i)
        async with gate:
            return await one(i)

    traces = await asyncio.gather(*(launch(i) for i in range(count)))
    return time.perf_counter() - start, list(traces)


async def run_engine(
    engine: Engine,
    work: Sequence[Work],
    tenants: Sequence[str] = ("bench",),
    *,
    bypass_prefix_cache: bool = False,
    arrivals: Sequence[float] | None = None,
    max_concurrency: int | None = None,
) -> tuple[float, list[RequestTrace]]:
    """Submit work[i] as tenant tenants[i % len(tenants)] straight to the engine."""

    async def one(i: int) -> RequestTrace:
        w = work[i]
        trace = RequestTrace(tenants[i % len(tenants)], len(w.prompt_ids), time.perf_counter())
        request = Request(
            request_id=uuid.uuid4().hex,
            tenant=trace.tenant,
            prompt_ids=w.prompt_ids,
            sampling=GREEDY,
            stopping=StoppingParams(max_tokens=w.max_tokens, ignore_eos=True),
            bypass_prefix_cache=bypass_prefix_cache,
        )
        async for event in await engine.submit(request):
            if isinstance(event, Delta):
                trace.on_chunk(time.perf_counter(), len(event.token_ids), event.token_ids)
            elif isinstance(event, Admitted):
                trace.cached_tokens = event.cached_tokens
            elif isinstance(event, Finished):
                trace.end = time.perf_counter()
                trace.finish_reason = event.reason
        return trace

    return await drive(len(work), one, arrivals, max_concurrency)


async def run_grpc_elsewhere(
    target: str,
    api_keys: Mapping[str, str],
    work: Sequence[Work],
    tenants: Sequence[str],
    *,
    bypass_prefix_cache: bool = False,
    max_concurrency: int | None = None,
) -> tuple[float, list[RequestTrace]]:
    """:func:`run_grpc` from a client process of its own (``bench.grpc_client``), as a
    deployed client calls the server; this process's loop keeps serving meanwhile."""
    job = {
        "max_concurrency": max_concurrency,
        "target": target,
        "api_keys": dict(api_keys),
        "work": [{"prompt_ids": list(w.prompt_ids), "max_tokens": w.max_tokens} for w in work],
        "tenants": list(tenants),
        "bypass_prefix_cache": bypass_prefix_cache,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.grpc_client",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=str(Path(__file__).resolve().parents[1]),
    )
    out, err = await proc.communicate(json.dumps(job).encode())
    if proc.returncode != 0:
        raise RuntimeError(f"bench.grpc_client failed: {err.decode()[-2000:]}")
    data = json.loads(out)
    return float(data["wall_s"]), [RequestTrace(**t) for t in data["traces"]]


async def run_grpc(
    target: str,
    api_keys: Mapping[str, str],
    work: Sequence[Work],
    tenants: Sequence[str],
    *,
    bypass_prefix_cache: bool = False,
    arrivals: Sequence[float] | None = None,
    max_concurrency: int | None = None,
    texts: Sequence[str] | None = None,
    temperature: float = 0.0,
) -> tuple[float, list[RequestTrace]]:
    """The same as run_engine, through clients.AsyncClient (one channel per tenant). With
    ``texts``, request i sends texts[i] (the server tokenizes it) instead of its token ids."""
    from clients.aio import AsyncClient
    from clients.types import Chunk, Started
    from clients.types import Finished as WireFinished

    clients = {t: AsyncClient(target, api_key=api_keys[t], retries=0) for t in tenants}

    async def one(i: int) -> RequestTrace:
        w = work[i]
        trace = RequestTrace(tenants[i % len(tenants)], len(w.prompt_ids), time.perf_counter())
        stream = clients[trace.tenant].generate(
            texts[i] if texts is not None else None,
            token_ids=None if texts is not None else w.prompt_ids,
            max_tokens=w.max_tokens,
            temperature=temperature,
            ignore_eos=True,
            bypass_prefix_cache=bypass_prefix_cache,
        )
        async for event in stream:
            if isinstance(event, Chunk):
                trace.on_chunk(time.perf_counter(), len(event.token_ids), event.token_ids)
            elif isinstance(event, Started):
                trace.cached_tokens = event.cached_prompt_tokens
            elif isinstance(event, WireFinished):
                trace.end = time.perf_counter()
                trace.finish_reason = event.reason
        return trace

    try:
        return await drive(len(work), one, arrivals, max_concurrency)
    finally:
        for client in clients.values():
            await client.close()


def check_complete(work: Sequence[Work], traces: Sequence[RequestTrace]) -> None:
    """Every request must have produced exactly its max_tokens, else the run is invalid."""
    for i, (w, t) in enumerate(zip(work, traces, strict=True)):
        if t.output_tokens != w.max_tokens or t.finish_reason != "length":
            raise RuntimeError(
                f"request {i}: {t.output_tokens}/{w.max_tokens} tokens, finish={t.finish_reason!r}"
            )


async def ttft_and_cached(client: AsyncClient, ids: list[int]) -> tuple[float, int]:
    """One greedy 2-token request of ``ids`` through ``client``: its time to first token and
    the cached prompt tokens its ``Started`` reported (-1 if none came)."""
    from clients.types import Chunk, Started

    start = time.perf_counter()
    ttft: float | None = None
    cached = -1
    async for event in client.generate(
        token_ids=ids, max_tokens=2, temperature=0.0, ignore_eos=True
    ):
        if isinstance(event, Started):
            cached = event.cached_prompt_tokens
        elif isinstance(event, Chunk) and event.token_ids and ttft is None:
            ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft, cached
