"""/metrics is scraped over HTTP and parsed; counts are exact on this module's fresh server."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serverutil import ServerHandle
from tests.service.conftest import TENANTS
from tests.service.rpc import generate, request, stubs


def scrape(srv: ServerHandle) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    assert srv.metrics_port is not None
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _refreshed(srv: ServerHandle) -> None:
    srv.call(srv.server.refresh_stats())


def test_scrape_shows_each_tenants_tokens_and_requests(srv: ServerHandle) -> None:
    a = generate(srv, "acme", request("Hello world", max_tokens=3))
    b = generate(srv, "acme", request("Hello there", max_tokens=2))
    g = generate(srv, "globex", request("Hi", max_tokens=1))
    with pytest.raises(grpc.RpcError):
        generate(srv, "globex", request(""))
    _refreshed(srv)
    m = scrape(srv)
    refused = {"code": "INVALID_ARGUMENT", "front": "grpc", "reason": "invalid_argument",
               "tenant": "globex"}
    assert m["kvfence_refusals_total"][tuple(sorted(refused.items()))] == 1
    prompt = a[0].started.prompt_tokens + b[0].started.prompt_tokens
    assert m["kvfence_prompt_tokens_total"][(("front", "grpc"), ("tenant", "acme"))] == prompt
    assert m["kvfence_completion_tokens_total"][(("front", "grpc"), ("tenant", "acme"))] == 5
    assert m["kvfence_prompt_tokens_total"][(("front", "grpc"), ("tenant", "globex"))] == g[0].started.prompt_tokens
    reqs = m["kvfence_requests_total"]
    assert reqs[(("code", "OK"), ("front", "grpc"), ("method", "Generate"), ("tenant", "acme"))] == 2
    assert reqs[(("code", "INVALID_ARGUMENT"), ("front", "grpc"), ("method", "Generate"), ("tenant", "globex"))] == 1
    assert m["kvfence_ttft_seconds_count"][(("front", "grpc"), ("tenant", "acme"))] == 2
    assert m["kvfence_inter_token_seconds_count"][(("front", "grpc"), ("tenant", "acme"))] == 3  # (3-1) + (2-1)
    # Cache figures come from KVCacheManager.stats().
    stats = srv.stats()
    assert m["kvfence_kv_pages_total"][()] == stats.total_pages
    assert m["kvfence_kv_scrubs_total"][()] == stats.scrubs
    assert m["kvfence_kv_scrub_seconds_total"][()] == stats.scrub_s
    assert m["kvfence_kv_prefix_seconds_total"][()] == stats.prefix_s > 0  # acme's prompt cached
    assert m["kvfence_kv_fence_violations_total"][()] == stats.fence_violations == 0
    assert {dict(k)["reason"] for k in m["kvfence_kv_evictions_total"]} == {
        "ttl",
        "lru",
        "quota",
        "purge",
    }
    for name in (
        "kvfence_kv_pages_used",
        "kvfence_kv_pages_cached",
        "kvfence_prefix_hit_tokens_total",
    ):
        assert {dict(k)["tenant"] for k in m[name]} == set(TENANTS)
    assert m["kvfence_queue_depth"][()] == 0
    assert m["kvfence_running_sequences"][()] == 0


def test_tenant_label_is_bounded_by_the_tenants_file(srv: ServerHandle) -> None:
    inference, _ = stubs(srv)
    with pytest.raises(grpc.RpcError):
        list(inference.Generate(request("hi"), metadata=(("authorization", "Bearer kvf_made-up"),)))
    m = scrape(srv)
    assert m["kvfence_auth_denials_total"][(("code", "UNAUTHENTICATED"),)] >= 1
    labels = {dict(k).get("tenant") for series in m.values() for k in series} - {None}
    assert labels <= set(TENANTS) | {"unknown"}
    assert srv.server.metrics.label("not-a-tenant") == "unknown"


def test_kv_anomaly_alerts_for_a_request_and_a_tenant(srv: ServerHandle) -> None:
    # alert_request_kv_pages=3: 6 prompt + 60 new tokens span 5 pages of 16.
    generate(srv, "acme", request("Hello world", max_tokens=60))
    generate(srv, "acme", request("Hello world", max_tokens=2))  # 1 page: no alert
    registry = srv.server.metrics.registry
    assert registry.get_sample_value(
        "kvfence_kv_alerts_total", {"tenant": "acme", "kind": "request"}
    ) == 1
    # alert_tenant_kv_pages=4: a 100-token prompt leaves 6 full pages in acme's prefix cache.
    generate(srv, "acme", request(ids=[5] * 100, max_tokens=1))
    deadline = time.monotonic() + 5
    while True:
        m = scrape(srv)
        alerts = m.get("kvfence_kv_alerts_total", {})
        if alerts.get((("kind", "tenant"), ("tenant", "acme"))):
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert alerts[(("kind", "request"), ("tenant", "acme"))] == 2  # once per large request
    assert alerts[(("kind", "tenant"), ("tenant", "acme"))] == 1  # once per crossing
    events = [line for line in srv.log_lines() if '"kv.alert.' in line]
    assert len([e for e in events if "kv.alert.request_pages" in e]) == 2
    assert len([e for e in events if "kv.alert.tenant_pages" in e]) == 1
