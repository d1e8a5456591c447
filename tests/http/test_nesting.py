"""Deeply nested JSON: a body is refused with 400 naming the nesting limit (never a 500 from
Python's recursive JSON reader), and a response-format schema past the grammar's depth limit
is refused by that limit, on the HTTP front and over gRPC."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from protos.kvfence.v1 import inference_pb2_grpc
from tests.http.conftest import base_url
from tests.serverutil import ServerHandle
from tests.service.rpc import request


def _post(srv: ServerHandle, body: bytes) -> httpx.Response:
    return httpx.post(
        f"{base_url(srv)}/completions", content=body, timeout=60,
        headers={"Authorization": f"Bearer {srv.keys['acme']}",
                 "Content-Type": "application/json"},
    )


def _schema(levels: int) -> dict[str, object]:
    nested: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        nested = {"type": "array", "items": nested}
    return nested


@pytest.mark.parametrize("depth", [100_000, 990, 250])
def test_a_deeply_nested_body_is_a_400_naming_the_limit(srv: ServerHandle, depth: int) -> None:
    body = b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    r = _post(srv, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "body: nests deeper than 200 levels"


def test_a_body_within_the_limit_is_read(srv: ServerHandle) -> None:
    body = {"model": str(srv.stack.model.name), "prompt": "Hi", "max_tokens": 1,
            "stop": ["x"], "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": _schema(40)}}}
    r = _post(srv, json.dumps(body).encode())
    assert r.status_code == 200, r.text


def test_a_deep_schema_is_refused_naming_the_depth_limit_over_http(srv: ServerHandle) -> None:
    body = {"model": str(srv.stack.model.name), "prompt": "x", "max_tokens": 2,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": _schema(150)}}}
    r = _post(srv, json.dumps(body).encode())
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "nests 151 levels deep; the limit is 100" in message, message


def test_a_deep_schema_is_refused_naming_the_depth_limit_over_grpc(srv: ServerHandle) -> None:
    req = request("x", max_tokens=2)
    req.response_format.json_schema = json.dumps(_schema(150))
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, metadata=srv.auth("acme"), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nests 151 levels deep; the limit is 100" in (info.value.details() or "")
