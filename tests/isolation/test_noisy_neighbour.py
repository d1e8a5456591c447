"""Noisy neighbours: can tenant A, within its own limits, starve, stall or observe tenant B?

Attacks by a noisy tenant A, each against a victim tenant B sending short greedy requests one
at a time, on a real gRPC server with default tenant settings (``make verify``: the default model
and ``kvfence serve``'s default sizing; ``make test``: the tiny model, short runs). B's TTFT and
inter-token gap medians under each attack are held to its own baseline from the same run:
median TTFT <= 2x baseline + 0.2 s, median gap <= 2x baseline + 30 ms (judged in `make verify`;
the short run records them), no B request fails.
The attacker's throughput is reported (it keeps its own share).

The memory attacks (KV-pool hog, eviction spy) run on a second server whose pool is 64 pages,
where three tenants' default shares are about 21 pages each. The spy fills its share with
cached prefixes and polls its own ``GetUsage.pages_cached`` every 50 ms while B works past
its own share; the spy must see no change.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache.pool import page_bytes
from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc
from service.admission.request_fields import TEXT_BYTES_PER_TOKEN
from service.serve.app import EngineSizing
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.calls import gen_request
from tests.verify.neighbours import AttackStats, Latency, Victim, attack, generate_loop
from tests.verify.recorder import Recorder
from tests.verify.scale import is_full, size

TENANTS = {"victim": TenantSpec(), "attacker": TenantSpec(), "spy": TenantSpec()}
VICTIM_N = size(4, 15)
VICTIM_PROMPT = 24
VICTIM_MAX_TOKENS = size(8, 16)
SETTLE_S = size(0.5, 2.0)
POOL_PAGES = 64
SHORT_SIZING = EngineSizing(kv_memory="8MiB", max_model_len=1024, warmup=False, dtype="float32")


@pytest.fixture(scope="module")
def model_path(request: pytest.FixtureRequest) -> Path:
    name = "default_model_path" if is_full() else "tiny_dir"
    return Path(request.getfixturevalue(name))


@pytest.fixture(scope="module")
def loaded(model_path: Path) -> Any:
    from service.model import load_model

    return load_model(model_path, dtype="auto" if is_full() else "float32", progress=False)


def _sizing() -> EngineSizing:
    return EngineSizing() if is_full() else SHORT_SIZING


@pytest.fixture(scope="module")
def srv(loaded: Any) -> Iterator[ServerHandle]:
    with running_server(loaded, TENANTS, sizing=_sizing()) as handle:
        yield handle


@pytest.fixture(scope="module")
def small(loaded: Any, srv: ServerHandle) -> Iterator[ServerHandle]:
    """The same model and settings with a 64-page pool."""
    cfg = loaded.model.config
    one = page_bytes(
        cfg.num_layers,
        srv.stack.engine.page_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        loaded.model.kv_dtype,
    )
    sizing = replace(_sizing(), kv_memory=str(one * POOL_PAGES))
    with running_server(loaded, TENANTS, sizing=sizing) as h:
        assert h.stack.engine.num_pages == POOL_PAGES
        yield h


def _vocab(handle: ServerHandle) -> tuple[int, int]:
    vocab = handle.server.prep.model.vocab_size
    return (min(100, vocab // 4), vocab - 1)


def _victim(handle: ServerHandle) -> Victim:
    return Victim(
        handle.target, handle.auth("victim"), _vocab(handle), VICTIM_PROMPT, VICTIM_MAX_TOKENS
    )


@pytest.fixture(scope="module")
def baseline(srv: ServerHandle) -> Latency:
    _victim(srv).run(2)  # first-call effects
    return _victim(srv).run(VICTIM_N)


@pytest.fixture(scope="module")
def small_baseline(small: ServerHandle) -> Latency:
    _victim(small).run(2)
    return _victim(small).run(VICTIM_N)


def _judge(record: Recorder, base: Latency, under: Latency, stats: AttackStats | None) -> None:
    b, u = base.summary(), under.summary()
    ttft_bound = 2 * b["ttft_p50"] + 0.2
    itl_bound = 2 * b["itl_p50"] + 0.030
    record.info("victim TTFT p50 / p99 baseline (s)", f"{b['ttft_p50']:.3f} / {b['ttft_p99']:.3f}")
    record.info("victim gap p50 / p99 baseline (s)", f"{b['itl_p50']:.3f} / {b['itl_p99']:.3f}")
    record.info("victim TTFT p99 under attack (s)", round(u["ttft_p99"], 3))
    record.info("victim gap p99 under attack (s)", round(u["itl_p99"], 3))
    if stats is not None:
        record.info("attacker calls (status counts)", dict(stats.codes))
        record.info("attacker tokens/s (prompt + output)", round(stats.tokens_per_s, 1))
        record.info("attacker output tokens/s", round(stats.output_tps, 1))
    ok = [record("victim requests failed", len(under.failed), "== 0", not under.failed)]
    if is_full():
        ok += [
            record(
                "victim TTFT p50 under attack (s)",
                round(u["ttft_p50"], 3),
                f"<= {ttft_bound:.3f}",
                u["ttft_p50"] <= ttft_bound,
            ),
            record(
                "victim gap p50 under attack (s)",
                round(u["itl_p50"], 3),
                f"<= {itl_bound:.3f}",
                u["itl_p50"] <= itl_bound,
            ),
        ]
    else:
        # NOTE: the short run (make test) uses the tiny model, whose millisecond steps put the
        # fixed 30 ms slack within reach of scheduling noise on 2 shared cores; the latency
        # bounds are judged by `make verify` on the default model, and only recorded here.
        record.info("victim TTFT p50 under attack (s), bound", f"{u['ttft_p50']:.3f} / {ttft_bound:.3f}")
        record.info("victim gap p50 under attack (s), bound", f"{u['itl_p50']:.3f} / {itl_bound:.3f}")
    assert all(ok), (b, u, under.failed)


def _limit(handle: ServerHandle) -> int:
    return int(handle.server.prep.model.max_model_len) - 1


def test_tokenizer_flood(srv: ServerHandle, baseline: Latency, record: Recorder) -> None:
    """Texts at the byte cap that tokenize past the token limit: the most tokenizer work a
    request can cost before it is refused."""
    auth = srv.auth("attacker")
    rng = random.Random(3)
    text = "".join(
        rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(_limit(srv) * TEXT_BYTES_PER_TOKEN)
    )

    def work(channel: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        stub = inference_pb2_grpc.InferenceStub(channel)
        while not stop.is_set():
            try:
                if i % 2:
                    stub.Tokenize(
                        inference_pb2.TokenizeRequest(text=text), metadata=auth, timeout=60
                    )
                else:
                    list(
                        stub.Generate(
                            gen_request(text=text, max_tokens=1), metadata=auth, timeout=60
                        )
                    )
                stats.count(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                stats.count(err.code())

    with attack(srv.target, work, 3, SETTLE_S) as stats:
        under = _victim(srv).run(VICTIM_N)
    _judge(record, baseline, under, stats)


def test_long_prefill_flood(srv: ServerHandle, baseline: Latency, record: Recorder) -> None:
    n = min(size(600, 3000), _limit(srv) - 8)
    lo, hi = _vocab(srv)
    worker = generate_loop(
        srv.auth("attacker"),
        lambda rng: gen_request([rng.randrange(lo, hi) for _ in range(n)], max_tokens=4),
    )
    with attack(srv.target, worker, 3, SETTLE_S) as stats:
        under = _victim(srv).run(VICTIM_N)
    _judge(record, baseline, under, stats)


def test_penalty_rows(srv: ServerHandle, baseline: Latency, record: Recorder) -> None:
    n = size(200, 1000)
    lo, hi = _vocab(srv)

    def make(rng: random.Random) -> inference_pb2.GenerateRequest:
        req = gen_request(
            [rng.randrange(lo, hi) for _ in range(n)], max_tokens=size(16, 64), temperature=0.7
        )
        req.sampling.repetition_penalty = 1.3
        req.sampling.presence_penalty = 0.5
        req.sampling.frequency_penalty = 0.5
        return req

    with attack(
        srv.target, generate_loop(srv.auth("attacker"), make), size(4, 8), SETTLE_S
    ) as stats:
        under = _victim(srv).run(VICTIM_N)
    _judge(record, baseline, under, stats)


def test_unauthenticated_flood(srv: ServerHandle, baseline: Latency, record: Recorder) -> None:
    """Large bodies with no or a wrong key, and health Watch streams held open."""
    body = "x" * (1 << 20)
    watches: list[Any] = []
    refused = [0]

    def work(channel: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        if i == 0:  # hold as many health Watch streams open as the server allows
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(200):
                stream = health.Watch(health_pb2.HealthCheckRequest(), timeout=600)
                try:
                    next(stream)
                    watches.append(stream)
                except grpc.RpcError:
                    refused[0] += 1
            stop.wait()
            for stream in watches:
                stream.cancel()
            return
        stub = inference_pb2_grpc.InferenceStub(channel)
        auth = () if i % 2 else (("authorization", "Bearer kvf_guessed"),)
        while not stop.is_set():
            try:
                list(stub.Generate(gen_request(text=body), metadata=auth, timeout=30))
                stats.count(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                stats.count(err.code())

    with attack(srv.target, work, 5, SETTLE_S) as stats:
        under = _victim(srv).run(VICTIM_N)
    record.info("health Watch streams held open", len(watches))
    ok = record("health Watch streams refused past the cap", refused[0], "> 0", refused[0] > 0)
    # NOTE: not only OK: the 1 MiB body is over the prompt limit, so a call that got past
    # authentication is answered INVALID_ARGUMENT, not OK.
    past_auth = sum(n for code, n in stats.codes.items() if code != "UNAUTHENTICATED")
    ok &= record(
        "unauthenticated calls answered other than UNAUTHENTICATED", past_auth, "== 0",
        past_auth == 0,
    )
    _judge(record, baseline, under, stats)
    assert ok


def test_kv_pool_hog(small: ServerHandle, small_baseline: Latency, record: Recorder) -> None:
    """A KV hog (two streams of 480-token prompts and 500 outputs in a 64-page pool)
    does not fit the attacker's share and is refused; the hog that fills its share runs."""
    lo, hi = _vocab(small)
    stub = inference_pb2_grpc.InferenceStub(small.channel())
    usage = cache_pb2_grpc.CacheStub(small.channel()).GetUsage(
        cache_pb2.GetUsageRequest(), metadata=small.auth("attacker"), timeout=10
    )
    share = int(usage.quotas.max_kv_pages)
    record.info("attacker's KV share (pages of 64)", share)
    try:
        list(
            stub.Generate(
                gen_request([lo] * 480, max_tokens=500), metadata=small.auth("attacker"), timeout=60
            )
        )
        code = grpc.StatusCode.OK.name
    except grpc.RpcError as err:  # NOTE: caught, not pytest.raises: an OK answer is a row too
        code = err.code().name
    assert record("hog request over its KV share", code, "RESOURCE_EXHAUSTED", code == "RESOURCE_EXHAUSTED")
    # Two streams that together fill the share: prompt and output a quarter of it each.
    quarter = share * small.stack.engine.page_size // 4 - 1
    worker = generate_loop(
        small.auth("attacker"),
        lambda rng: gen_request(
            [rng.randrange(lo, hi) for _ in range(quarter)], max_tokens=quarter
        ),
    )
    with attack(small.target, worker, 2, SETTLE_S) as stats:
        under = _victim(small).run(VICTIM_N)
    _judge(record, small_baseline, under, stats)


def _pages_cached(handle: ServerHandle, tenant: str) -> int:
    stub = cache_pb2_grpc.CacheStub(handle.channel())
    usage = stub.GetUsage(cache_pb2.GetUsageRequest(), metadata=handle.auth(tenant), timeout=10)
    return int(usage.pages_cached)


def test_eviction_spy(small: ServerHandle, record: Recorder) -> None:
    lo, hi = _vocab(small)
    rng = random.Random(9)
    stub = inference_pb2_grpc.InferenceStub(small.channel())
    page = small.stack.engine.page_size

    def cache_prompt(tenant: str, pages: int) -> None:
        ids = [rng.randrange(lo, hi) for _ in range(pages * page + 1)]
        for _ in stub.Generate(
            gen_request(ids, max_tokens=1), metadata=small.auth(tenant), timeout=120
        ):
            pass

    # The spy fills what it can hold with cached prefixes, 3 pages at a time.
    previous = -1
    for _ in range(POOL_PAGES // 3 + 2):
        cache_prompt("spy", 3)
        held = _pages_cached(small, "spy")
        if held == previous:
            break
        previous = held
    start = _pages_cached(small, "spy")
    seen: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.append(_pages_cached(small, "spy"))
            stop.wait(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    victim_pages = 0
    for _ in range(size(8, 24)):  # the victim caches well past its own share
        cache_prompt("victim", 3)
        victim_pages += 4
    time.sleep(0.2)
    stop.set()
    poller.join(10)
    change = max(abs(s - start) for s in seen) if seen else 0
    record.info("spy cached pages at start", start)
    record.info("victim pages requested while the spy watched", victim_pages)
    record.info("spy polls", len(seen))
    assert record("spy's largest observed change in its cached pages", change, "== 0", change == 0)
