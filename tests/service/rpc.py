"""Small helpers for calling a test server and reading google.rpc.Status details."""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.serverutil import ServerHandle


def request(
    text: str | None = "Hello world",
    *,
    ids: list[int] | None = None,
    max_tokens: int = 4,
    temperature: float = 0.0,
    **fields: Any,
) -> inference_pb2.GenerateRequest:
    req = inference_pb2.GenerateRequest(
        sampling=inference_pb2.SamplingParams(temperature=temperature),
        stopping=inference_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )
    if ids is not None:
        req.token_ids.ids.extend(ids)
    elif text is not None:
        req.text = text
    return req


def stubs(srv: ServerHandle) -> tuple[inference_pb2_grpc.InferenceStub, cache_pb2_grpc.CacheStub]:
    channel = srv.channel()
    return inference_pb2_grpc.InferenceStub(channel), cache_pb2_grpc.CacheStub(channel)


def generate(
    srv: ServerHandle, tenant: str, req: inference_pb2.GenerateRequest, **kw: Any
) -> list[inference_pb2.GenerateResponse]:
    inference, _ = stubs(srv)
    return list(inference.Generate(req, metadata=srv.auth(tenant), **kw))


def usage(srv: ServerHandle, tenant: str) -> cache_pb2.GetUsageResponse:
    _, cache = stubs(srv)
    resp: cache_pb2.GetUsageResponse = cache.GetUsage(
        cache_pb2.GetUsageRequest(), metadata=srv.auth(tenant)
    )
    return resp


def details(err: grpc.RpcError) -> dict[str, Any]:
    """{type name: unpacked detail} of the status carried by ``err``."""
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    assert status.code == err.code().value[0]
    out: dict[str, Any] = {}
    for kind in (
        error_details_pb2.BadRequest,
        error_details_pb2.QuotaFailure,
        error_details_pb2.RetryInfo,
        error_details_pb2.ErrorInfo,
    ):
        for item in status.details:
            if item.Is(kind.DESCRIPTOR):
                msg = kind()
                item.Unpack(msg)
                out[kind.__name__] = msg
    return out


def violations(err: grpc.RpcError) -> list[str]:
    bad = details(err)["BadRequest"]
    return [v.field for v in bad.field_violations]
