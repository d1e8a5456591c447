"""A grammar built to overflow llguidance's recursion (a chain of 2,800 Lark rules, 34 KB,
within the size limit) is refused with INVALID_ARGUMENT naming the depth limit on both
fronts, and the server process lives on and serves the next request.

The server is a child process, so a crash fails this test instead of the test run."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from tests.engine.test_grammar_depth import lark_chain
from tests.serverutil import (
    SERVING_RE,
    ServerProcess,
    TenantSpec,
    start_server_process,
    write_tenants_file,
)
from tests.service.rpc import request

HTTP_RE = re.compile(r"OpenAI-compatible HTTP on http://[\d.]+:(\d+)/v1")
BOMB = lark_chain(2800)


@pytest.fixture(scope="module")
def proc(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, str, int]]:
    tenants = tmp_path_factory.mktemp("bomb") / "tenants.toml"
    keys = write_tenants_file(tenants, {"acme": TenantSpec()})
    p = start_server_process(tiny_llama_dir, tenants, ["--http-port", "0"])
    try:
        deadline = time.monotonic() + 30  # the HTTP line follows the serving line
        while not (ports := [m.group(1) for line in p.output if (m := HTTP_RE.search(line))]):
            assert time.monotonic() < deadline, "\n".join(p.output)
            time.sleep(0.05)
        yield p, keys["acme"], int(ports[0])
    finally:
        p.stop()


def _generate(target: str, key: str, req: inference_pb2.GenerateRequest) -> list[object]:
    with grpc.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return list(stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),), timeout=60))


def _model(p: ServerProcess) -> str:
    return next(m.group(1) for line in p.output if (m := SERVING_RE.match(line)))


def _post(port: int, key: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_rule_chain_is_refused_over_grpc_and_the_server_serves_on(
    proc: tuple[ServerProcess, str, int],
) -> None:
    p, key, _ = proc
    bomb = request("x", max_tokens=2)
    bomb.response_format.lark_grammar = BOMB
    with pytest.raises(grpc.RpcError) as info:
        _generate(p.target, key, bomb)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the limit is 1000" in (info.value.details() or "")
    assert p.popen.poll() is None
    responses = _generate(p.target, key, request("Hello", max_tokens=2))
    assert responses[-1].WhichOneof("event") == "finished"  # type: ignore[attr-defined]


def test_the_rule_chain_is_refused_over_http_and_the_server_serves_on(
    proc: tuple[ServerProcess, str, int],
) -> None:
    p, key, port = proc
    code, body = _post(port, key, {
        "model": _model(p), "prompt": "x", "max_tokens": 2,
        "response_format": {"type": "grammar", "grammar": BOMB},
    })
    assert code == 400
    assert "the limit is 1000" in json.dumps(body)
    assert p.popen.poll() is None
    code, body = _post(port, key, {"model": _model(p), "prompt": "Hello", "max_tokens": 2})
    assert code == 200, body
