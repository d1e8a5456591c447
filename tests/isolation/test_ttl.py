"""Prefix-cache TTL end to end over gRPC: a tenant's repeated prefix is reported as cached
while its TTL runs, stops being reported once it ran out, and ``Cache.Purge`` drops it at
once. A tenant with TTL 0 never caches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2_grpc
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.calls import collect, gen_request
from tests.verify.recorder import Recorder

TTL = 1.0
TENANTS = {
    "brief": TenantSpec(prefix_cache_ttl_seconds=TTL),
    "acme": TenantSpec(),
    "nocache": TenantSpec(prefix_cache_ttl_seconds=0.0),
}


@pytest.fixture(scope="module")
def srv(tiny: Any) -> Iterator[ServerHandle]:
    with running_server(tiny, TENANTS) as handle:
        yield handle


def _cached(srv: ServerHandle, tenant: str, prompt: list[int]) -> int:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    result = collect(
        stub.Generate(gen_request(prompt, max_tokens=2), metadata=srv.auth(tenant), timeout=30)
    )
    assert result.ok and result.started is not None, result.code
    return int(result.started.cached_prompt_tokens)


def test_ttl_expires_a_prefix_and_purge_drops_it_at_once(
    srv: ServerHandle, record: Recorder
) -> None:
    prompt = list(range(20, 68))  # 48 tokens: 2 full pages can be cached (one token is kept)
    assert _cached(srv, "brief", prompt) == 0
    time.sleep(TTL * 0.5)
    within = _cached(srv, "brief", prompt)  # a hit also refreshes the TTL
    time.sleep(TTL + 0.25)
    after = _cached(srv, "brief", prompt)

    other = list(range(120, 168))
    _cached(srv, "acme", other)
    before_purge = _cached(srv, "acme", other)
    cached_pages = srv.usage("acme").pages_cached
    cache = cache_pb2_grpc.CacheStub(srv.channel())
    purged = cache.Purge(cache_pb2.PurgeRequest(), metadata=srv.auth("acme"), timeout=10)
    after_purge = _cached(srv, "acme", other)

    _cached(srv, "nocache", other)
    no_cache = _cached(srv, "nocache", other)

    assert record(
        f"cached tokens on a repeat within the TTL ({TTL:g} s)", within, "== 32", within == 32
    )
    assert record("cached tokens on a repeat after the TTL", after, "== 0", after == 0)
    assert record("cached tokens before Purge (control)", before_purge, "== 32", before_purge == 32)
    assert record(
        "pages purged",
        purged.pages_purged,
        f"== {cached_pages}",
        purged.pages_purged == cached_pages and cached_pages >= 2,
    )
    assert record("cached tokens right after Purge", after_purge, "== 0", after_purge == 0)
    assert record("cached tokens with TTL 0", no_cache, "== 0", no_cache == 0)
