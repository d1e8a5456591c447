"""The tenant comes from the credential only: headers or request fields that name another
tenant change nothing about who is served, billed, or purged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2_grpc
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.calls import bearer, collect, gen_request
from tests.verify.recorder import Recorder

# Header names a careless server (or proxy integration) might honour.
HEADERS = ("x-tenant", "tenant", "x-tenant-id", "x-kvfence-tenant", "kvfence-tenant")


@pytest.fixture(scope="module")
def srv(tiny: Any) -> Iterator[ServerHandle]:
    with running_server(tiny, {"acme": TenantSpec(), "globex": TenantSpec()}) as handle:
        yield handle


def _usage(srv: ServerHandle, metadata: Any) -> cache_pb2.GetUsageResponse:
    stub = cache_pb2_grpc.CacheStub(srv.channel())
    usage: cache_pb2.GetUsageResponse = stub.GetUsage(cache_pb2.GetUsageRequest(),
                                                      metadata=metadata, timeout=10)
    return usage


def test_headers_and_fields_naming_a_tenant_are_ignored(srv: ServerHandle, record: Recorder) -> None:
    inference = inference_pb2_grpc.InferenceStub(srv.channel())
    acme, globex = bearer(srv.keys["acme"]), bearer(srv.keys["globex"])
    globex_prompt = list(range(200, 248))  # globex caches its 3 full pages
    assert collect(inference.Generate(gen_request(globex_prompt, max_tokens=1), metadata=globex,
                                      timeout=30)).ok
    globex_before = _usage(srv, globex)
    assert globex_before.pages_cached == 3

    misattributed: list[str] = []
    spoofs = [(f"header {h}", (*acme, (h, "globex")), "") for h in HEADERS]
    spoofs.append(("client_request_id", acme, "globex"))
    for i, (name, metadata, client_id) in enumerate(spoofs):
        prompt = list(range(10 + i * 40, 10 + i * 40 + 20))
        misses = _usage(srv, acme).prefix_miss_tokens
        result = collect(inference.Generate(gen_request(prompt, max_tokens=1,
                                                        client_request_id=client_id),
                                            metadata=metadata, timeout=30))
        if not result.ok or _usage(srv, acme).prefix_miss_tokens != misses + len(prompt):
            misattributed.append(f"Generate with {name}")
        if _usage(srv, metadata) != _usage(srv, acme):
            misattributed.append(f"GetUsage with {name}")
    cache = cache_pb2_grpc.CacheStub(srv.channel())
    for h in HEADERS:
        cache.Purge(cache_pb2.PurgeRequest(), metadata=(*acme, (h, "globex")), timeout=10)
    globex_after = _usage(srv, globex)
    if globex_after != globex_before:
        misattributed.append("Purge with a header reached globex")
    n = 2 * len(spoofs) + 1
    assert record("calls served as the credential's tenant despite a spoofed tenant name",
                  n - len(misattributed), f"== {n}", not misattributed), misattributed
