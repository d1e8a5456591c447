"""Two real servers sharing one Redis (``--redis-url``): a tenant's stream cap and token rate
hold across both; each server exports the Redis metrics. Without the shared limits the
second server would admit what the first already used."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.admission.cluster_limits import ClusterLimitsConfig
from service.admission.tenants import new_api_key
from service.serve.kvfence_server import ServerOptions
from tests.cluster.conftest import RedisProcess
from tests.serverutil import ServerHandle, TenantSpec, running_server


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from service.model import load_model
    from tests.fixtures.tiny_models import write_tiny_llama

    return load_model(write_tiny_llama(tmp_path_factory.mktemp("tiny")), dtype="float32", progress=False)


@pytest.fixture
def pair(
    tiny_model: Any, redis_server: RedisProcess, tmp_path: Path
) -> Iterator[tuple[ServerHandle, ServerHandle]]:
    tenants = {
        "capped": TenantSpec(max_concurrent_streams=1, api_key=new_api_key()),
        "metered": TenantSpec(tokens_per_minute=60, api_key=new_api_key()),
    }
    options = ServerOptions(cluster_limits=ClusterLimitsConfig(redis_url=redis_server.url))
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with ExitStack() as stack:
        servers = [
            stack.enter_context(
                running_server(tiny_model, tenants, options=options, tenants_dir=tmp_path / n)
            )
            for n in ("a", "b")
        ]
        yield servers[0], servers[1]


def _request(max_tokens: int) -> inference_pb2.GenerateRequest:
    req = inference_pb2.GenerateRequest(
        stopping=inference_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    req.token_ids.ids.extend([5, 6, 7, 8])
    return req


def _generate(srv: ServerHandle, tenant: str, max_tokens: int) -> Any:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    return stub.Generate(_request(max_tokens), metadata=srv.auth(tenant), timeout=30)


def test_a_stream_open_on_one_server_counts_on_the_other(
    pair: tuple[ServerHandle, ServerHandle], redis_server: RedisProcess
) -> None:
    a, b = pair
    client = redis.Redis.from_url(redis_server.url)
    with a.paused_engine():
        held = _generate(a, "capped", 4)
        deadline = time.monotonic() + 10
        while client.zcard("kvfence:{capped}:streams") == 0:
            assert time.monotonic() < deadline, "server a never took a lease in Redis"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as refused:
            list(_generate(b, "capped", 4))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "across the cluster" in (refused.value.details() or "")
    assert [r.WhichOneof("event") for r in held][-1] == "finished"
    deadline = time.monotonic() + 5
    while client.zcard("kvfence:{capped}:streams") > 0:  # the release is asynchronous
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [r.WhichOneof("event") for r in _generate(b, "capped", 4)][-1] == "finished"


def test_the_token_rate_is_shared(pair: tuple[ServerHandle, ServerHandle]) -> None:
    a, b = pair
    list(_generate(a, "metered", 50))  # 4 + 50 of the 60 per minute
    with pytest.raises(grpc.RpcError) as refused:
        list(_generate(b, "metered", 10))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "per minute across the cluster" in (refused.value.details() or "")
    scraped = b.server.metrics.registry.get_sample_value("kvfence_limits_redis_up")
    assert scraped == 1
