"""OpenTelemetry spans: the tree of one request on each front, read from an in-memory
exporter; tenant as an attribute, no prompt or output text anywhere; off = not imported."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.serve.kvfence_server import ServerOptions
from service.telemetry.tracing import Tracing
from tests.serverutil import ServerHandle, TenantSpec, running_server

SECRET = "the launch code is swordfish-4471"


@pytest.fixture(scope="module")
def traced(tiny_model: Any) -> Iterator[tuple[ServerHandle, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processor(SimpleSpanProcessor(exporter))
    with running_server(tiny_model, {"acme": TenantSpec()},
                        options=ServerOptions(http_port=0)) as srv:
        # NOTE: the server builds its Tracing from --otlp-endpoint; the test hands both
        # fronts one that exports to memory instead.
        srv.server.inference._tracing = tracing
        front = srv.server.http_front
        assert front is not None
        front._d = dataclasses.replace(front._d, tracing=tracing)
        yield srv, exporter


def _tree(exporter: InMemorySpanExporter) -> tuple[Any, list[Any]]:
    spans = exporter.get_finished_spans()
    [root] = [s for s in spans if s.parent is None]
    children = [s for s in spans if s.parent is not None]
    assert all(s.parent.span_id == root.context.span_id for s in children)
    return root, children


def _no_text(spans: list[Any], texts: list[str]) -> None:
    values = [str(v) for s in spans for v in s.attributes.values()]
    values += [str(v) for s in spans for e in s.events for v in e.attributes.values()]
    values += [s.name for s in spans]
    for text in texts:
        assert not any(text in v or (v in text and len(v) > 6) for v in values), text


def test_one_http_request_is_one_span_tree(
    traced: tuple[ServerHandle, InMemorySpanExporter],
) -> None:
    srv, exporter = traced
    exporter.clear()
    assert srv.server.http is not None
    r = httpx.post(
        f"http://127.0.0.1:{srv.server.http.port}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": SECRET}], "max_tokens": 5,
              "ignore_eos": True, "stream": True},
        headers={"Authorization": f"Bearer {srv.keys['acme']}"}, timeout=60,
    )
    assert r.status_code == 200
    root, children = _tree(exporter)
    _assert_full_tree(root, children, "http", completion_tokens=5)
    output = "".join(line for line in r.text.splitlines() if '"content"' in line)
    _no_text([root, *children], [SECRET, "swordfish", output[-40:]])


def _assert_full_tree(root: Any, children: list[Any], front: str, completion_tokens: int) -> None:
    """auth, tokenize, queue, prefill, decode, stream: each once, in order, inside the root."""
    assert root.name == "kvfence.request"
    assert dict(root.attributes) == {"kvfence.tenant": "acme", "kvfence.front": front,
                                     "kvfence.request_id": root.attributes["kvfence.request_id"],
                                     "kvfence.code": "OK"}
    names = [s.name for s in sorted(children, key=lambda s: (s.start_time, s.name))]
    assert names == ["auth", "tokenize", "queue", "prefill", "decode", "stream"]
    by = {s.name: s for s in children}
    assert by["decode"].attributes["kvfence.completion_tokens"] == completion_tokens
    assert by["prefill"].attributes["kvfence.prompt_tokens"] > 0
    for a, b in (("auth", "tokenize"), ("tokenize", "queue"), ("queue", "prefill"),
                 ("prefill", "decode")):
        assert by[a].end_time <= by[b].start_time + 1_000_000  # in order (1 ms of clock skew)
    assert root.start_time <= by["auth"].start_time and by["stream"].end_time <= root.end_time


def test_one_grpc_request_is_the_same_tree(
    traced: tuple[ServerHandle, InMemorySpanExporter],
) -> None:
    srv, exporter = traced
    exporter.clear()
    req = inference_pb2.GenerateRequest(
        text=SECRET, stopping=inference_pb2.StoppingParams(max_tokens=4, ignore_eos=True)
    )
    out = list(inference_pb2_grpc.InferenceStub(srv.channel()).Generate(
        req, metadata=srv.auth("acme")))
    root, children = _tree(exporter)
    _assert_full_tree(root, children, "grpc", completion_tokens=4)
    text = "".join(m.chunk.text for m in out if m.HasField("chunk"))
    _no_text([root, *children], [SECRET, text] if len(text) > 6 else [SECRET])


def test_tracing_off_never_imports_opentelemetry() -> None:
    """Not its SDK nor its exporter (redis, when installed, imports the API itself)."""
    code = (
        "import sys\n"
        "import service.serve.kvfence_server, service.http.front, service.grpc.inference_service\n"
        "from service.telemetry.tracing import Tracing\n"
        "t = Tracing.off().request('acme', 'http', 'r')\n"
        "with t.span('tokenize'):\n    pass\n"
        "t.end('OK')\n"
        "ours = ('opentelemetry.sdk.trace', 'opentelemetry.exporter')\n"
        "assert not [m for m in sys.modules if m.startswith(ours)], sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=".", timeout=120)
