"""Cross-tenant isolation through the OpenAI-compatible HTTP front (``openai`` SDK).

1. Prefix cache: tenant B is reported 0 cached tokens on prompts tenant A has cached, while
   A's own repeats report its full prompt pages (the control).
2. Compiled-grammar cache: per trial A compiles a fresh large JSON schema S and repeats it
   (A's warm latency: a cache hit); B then sends S and a novel schema of the same size, in
   alternating order. B's two latencies must match (median ratio in [0.8, 1.25]): the cache
   is per tenant, so A's schemas are as cold for B as novel ones. A's warm latency being
   lower than B's cold one shows the measurement can see a compile.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from service.app import EngineSizing
from service.grpc_server import ServerOptions
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.recorder import Recorder
from tests.verify.scale import size
from tests.verify.stats import median

TRIALS = size(5, 20)
SCHEMA_WORDS = 2000
SIZING = EngineSizing(kv_memory="64MiB", max_model_len=512, warmup=False, dtype="float32")


@pytest.fixture(scope="module")
def srv(default_model: Any) -> Iterator[ServerHandle]:
    tenants = {"alice": TenantSpec(), "bob": TenantSpec()}
    with running_server(default_model, tenants, sizing=SIZING,
                        options=ServerOptions(http_port=0)) as handle:
        yield handle


def _client(srv: ServerHandle, tenant: str) -> Any:
    import openai

    assert srv.server.http is not None
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server.http.port}/v1",
                         api_key=srv.keys[tenant], max_retries=0, timeout=120)


def _cached(srv: ServerHandle, tenant: str, prompt: str) -> int:
    r = _client(srv, tenant).completions.create(
        model=srv.stack.model.name, prompt=prompt, max_tokens=1, temperature=0
    )
    return int(r.usage.prompt_tokens_details.cached_tokens)


@pytest.mark.timeout(size(300, 900))
def test_http_cached_tokens_are_never_another_tenants(srv: ServerHandle, record: Recorder) -> None:
    rng = random.Random(11)
    page = srv.engine.page_size
    b_hits: list[int] = []
    a_hits: list[int] = []
    for _ in range(TRIALS):
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kappa"])
                         for _ in range(60))
        _cached(srv, "alice", words)
        a_hits.append(_cached(srv, "alice", words))
        b_hits.append(_cached(srv, "bob", words))
    assert record("HTTP cached tokens reported to B on A's prefixes", sum(b_hits), "== 0",
                  sum(b_hits) == 0)
    assert record("HTTP cached tokens on A's own repeat (control), min", min(a_hits),
                  f">= {2 * page}", min(a_hits) >= 2 * page)


def _schema(rng: random.Random) -> dict[str, Any]:
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(4, 12)))
             for _ in range(SCHEMA_WORDS)]
    return {"type": "object", "properties": {"k": {"enum": words}}, "required": ["k"],
            "additionalProperties": False}


def _latency(srv: ServerHandle, tenant: str, schema: dict[str, Any]) -> float:
    start = time.perf_counter()
    _client(srv, tenant).chat.completions.create(
        model=srv.stack.model.name, messages=[{"role": "user", "content": "Pick one."}],
        max_tokens=1, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    return time.perf_counter() - start


@pytest.mark.timeout(size(300, 900))
def test_http_grammar_cache_timing_is_per_tenant(srv: ServerHandle, record: Recorder) -> None:
    rng = random.Random(7)
    for tenant in ("alice", "bob"):  # first-call effects go here
        _latency(srv, tenant, _schema(rng))
    a_warm: list[float] = []
    b_cross: list[float] = []
    b_cold: list[float] = []
    for trial in range(TRIALS):
        shared, novel = _schema(rng), _schema(rng)
        _latency(srv, "alice", shared)
        a_warm.append(_latency(srv, "alice", shared))
        order = [("cross", shared), ("cold", novel)]
        for kind, schema in order if trial % 2 == 0 else reversed(order):
            (b_cross if kind == "cross" else b_cold).append(_latency(srv, "bob", schema))
    ratio = median(b_cross) / median(b_cold)
    record.info("trials per sample", TRIALS)
    record.info("B latency median on A's schema (s)", median(b_cross))
    record.info("B latency median on a novel schema (s)", median(b_cold))
    assert record("grammar-cache median ratio, B on A's schema / B novel", round(ratio, 3),
                  "in [0.8, 1.25]", 0.8 <= ratio <= 1.25)
    power = median(a_warm) / median(b_cold)
    assert record("A warm (own cache hit) / B cold, median ratio (power)", round(power, 3),
                  "< 1.0", power < 1.0)
