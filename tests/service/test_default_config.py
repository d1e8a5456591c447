"""The server's defaults keep tenants apart: with no isolation flag given, a KV page that
passes from one tenant to another is zeroed first (scrub policy ``reassign``).

Two ways in, each with its own copy of the default: a real ``kvfence serve`` process (the
CLI's flag defaults) and an in-process server built from ``EngineSizing``'s defaults. Only
the pool size is set (small, so tenant B's pages must be pages tenant A wrote) plus what a
test needs to reach the server (port 0, a metrics port); everything else is the default,
warm-up and dtype included. The one exception is KV shares: by default each tenant's share is
a hard cap (half this pool each), so a page can only pass between tenants when shares
overlap. Each tenant is given the whole pool with ``--kv-overcommit`` so that it does.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvcache.pool import page_bytes
from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2_grpc
from service.model.loader import resolve_kv_dtype
from service.serve.app import EngineSizing
from service.serve.kvfence_server import ServerOptions
from tests.serverutil import ROOT, SERVING_RE, TenantSpec, running_server, write_tenants_file
from tests.service.rpc import request

POOL_PAGES = 12
PAGE = 16
A_PROMPT = list(range(10, 10 + POOL_PAGES * PAGE - 8))  # with its output, A writes every page
B_PROMPT = list(range(300, 340))  # 40 tokens: B needs 3 pages, all written by A before
TENANTS = {
    "alice": TenantSpec(max_kv_pages=POOL_PAGES),
    "bob": TenantSpec(max_kv_pages=POOL_PAGES),
}


def _pool_bytes(model_dir: Path) -> int:
    """POOL_PAGES pages of the model in the dtype ``--dtype auto`` picks on this CPU."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_page = page_bytes(cfg["num_hidden_layers"], PAGE, cfg["num_key_value_heads"], head_dim,
                          resolve_kv_dtype("auto", "cpu"))
    return POOL_PAGES * per_page


def _scrape(metrics_port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _scrubs_once_settled(channel: grpc.Channel, metrics_port: int, key: str, tenant: str) -> float:
    """The scrub counter from a /metrics snapshot taken after ``tenant``'s last request
    (its cached pages in the snapshot equal its live GetUsage)."""
    live = cache_pb2_grpc.CacheStub(channel).GetUsage(
        cache_pb2.GetUsageRequest(), metadata=(("authorization", f"Bearer {key}"),), timeout=10
    )
    assert live.pages_cached > 0
    deadline = time.monotonic() + 15
    while True:
        m = _scrape(metrics_port)
        seen = m.get("kvfence_kv_pages_cached", {}).get((("tenant", tenant),))
        if seen == live.pages_cached or time.monotonic() > deadline:
            assert seen == live.pages_cached, (seen, live.pages_cached)
            return m["kvfence_kv_scrubs_total"][()]
        time.sleep(0.2)


def _alice_then_bob(target: str, metrics_port: int, keys: dict[str, str]) -> tuple[float, float]:
    """(scrubs while Bob's request ran, Bob's pages needed)."""
    with grpc.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for tenant, prompt in (("alice", A_PROMPT), ("bob", B_PROMPT)):
            list(stub.Generate(request(ids=prompt, max_tokens=4),
                               metadata=(("authorization", f"Bearer {keys[tenant]}"),),
                               timeout=60))
            if tenant == "alice":
                before = _scrubs_once_settled(channel, metrics_port, keys["alice"], "alice")
        after = _scrubs_once_settled(channel, metrics_port, keys["bob"], "bob")
    return after - before, math.ceil((len(B_PROMPT) + 4) / PAGE)


def _check(scrubbed: float, bob_pages: int) -> None:
    # Every page Bob got held Alice's KV: each one is zeroed on the way.
    assert scrubbed == bob_pages, (scrubbed, bob_pages)


def test_kvfence_serve_with_no_isolation_flags_scrubs_between_tenants(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    keys = write_tenants_file(tmp_path / "tenants.toml", TENANTS)
    args = [sys.executable, "-m", "service.serve.commands", "serve", "--model", str(tiny_llama_dir),
            "--tenants", str(tmp_path / "tenants.toml"), "--port", "0", "--metrics-port", "0",
            "--kv-memory", str(_pool_bytes(tiny_llama_dir)), "--kv-overcommit"]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        popen = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        match = None
        deadline = time.monotonic() + 120
        while match is None and popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            match = next(filter(None, map(SERVING_RE.match, log.read_text().splitlines())), None)
        assert match is not None, log.read_text()[-3000:]
        _check(*_alice_then_bob(f"127.0.0.1:{match.group(3)}", int(match.group(4)), keys))
    finally:
        popen.kill()
        popen.wait(10)


def test_engine_sizing_defaults_scrub_between_tenants(tiny_llama_dir: Path, tmp_path: Path) -> None:
    sizing = EngineSizing(kv_memory=str(_pool_bytes(tiny_llama_dir)))
    with running_server(tiny_llama_dir, TENANTS, sizing=sizing,
                        options=ServerOptions(metrics_port=0, stats_interval_s=0.1, kv_overcommit=True),
                        tenants_dir=tmp_path) as srv:
        assert srv.metrics_port is not None
        _check(*_alice_then_bob(srv.target, srv.metrics_port, srv.keys))
