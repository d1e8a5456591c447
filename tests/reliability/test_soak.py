"""Soak: many concurrent streams per tenant, four tenants, for a fixed time. Every stream
checks its own client request id echo, a server request id never seen before, its token
count against usage and max_tokens, and its tokens against a reference greedy run of the same
prompt made alone (near-tie rule in ``tests/verify/greedy.py``): so a lost, duplicated or
misrouted chunk shows up. Reports TTFT and inter-token latency percentiles, the pool at the
end, and the process's RSS growth.

Full: 64 streams x 4 tenants for 60 s. Short: 12 x 4 for 10 s (two shared CPU cores cannot
drive 256 streams of Python client and server in one process within the `make test` budget).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from protos.kvfence.v1 import inference_pb2_grpc
from service.serve.app import EngineSizing
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.calls import bearer, check_stream, collect, collect_async, gen_request
from tests.verify.greedy import compare
from tests.verify.pool import wait_for_baseline
from tests.verify.recorder import Recorder
from tests.verify.scale import size
from tests.verify.stats import percentile

TENANTS = ("t0", "t1", "t2", "t3")
STREAMS_PER_TENANT = size(12, 64)
SECONDS = size(10.0, 60.0)
PROMPTS_PER_TENANT = size(4, 8)
MAX_TOKENS = 24
RSS_LIMIT_MB = 100.0
SIZING = EngineSizing(
    kv_memory="16MiB",
    max_model_len=512,
    max_num_seqs=len(TENANTS) * STREAMS_PER_TENANT,
    warmup=False,
    dtype="float32",
)


@pytest.fixture(scope="module")
def srv(tiny: Any) -> Iterator[ServerHandle]:
    specs = {t: TenantSpec(max_concurrent_streams=STREAMS_PER_TENANT) for t in TENANTS}
    with running_server(tiny, specs, sizing=SIZING) as handle:
        yield handle


@dataclass(frozen=True, slots=True)
class Reference:
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    gaps: tuple[float | None, ...]


@dataclass(slots=True)
class Tally:
    requests: int = 0
    lost: int = 0  # tokens missing from a stream, or streams that failed
    duplicated: int = 0  # tokens beyond what usage and max_tokens allow
    misrouted: int = 0  # streams carrying another request's id or another prompt's tokens
    near_ties: int = 0
    tokens: int = 0
    problems: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    request_ids: set[str] = field(default_factory=set)


def _references(srv: ServerHandle) -> dict[str, list[Reference]]:
    rng = random.Random(11)
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    refs: dict[str, list[Reference]] = {}
    for tenant in TENANTS:
        refs[tenant] = []
        for _ in range(PROMPTS_PER_TENANT):
            prompt = tuple(rng.randrange(3, 384) for _ in range(rng.randrange(10, 60)))
            result = collect(
                stub.Generate(
                    gen_request(prompt, max_tokens=MAX_TOKENS, logprobs=2),
                    metadata=srv.auth(tenant),
                    timeout=60,
                )
            )
            assert not check_stream(result, prompt_tokens=len(prompt), max_tokens=MAX_TOKENS)
            refs[tenant].append(Reference(prompt, tuple(result.tokens), tuple(result.gaps)))
    return refs


async def _worker(
    tenant: str, worker: int, stub: Any, key: str, refs: list[Reference], until: float, tally: Tally
) -> None:
    rng = random.Random(f"{tenant}/{worker}")
    n = 0
    while time.monotonic() < until:
        ref = rng.choice(refs)
        max_tokens = rng.randrange(4, MAX_TOKENS + 1)
        crid = f"{tenant}/{worker}/{n}"
        n += 1
        call = stub.Generate(
            gen_request(ref.prompt, max_tokens=max_tokens, client_request_id=crid),
            metadata=bearer(key),
            timeout=120,
        )
        result = await collect_async(call)
        tally.requests += 1
        tally.tokens += len(result.tokens)
        if not result.ok:
            tally.lost += max_tokens
            tally.problems.append(f"{crid}: {result.code.name}")
            continue
        started = result.started
        if started is None or started.client_request_id != crid:
            tally.misrouted += 1
            tally.problems.append(f"{crid}: started echoes another request")
        elif started.request_id in tally.request_ids:
            tally.duplicated += 1
            tally.problems.append(f"{crid}: server request id seen before")
        else:
            tally.request_ids.add(started.request_id)
        usage = result.finished.usage.completion_tokens if result.finished else 0
        tally.lost += max(0, max_tokens - len(result.tokens))
        tally.duplicated += max(0, len(result.tokens) - max_tokens)
        shape = check_stream(result, prompt_tokens=len(ref.prompt), max_tokens=max_tokens)
        if shape or usage != len(result.tokens):
            tally.problems.append(f"{crid}: {shape}")
        cmp = compare(ref.tokens[:max_tokens], ref.gaps, result.tokens)
        if cmp.near_tie_at is not None:
            tally.near_ties += 1
        elif cmp.mismatched and len(result.tokens) == max_tokens:
            tally.misrouted += 1
            tally.problems.append(f"{crid}: tokens differ from the reference")
        if result.ttft is not None:
            tally.ttft.append(result.ttft)
        tally.itl.extend(result.itls())


async def _soak(
    srv: ServerHandle, refs: dict[str, list[Reference]], seconds: float, streams: int
) -> Tally:
    tally = Tally()
    until = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(srv.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await asyncio.gather(
            *(
                _worker(t, w, stub, srv.keys[t], refs[t], until, tally)
                for t in TENANTS
                for w in range(streams)
            )
        )
    return tally


def _rss_mb() -> float:
    """Current resident set size after a collection (Linux /proc; elsewhere the peak)."""
    gc.collect()
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak_kb / 1024.0


@pytest.mark.slow
@pytest.mark.timeout(size(180, 900))
def test_soak_streams_stay_whole_and_the_pool_returns_to_baseline(
    srv: ServerHandle, record: Recorder
) -> None:
    refs = _references(srv)
    asyncio.run(_soak(srv, refs, min(2.0, SECONDS / 5), STREAMS_PER_TENANT))  # warm-up
    rss_before = _rss_mb()
    t0 = time.monotonic()
    tally = asyncio.run(_soak(srv, refs, SECONDS, STREAMS_PER_TENANT))
    elapsed = time.monotonic() - t0
    state = wait_for_baseline(srv, timeout=30)
    rss_growth = _rss_mb() - rss_before

    record.info("concurrent streams", len(TENANTS) * STREAMS_PER_TENANT)
    record.info("seconds", round(elapsed, 1))
    record.info("requests completed", tally.requests)
    record.info("tokens per second", round(tally.tokens / elapsed, 1))
    assert record("lost chunks", tally.lost, "== 0", tally.lost == 0), tally.problems[:10]
    assert record("duplicated chunks", tally.duplicated, "== 0", tally.duplicated == 0), (
        tally.problems[:10]
    )
    assert record("misrouted chunks/streams", tally.misrouted, "== 0", tally.misrouted == 0), (
        tally.problems[:10]
    )
    assert record("malformed streams", len(tally.problems), "== 0", not tally.problems), (
        tally.problems[:10]
    )
    record.info("near-tie divergences (excused)", tally.near_ties)
    record.info("TTFT p50 (s)", percentile(tally.ttft, 50))
    record.info("TTFT p99 (s)", percentile(tally.ttft, 99))
    record.info("ITL p50 (s)", percentile(tally.itl, 50))
    record.info("ITL p99 (s)", percentile(tally.itl, 99))
    assert record("pages at baseline at the end", state.at_baseline, "True", state.at_baseline), (
        state.describe()
    )
    assert record(
        "RSS growth (MB)", round(rss_growth, 1), f"< {RSS_LIMIT_MB:g}", rss_growth < RSS_LIMIT_MB
    )
    assert tally.requests >= len(TENANTS) * STREAMS_PER_TENANT
