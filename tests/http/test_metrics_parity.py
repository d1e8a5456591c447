"""The same workload through gRPC (tenant acme) and HTTP (tenant globex) records the same
per-tenant series, told apart only by ``front``: read back from a real /metrics scrape."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.serve.kvfence_server import ServerOptions
from tests.http.conftest import base_url
from tests.serverutil import ServerHandle, TenantSpec, running_server

PROMPT = "Tell me a long story about the sea and the ships that sail on it. " * 3
MAX_TOKENS = 6
PER_FRONT = (  # name, {label: value} that must match between the fronts
    "kvfence_requests_total",
    "kvfence_refusals_total",
    "kvfence_prompt_tokens_total",
    "kvfence_completion_tokens_total",
    "kvfence_cached_prompt_tokens_total",
    "kvfence_ttft_seconds_count",
    "kvfence_inter_token_seconds_count",
)
Series = dict[str, dict[tuple[tuple[str, str], ...], float]]


@pytest.fixture(scope="module")
def srv(tiny_model: Any) -> Iterator[ServerHandle]:
    options = ServerOptions(http_port=0, metrics_port=0, alert_request_kv_pages=1)
    with running_server(tiny_model, {"acme": TenantSpec(), "globex": TenantSpec()},
                        options=options) as handle:
        yield handle


def scrape(srv: ServerHandle) -> Series:
    assert srv.metrics_port is not None
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read()
    out: Series = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_front(series: Series, name: str, tenant: str, front: str) -> dict[tuple[Any, ...], float]:
    """The (tenant, front) samples of ``name``, keyed by their other labels except the
    method (``Generate`` on gRPC, ``chat.completions`` on HTTP), summed over it."""
    out: dict[tuple[Any, ...], float] = {}
    for labels, value in series.get(name, {}).items():
        d = dict(labels)
        if d.get("tenant") != tenant or d.get("front") != front:
            continue
        rest = tuple(sorted((k, v) for k, v in d.items() if k not in ("tenant", "front", "method")))
        out[rest] = out.get(rest, 0.0) + value
    return out


def run_grpc(srv: ServerHandle) -> None:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    for _ in range(2):  # the second one hits the first one's cached pages
        req = inference_pb2.GenerateRequest(
            chat=inference_pb2.ChatMessages(
                messages=[inference_pb2.ChatMessage(role="user", content=PROMPT)]
            ),
            sampling=inference_pb2.SamplingParams(temperature=0.0),
            stopping=inference_pb2.StoppingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        list(stub.Generate(req, metadata=srv.auth("acme")))
    bad = inference_pb2.GenerateRequest(
        text="hi", stopping=inference_pb2.StoppingParams(max_tokens=-1)
    )
    with pytest.raises(Exception, match="max_tokens"):
        list(stub.Generate(bad, metadata=srv.auth("acme")))


def run_http(srv: ServerHandle) -> None:
    headers = {"Authorization": f"Bearer {srv.keys['globex']}"}
    url = f"{base_url(srv)}/chat/completions"
    for stream in (False, True):
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": stream}
        r = httpx.post(url, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
                   headers=headers, timeout=60)
    assert r.status_code == 400


def test_both_fronts_record_the_same_series(srv: ServerHandle) -> None:
    run_grpc(srv)
    run_http(srv)
    m = scrape(srv)
    for name in PER_FRONT:
        grpc_side = by_front(m, name, "acme", "grpc")
        http_side = by_front(m, name, "globex", "http")
        assert grpc_side, name
        assert grpc_side == http_side, name
        # nothing leaked across: each tenant's traffic went through one front only
        assert not by_front(m, name, "acme", "http") and not by_front(m, name, "globex", "grpc")
    assert by_front(m, "kvfence_requests_total", "acme", "grpc") == {
        (("code", "INVALID_ARGUMENT"),): 1, (("code", "OK"),): 2
    }
    assert by_front(m, "kvfence_completion_tokens_total", "globex", "http") == {(): 2 * MAX_TOKENS}
    assert by_front(m, "kvfence_inter_token_seconds_count", "globex", "http") == {
        (): 2 * (MAX_TOKENS - 1)
    }
    assert by_front(m, "kvfence_cached_prompt_tokens_total", "globex", "http")[()] > 0
    for side in (("acme", "grpc"), ("globex", "http")):
        assert by_front(m, "kvfence_ttft_seconds_sum", *side)[()] > 0
    alerts = m["kvfence_kv_alerts_total"]
    assert alerts[(("kind", "request"), ("tenant", "acme"))] == 2
    assert alerts[(("kind", "request"), ("tenant", "globex"))] == 2
