"""`kvfence serve` as a real process: serving line, SIGHUP reload, SIGTERM drain, exit 0."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2_grpc
from tests.serverutil import ServerProcess, TenantSpec, start_server_process, write_tenants_file
from tests.service.rpc import request


@pytest.fixture(scope="module")
def proc(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, dict[str, str], Path]]:
    tenants = tmp_path_factory.mktemp("proc") / "tenants.toml"
    keys = write_tenants_file(tenants, {"acme": TenantSpec(), "globex": TenantSpec()})
    p = start_server_process(
        tiny_llama_dir, tenants, ["--metrics-port", "0", "--grace-seconds", "20"]
    )
    try:
        yield p, keys, tenants
    finally:
        p.stop()


def _auth(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def _events(lines: list[str]) -> list[dict[str, object]]:
    out = []
    for line in lines:
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_sighup_reload_then_sigterm_drain(proc: tuple[ServerProcess, dict[str, str], Path]) -> None:
    p, keys, tenants = proc
    assert p.metrics_port is not None
    channel = grpc.insecure_channel(p.target)
    inference = inference_pb2_grpc.InferenceStub(channel)
    cache = cache_pb2_grpc.CacheStub(channel)
    assert (
        cache.GetUsage(cache_pb2.GetUsageRequest(), metadata=_auth(keys["globex"])).page_size == 16
    )

    # SIGHUP: globex's key is revoked from the next call on.
    write_tenants_file(tenants, {"acme": TenantSpec(api_key=keys["acme"])})
    p.popen.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        try:
            cache.GetUsage(cache_pb2.GetUsageRequest(), metadata=_auth(keys["globex"]))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            break
        assert time.monotonic() < deadline, "reload did not revoke the key"
        time.sleep(0.05)
    assert cache.GetUsage(cache_pb2.GetUsageRequest(), metadata=_auth(keys["acme"])).page_size == 16

    # SIGTERM with a stream in flight: it completes inside the grace period, exit status 0.
    stream = inference.Generate(
        request("Hello world", max_tokens=490), metadata=_auth(keys["acme"])
    )
    assert next(stream).WhichOneof("event") == "started"
    p.popen.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert rest[-1].finished.usage.completion_tokens == 490
    assert p.wait(30) == 0
    events = _events(p.output)
    names = [e["event"] for e in events]
    assert "tenants.reloaded" in names
    (draining,) = [e for e in events if e["event"] == "server.draining"]
    assert draining["in_flight"] == 1
    assert names.index("server.draining") < names.index("server.stopped")
    assert not any("Traceback" in line for line in p.output)
