"""Noisy neighbours on the newer surfaces: grammars, the HTTP front, the tokenizer and the
sampler. Each attack runs as tenant ``attacker`` within its own limits while tenant
``victim`` sends short greedy requests over gRPC; the victim's inter-token gap p50 (and p90
for the floods) is held to 2x its own baseline + 30 ms in ``make verify`` (recorded in the
short run). Two rows are survival rows: a grammar built to overflow the compiler's stack,
and a slowloris on the HTTP port; the server must answer and keep serving.
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.serve.kvfence_server import ServerOptions
from tests.engine.test_grammar_depth import lark_chain
from tests.isolation.test_noisy_neighbour import TENANTS, _judge, _sizing, _vocab
from tests.serverutil import ServerHandle, running_server
from tests.verify.calls import gen_request
from tests.verify.neighbours import AttackStats, Latency, Victim, attack, generate_loop
from tests.verify.recorder import Recorder
from tests.verify.scale import is_full, size
from tests.verify.stats import percentile

VICTIM_N = size(4, 15)
VICTIM_PROMPT = 24
VICTIM_MAX_TOKENS = size(8, 16)
SETTLE_S = size(0.5, 2.0)
AMBIGUOUS = 'start: x\nx: x x | x x x | "a" | "aa"\n'


@pytest.fixture(scope="module")
def loaded(request: pytest.FixtureRequest) -> Any:
    from service.model import load_model

    path = Path(request.getfixturevalue("default_model_path" if is_full() else "tiny_dir"))
    return load_model(path, dtype="auto" if is_full() else "float32", progress=False)


@pytest.fixture(scope="module")
def hsrv(loaded: Any) -> Iterator[ServerHandle]:
    options = ServerOptions(http_port=0)
    with running_server(loaded, TENANTS, sizing=_sizing(), options=options) as handle:
        yield handle


def _victim(handle: ServerHandle) -> Victim:
    return Victim(
        handle.target, handle.auth("victim"), _vocab(handle), VICTIM_PROMPT, VICTIM_MAX_TOKENS
    )


@pytest.fixture(scope="module")
def base(hsrv: ServerHandle) -> Latency:
    _victim(hsrv).run(2)
    return _victim(hsrv).run(VICTIM_N)


def _judge_flood(record: Recorder, baseline: Latency, under: Latency, stats: AttackStats) -> None:
    """``_judge`` (p50), and the gap's p90 against the same bound for a flood."""
    b90, u90 = percentile(baseline.itl, 90), percentile(under.itl, 90)
    bound = 2 * percentile(baseline.itl, 50) + 0.030
    record.info("victim gap p90 baseline (s)", round(b90, 3))
    if is_full():
        ok = record("victim gap p90 under attack (s)", round(u90, 3), f"<= {bound:.3f}",
                    u90 <= bound)
    else:
        record.info("victim gap p90 under attack (s), bound", f"{u90:.3f} / {bound:.3f}")
        ok = True
    _judge(record, baseline, under, stats)
    assert ok


def _url(handle: ServerHandle, path: str) -> str:
    assert handle.server.http is not None
    return f"http://127.0.0.1:{handle.server.http.port}{path}"


def test_ambiguous_grammar_masks(hsrv: ServerHandle, base: Latency, record: Recorder) -> None:
    """Four streams under a 37-byte grammar whose every mask is expensive."""
    lo, hi = _vocab(hsrv)

    def make(rng: random.Random) -> inference_pb2.GenerateRequest:
        req = gen_request([rng.randrange(lo, hi) for _ in range(16)], max_tokens=size(16, 64))
        req.response_format.lark_grammar = AMBIGUOUS
        return req

    with attack(hsrv.target, generate_loop(hsrv.auth("attacker"), make), 4, SETTLE_S) as stats:
        under = _victim(hsrv).run(VICTIM_N)
    _judge(record, base, under, stats)


def test_unique_grammar_compiles(hsrv: ServerHandle, base: Latency, record: Recorder) -> None:
    """Sixteen streams of unique ~50 KB grammars (thousands of literals), one token each."""

    def make(rng: random.Random) -> inference_pb2.GenerateRequest:
        words = {"".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(8)) for _ in range(4500)}
        req = gen_request(text="Say one word:", max_tokens=1)
        req.response_format.lark_grammar = "start: " + " | ".join(f'"{w}"' for w in words)
        return req

    with attack(hsrv.target, generate_loop(hsrv.auth("attacker"), make), 16, SETTLE_S) as stats:
        under = _victim(hsrv).run(VICTIM_N)
    _judge_flood(record, base, under, stats)


@pytest.mark.parametrize("profile", ["plain", "sampler-heavy"])
def test_sixteen_streams(
    hsrv: ServerHandle, base: Latency, record: Recorder, profile: str
) -> None:
    """One tenant's sixteen ordinary streams, plain or with top-p, 20 logprobs, penalties."""
    lo, hi = _vocab(hsrv)

    def make(rng: random.Random) -> inference_pb2.GenerateRequest:
        req = gen_request([rng.randrange(lo, hi) for _ in range(32)], max_tokens=size(16, 64))
        if profile == "sampler-heavy":
            req.sampling.temperature = 0.8
            req.sampling.top_p = 0.9
            req.logprobs = 20
            req.sampling.repetition_penalty = 1.2
            req.sampling.frequency_penalty = 0.3
        return req

    with attack(hsrv.target, generate_loop(hsrv.auth("attacker"), make), 16, SETTLE_S) as stats:
        under = _victim(hsrv).run(VICTIM_N)
    _judge(record, base, under, stats)


def test_tokenize_and_refused_text_flood(
    hsrv: ServerHandle, base: Latency, record: Recorder
) -> None:
    """One serial Tokenize caller with 20 KB texts, and Generate calls whose text is within
    the byte cap but past the token limit (refused only after tokenizing)."""
    auth = hsrv.auth("attacker")
    rng = random.Random(5)
    small = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(20_000))
    limit = int(hsrv.server.prep.model.max_model_len) - 1
    big = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(min(60_000, limit * 8)))

    def work(channel: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        stub = inference_pb2_grpc.InferenceStub(channel)
        while not stop.is_set():
            try:
                if i == 0:
                    stub.Tokenize(inference_pb2.TokenizeRequest(text=small), metadata=auth,
                                  timeout=60)
                else:
                    list(stub.Generate(gen_request(text=big, max_tokens=1), metadata=auth,
                                       timeout=60))
                stats.count(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                stats.count(err.code())

    with attack(hsrv.target, work, 2, SETTLE_S) as stats:
        under = _victim(hsrv).run(VICTIM_N)
    _judge_flood(record, base, under, stats)


def test_cheap_http_answers_flood(hsrv: ServerHandle, base: Latency, record: Recorder) -> None:
    """Back-to-back wrong-key calls, /health, authenticated /v1/models and 400s on HTTP."""
    key = hsrv.keys["attacker"]
    routes = [
        ("GET", "/v1/models", "kvf_guessed", None),
        ("GET", "/health", None, None),
        ("GET", "/v1/models", key, None),
        ("POST", "/v1/completions", key, b"{not json"),
    ]

    def work(channel: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        method, path, auth, body = routes[i % len(routes)]
        headers = {"Authorization": f"Bearer {auth}"} if auth else {}
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                r = client.request(method, _url(hsrv, path), headers=headers, content=body)
                stats.codes[str(r.status_code)] += 1
                stats.calls += 1

    with attack(hsrv.target, work, 8, SETTLE_S) as stats:
        under = _victim(hsrv).run(VICTIM_N)
    record.info("attacker HTTP answers per second", round(stats.calls / stats.seconds, 1))
    _judge_flood(record, base, under, stats)


def test_survives_a_grammar_built_to_overflow_the_compiler(
    hsrv: ServerHandle, record: Recorder
) -> None:
    req = gen_request(text="x", max_tokens=2)
    req.response_format.lark_grammar = lark_chain(2800)
    stub = inference_pb2_grpc.InferenceStub(hsrv.channel())
    try:
        list(stub.Generate(req, metadata=hsrv.auth("attacker"), timeout=60))
        code = grpc.StatusCode.OK.name
    except grpc.RpcError as err:
        code = err.code().name
    http = httpx.post(
        _url(hsrv, "/v1/completions"), timeout=60,
        headers={"Authorization": f"Bearer {hsrv.keys['attacker']}"},
        json={"model": str(hsrv.stack.model.name), "prompt": "x", "max_tokens": 2,
              "response_format": {"type": "grammar", "grammar": lark_chain(2800)}},
    ).status_code
    after = _victim(hsrv).run(2)
    ok = record("2,800-rule grammar over gRPC", code, "INVALID_ARGUMENT",
                code == "INVALID_ARGUMENT")
    ok &= record("2,800-rule grammar over HTTP", http, "400", http == 400)
    ok &= record("victim requests failed after it", len(after.failed), "== 0", not after.failed)
    assert ok


def test_survives_a_slowloris(hsrv: ServerHandle, base: Latency, record: Recorder) -> None:
    assert hsrv.server.http is not None
    port = hsrv.server.http.port
    n = size(300, 2000)
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        under = _victim(hsrv).run(VICTIM_N)
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"),
                          timeout=30) as client:
            other = client.get(_url(hsrv, "/health")).status_code
    finally:
        for s in socks:
            s.close()
    record.info("half-request connections opened", n)
    ok = record("another peer's HTTP call during it", other, "200", other == 200)
    _judge(record, base, under, None)
    assert ok
