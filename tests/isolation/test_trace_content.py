"""No prompt or output text leaves the server in its traces.

A server with ``--otlp-endpoint`` pointed at a local OTLP/gRPC collector (in this process,
keeping every export as the raw bytes the exporter sent) serves one request with a
distinctive prompt on each front. Every span of both requests must arrive (the full tree:
auth, tokenize, queue, prefill, decode, stream), and no exported byte string may contain
the prompt or the generated text: not in a span name, an attribute, an event or the resource.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import httpx
import pytest

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.serve.kvfence_server import ServerOptions
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.recorder import Recorder

PROMPT = "kvfence-trace-canary 7f3a9c: the purple walrus recites the launch code 31415"
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
TREE = ["auth", "decode", "kvfence.request", "prefill", "queue", "stream", "tokenize"]


class Collector:
    """An OTLP/gRPC trace collector that keeps each export request's raw bytes."""

    def __init__(self) -> None:
        self.exports: list[bytes] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        reply = trace_service_pb2.ExportTraceServiceResponse.SerializeToString

        def export(raw: bytes, context: grpc.ServicerContext) -> Any:
            with self._lock:
                self.exports.append(raw)
            return trace_service_pb2.ExportTraceServiceResponse()

        handler = grpc.unary_unary_rpc_method_handler(export, response_serializer=reply)
        service, method = EXPORT.rsplit("/", 1)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service.strip("/"), {method: handler}),)
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)

    def spans(self) -> list[Any]:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        with self._lock:
            raws = list(self.exports)
        out = []
        for raw in raws:
            req = trace_service_pb2.ExportTraceServiceRequest.FromString(raw)
            out += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return out

    def raw(self) -> bytes:
        with self._lock:
            return b"".join(self.exports)


@pytest.fixture(scope="module")
def traced(tiny: Any) -> Iterator[tuple[ServerHandle, Collector]]:
    collector = Collector()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 0.1 s, not every 5 s
        options = ServerOptions(http_port=0, otlp_endpoint=f"http://127.0.0.1:{collector.port}")
        try:
            with running_server(tiny, {"alice": TenantSpec()}, options=options) as srv:
                yield srv, collector
        finally:
            collector.stop()


def _attr(span: Any, key: str) -> Any:
    for kv in span.attributes:
        if kv.key == key:
            return kv.value.string_value or kv.value.int_value
    return None


def _trees(collector: Collector, fronts: tuple[str, ...]) -> dict[str, list[str]]:
    """Span names per front, once every front's whole tree has arrived (or 30 s passed)."""
    deadline = time.monotonic() + 30
    while True:
        spans = collector.spans()
        roots = {s.trace_id: _attr(s, "kvfence.front") for s in spans if not s.parent_span_id}
        trees = {front: sorted(s.name for s in spans if roots.get(s.trace_id) == front)
                 for front in fronts}
        if all(t == TREE for t in trees.values()) or time.monotonic() > deadline:
            return trees
        time.sleep(0.1)


def test_spans_of_both_fronts_carry_no_prompt_or_output_text(
    traced: tuple[ServerHandle, Collector], record: Recorder
) -> None:
    srv, collector = traced
    req = inference_pb2.GenerateRequest(
        text=PROMPT, stopping=inference_pb2.StoppingParams(max_tokens=24, ignore_eos=True))
    grpc_out = "".join(m.chunk.text for m in inference_pb2_grpc.InferenceStub(srv.channel())
                       .Generate(req, metadata=srv.auth("alice")) if m.HasField("chunk"))
    assert srv.server.http is not None
    r = httpx.post(
        f"http://127.0.0.1:{srv.server.http.port}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
              "ignore_eos": True},
        headers={"Authorization": f"Bearer {srv.keys['alice']}"}, timeout=60,
    )
    assert r.status_code == 200
    http_out = r.json()["choices"][0]["message"]["content"]
    trees = _trees(collector, ("grpc", "http"))
    for front, names in trees.items():
        assert record(f"spans of one {front} request", ",".join(names), "the full tree",
                      names == TREE)
    raw = collector.raw()
    # Texts that must not appear: the prompt, its distinctive words, and each output.
    texts = [PROMPT, "trace-canary", "purple walrus", grpc_out.strip(), http_out.strip()]
    assert all(len(t) >= 8 for t in texts), texts  # an empty output would check nothing
    leaks = [t[:12] for t in texts if t.encode("utf-8") in raw]
    assert record("exported span bytes holding prompt or output text", len(leaks), "== 0",
                  not leaks)
