"""Drain (UNAVAILABLE), health, reflection permission and hot tenant reload, in process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from service.serve.kvfence_server import ServerOptions
from tests.serverutil import TenantSpec, running_server, write_tenants_file
from tests.service.rpc import details, generate, request, stubs, usage


def test_drain_refuses_new_rpcs_and_aborts_streams_past_the_grace(
    tiny_model: Any, tmp_path: Path
) -> None:
    tenants = {"acme": TenantSpec()}
    with running_server(tiny_model, tenants, tenants_dir=tmp_path) as srv:
        inference, _ = stubs(srv)
        stream = inference.Generate(
            request("Hello world", max_tokens=490), metadata=srv.auth("acme")
        )
        assert next(stream).WhichOneof("event") == "started"
        assert next(stream).WhichOneof("event") == "chunk"
        with srv.paused_engine():  # the stream cannot finish inside the grace period
            started = time.monotonic()
            drained = asyncio.run_coroutine_threadsafe(srv.server.drain(grace_s=1.0), srv.loop)
            time.sleep(0.05)
            health = health_pb2_grpc.HealthStub(srv.channel())
            assert health.Check(health_pb2.HealthCheckRequest()).status == (
                health_pb2.HealthCheckResponse.NOT_SERVING
            )
            with pytest.raises(grpc.RpcError) as refused:
                generate(srv, "acme", request("hi"))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "RetryInfo" in details(refused.value)
            assert time.monotonic() - started < 1.0
            time.sleep(1.2 - (time.monotonic() - started))
        with pytest.raises(grpc.RpcError) as cut:
            for _ in stream:
                pass
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        drained.result(10)
        assert srv.usage("acme").pages_in_use == 0
        assert srv.engine.num_running() == 0


def test_drain_lets_short_streams_finish_within_the_grace(tiny_model: Any, tmp_path: Path) -> None:
    with running_server(tiny_model, {"acme": TenantSpec()}, tenants_dir=tmp_path) as srv:
        inference, _ = stubs(srv)
        stream = inference.Generate(
            request("Hello world", max_tokens=40), metadata=srv.auth("acme")
        )
        assert next(stream).WhichOneof("event") == "started"
        with srv.paused_engine():  # the stream is provably still running when the drain starts
            drained = asyncio.run_coroutine_threadsafe(srv.server.drain(grace_s=10.0), srv.loop)
            time.sleep(0.2)
            assert not drained.done()
        rest = list(stream)
        assert rest[-1].finished.usage.completion_tokens == 40
        drained.result(10)


def _list_services(srv: Any, tenant: str) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(srv.channel())
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=srv.auth(tenant)
    )
    return [s.name for r in responses for s in r.list_services_response.service]


def test_reflection_needs_a_credential_with_permission(tiny_model: Any, tmp_path: Path) -> None:
    tenants = {"acme": TenantSpec(), "ops": TenantSpec(allow_reflection=True)}
    with running_server(
        tiny_model, tenants, options=ServerOptions(reflection=True), tenants_dir=tmp_path
    ) as srv:
        assert "kvfence.v1.Inference" in _list_services(srv, "ops")
        with pytest.raises(grpc.RpcError) as denied:
            _list_services(srv, "acme")
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert details(denied.value)["ErrorInfo"].reason == "REFLECTION"
        stub = reflection_pb2_grpc.ServerReflectionStub(srv.channel())
        with pytest.raises(grpc.RpcError) as anonymous:
            list(
                stub.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
            )
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_reload_revokes_a_key_without_dropping_streams(tiny_model: Any, tmp_path: Path) -> None:
    tenants = {"acme": TenantSpec(), "globex": TenantSpec()}
    with running_server(tiny_model, tenants, tenants_dir=tmp_path) as srv:
        inference, _ = stubs(srv)
        stream = inference.Generate(
            request("Hello world", max_tokens=490), metadata=srv.auth("globex")
        )
        assert next(stream).WhichOneof("event") == "started"
        with srv.paused_engine():
            keys = write_tenants_file(
                srv.tenants_path,
                {"acme": TenantSpec(api_key=srv.keys["acme"], max_prompt_tokens=4)},
            )
            reloaded = asyncio.run_coroutine_threadsafe(
                asyncio.to_thread(srv.server.reload_tenants), srv.loop
            )
        assert reloaded.result(10)
        assert srv.engine.num_running() == 1  # reloaded while the stream runs
        rest = list(stream)  # the in-flight stream of the revoked tenant completes
        assert rest[-1].finished.usage.completion_tokens == 490
        with pytest.raises(grpc.RpcError) as revoked:
            usage(srv, "globex")
        assert revoked.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert keys["acme"] == srv.keys["acme"]
        assert usage(srv, "acme").quotas.max_prompt_tokens == 4  # new quotas apply
        # A broken file is refused and the previous tenants stay.
        srv.tenants_path.write_text("[tenants.acme]\nweight = -1\n")
        assert not srv.server.reload_tenants()
        assert usage(srv, "acme").quotas.max_prompt_tokens == 4
