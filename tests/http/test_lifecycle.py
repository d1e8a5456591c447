"""Client disconnects free pages within a step; drain answers 503 with Retry-After."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.serve.kvfence_server import ServerOptions
from tests.http.conftest import TENANTS, base_url
from tests.serverutil import ServerHandle, running_server

LONG = {"prompt": "The quick brown fox " * 8, "max_tokens": 400, "ignore_eos": True}


def _headers(srv: ServerHandle, tenant: str = "acme") -> dict[str, str]:
    return {"Authorization": f"Bearer {srv.keys[tenant]}"}


def _wait(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def _in_use(srv: ServerHandle, tenant: str) -> int:
    return int(srv.usage(tenant).pages_in_use)


def test_streaming_disconnect_frees_pages(srv: ServerHandle) -> None:
    body = {"model": srv.stack.model.name, "stream": True, **LONG}
    with httpx.stream("POST", base_url(srv) + "/completions", json=body,
                      headers=_headers(srv, "globex"), timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        assert _in_use(srv, "globex") > 0
    steps = srv.engine.counters().num_steps
    assert _wait(lambda: _in_use(srv, "globex") == 0)
    # Freed by the abort at the start of the next step or two, not by running to max_tokens.
    assert srv.engine.counters().num_steps - steps < 20


def test_non_streaming_disconnect_frees_pages(srv: ServerHandle) -> None:
    body = {"model": srv.stack.model.name, **LONG}

    outcome: list[str] = []

    def post() -> None:
        try:
            httpx.post(base_url(srv) + "/completions", json=body, headers=_headers(srv, "globex"),
                       timeout=httpx.Timeout(30, read=0.5))
            outcome.append("answered")
        except httpx.ReadTimeout:
            outcome.append("timed out")

    thread = threading.Thread(target=post)
    thread.start()
    assert _wait(lambda: _in_use(srv, "globex") > 0)
    # Paused, the request cannot finish before the client gives up (a loaded machine or a
    # fast engine must not turn this into a completed request).
    with srv.paused_engine():
        thread.join(10)
    assert outcome == ["timed out"]
    steps = srv.engine.counters().num_steps
    assert _wait(lambda: _in_use(srv, "globex") == 0)
    assert srv.engine.counters().num_steps - steps < 20


@pytest.fixture
def drain_srv(tiny_model: Any) -> Iterator[ServerHandle]:
    with running_server(tiny_model, TENANTS, options=ServerOptions(http_port=0)) as handle:
        yield handle


def test_drain_refuses_new_requests_with_503(drain_srv: ServerHandle) -> None:
    srv = drain_srv
    url = base_url(srv)
    body = {"model": srv.stack.model.name, "stream": True, **LONG, "max_tokens": 440}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", url + "/completions", json=body, headers=_headers(srv),
                      timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        # Paused, the stream provably outlives the grace period; drain's abort then waits
        # for the engine lock until the pause ends.
        with srv.paused_engine():
            future = asyncio.run_coroutine_threadsafe(srv.server.drain(grace_s=0.3), srv.loop)
            assert _wait(lambda: srv.server.draining)
            refused = httpx.post(url + "/completions", json={"prompt": "x"}, headers=_headers(srv))
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "service_unavailable"
            health = httpx.get(url.removesuffix("/v1") + "/health")
            assert health.status_code == 503
            time.sleep(0.5)
        for line in lines:  # the in-flight stream is aborted after the grace period
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    future.result(30)
    assert "error" in events[-1] and events[-1]["error"]["type"] == "service_unavailable"
    assert _in_use(srv, "acme") == 0
