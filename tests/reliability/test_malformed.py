"""Extreme and malformed input over gRPC: every case gets its documented status (the table in
``service/errors.py``), no error message echoes the input, and afterwards the KV pool is at
baseline and the server still serves a normal request to the end.

Random bytes as the request message get INVALID_ARGUMENT (service/grpc/wire.py parses requests
itself so that they never surface as UNKNOWN); an unknown method is UNIMPLEMENTED.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.calls import check_stream, collect, gen_request
from tests.verify.pool import wait_for_baseline
from tests.verify.recorder import Recorder

IA = grpc.StatusCode.INVALID_ARGUMENT
SENTINEL = "zebracorn"  # planted in bad inputs; must never come back in an error message
GENERATE = "/kvfence.v1.Inference/Generate"


@pytest.fixture(scope="module")
def srv(tiny: Any) -> Iterator[ServerHandle]:
    with running_server(tiny, {"acme": TenantSpec()}) as handle:
        yield handle


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int
    vocab_size: int


Call = Callable[[ServerHandle, Limits], tuple[grpc.StatusCode, str]]


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    expected: frozenset[grpc.StatusCode]
    call: Call  # returns the status and message it got
    note: str = ""


def _generate(make: Callable[[int, int], inference_pb2.GenerateRequest]) -> Call:
    def call(srv: ServerHandle, limits: Limits) -> tuple[grpc.StatusCode, str]:
        req = make(limits.max_model_len, limits.vocab_size)
        stub = inference_pb2_grpc.InferenceStub(
            srv.channel(**{"grpc.max_send_message_length": 64 * 2**20})
        )
        result = collect(stub.Generate(req, metadata=srv.auth("acme"), timeout=60))
        return result.code, result.details

    return call


def _raw(method: str, payload: bytes, stream: bool = True) -> Call:
    def call(srv: ServerHandle, _limits: Limits) -> tuple[grpc.StatusCode, str]:
        channel = srv.channel()
        try:
            if stream:
                fn = channel.unary_stream(
                    method, request_serializer=None, response_deserializer=None
                )
                list(fn(payload, metadata=srv.auth("acme"), timeout=30))
            else:
                unary = channel.unary_unary(
                    method, request_serializer=None, response_deserializer=None
                )
                unary(payload, metadata=srv.auth("acme"), timeout=30)
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
        return grpc.StatusCode.OK, ""

    return call


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _with_text(text: str, **stopping: Any) -> inference_pb2.GenerateRequest:
    req = gen_request(text=text, max_tokens=4)
    for k, v in stopping.items():
        setattr(req.stopping, k, v)
    return req


def _sampling(**fields: float) -> Callable[[int, int], inference_pb2.GenerateRequest]:
    def make(_len: int, _vocab: int) -> inference_pb2.GenerateRequest:
        req = gen_request(text=f"hello {SENTINEL}", max_tokens=4)
        for k, v in fields.items():
            setattr(req.sampling, k, v)
        return req

    return make


def _chat(messages: list[tuple[str, str]]) -> Callable[[int, int], inference_pb2.GenerateRequest]:
    def make(_len: int, _vocab: int) -> inference_pb2.GenerateRequest:
        req = gen_request(max_tokens=4)
        req.chat.SetInParent()
        for role, content in messages:
            req.chat.messages.add(role=role, content=content)
        return req

    return make


def _stops(stops: list[str]) -> Callable[[int, int], inference_pb2.GenerateRequest]:
    def make(_len: int, _vocab: int) -> inference_pb2.GenerateRequest:
        req = gen_request(text=f"hello {SENTINEL}", max_tokens=4)
        req.stopping.stop.extend(stops)
        return req

    return make


def _empty_ids(_len: int, _vocab: int) -> inference_pb2.GenerateRequest:
    req = gen_request(max_tokens=4)
    req.token_ids.SetInParent()
    return req


def _max_tokens(value: Callable[[int], int]) -> Callable[[int, int], inference_pb2.GenerateRequest]:
    return lambda n, v: gen_request(_ids(5, v), max_tokens=value(n))


def _cases() -> list[Case]:
    ia = frozenset({IA})
    g = _generate
    return [
        Case("empty text", ia, g(lambda n, v: gen_request(text=""))),
        Case("empty token ids", ia, g(_empty_ids)),
        Case("no input", ia, g(lambda n, v: gen_request())),
        Case("max_model_len+1 ids", ia, g(lambda n, v: gen_request(_ids(n + 1, v)))),
        Case("max_model_len ids (limit is len-1)", ia, g(lambda n, v: gen_request(_ids(n, v)))),
        Case("681,280 ids", ia, g(lambda n, v: gen_request(_ids(681_280, v)))),
        Case("1,000,000 ids", ia, g(lambda n, v: gen_request(_ids(1_000_000, v)))),
        Case("681,280 tokens as text", ia, g(lambda n, v: _with_text(f" {SENTINEL}" * 681_280))),
        Case("1,000,000 tokens as text", ia, g(lambda n, v: _with_text(" hi" * 1_000_000)), "3 MB"),
        Case(
            "9 MiB text (over the receive limit)",
            frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED}),
            g(lambda n, v: _with_text("x" * (9 * 2**20))),
        ),
        Case("token id -1", ia, g(lambda n, v: gen_request([5, -1, 7]))),
        Case("token id == vocab", ia, g(lambda n, v: gen_request([5, v, 7]))),
        Case("token id 2**31-1", ia, g(lambda n, v: gen_request([2**31 - 1]))),
        Case("temperature NaN", ia, g(_sampling(temperature=math.nan))),
        Case("temperature -0.5", ia, g(_sampling(temperature=-0.5))),
        Case("temperature inf", ia, g(_sampling(temperature=math.inf))),
        Case("top_p 0", ia, g(_sampling(top_p=0.0))),
        Case("top_p 1.5", ia, g(_sampling(top_p=1.5))),
        Case("top_p -0.1", ia, g(_sampling(top_p=-0.1))),
        Case("top_p NaN", ia, g(_sampling(top_p=math.nan))),
        Case("max_tokens 0", ia, g(_max_tokens(lambda n: 0))),
        Case("max_tokens -1", ia, g(_max_tokens(lambda n: -1))),
        Case("max_tokens over the context", ia, g(_max_tokens(lambda n: n))),
        Case("max_tokens 2**31-1", ia, g(_max_tokens(lambda n: 2**31 - 1))),
        Case("10,000 stop strings", ia, g(_stops([f"s{i}" for i in range(10_000)]))),
        Case("one 1 MB stop string", ia, g(_stops([SENTINEL * (2**20 // len(SENTINEL))]))),
        Case("empty stop string", ia, g(_stops([""]))),
        Case("10,000 chat messages", ia, g(_chat([("user", "hi")] * 10_000))),
        Case("one 5 MB chat message", ia, g(_chat([("user", SENTINEL * (5 * 2**20 // 9))]))),
        Case("deeply nested chat content (100k)", ia, g(_chat([("user", "[{(" * 33_334)]))),
        Case("unknown chat role", ia, g(_chat([("root", "hi")]))),
        Case("logprobs 21", ia, g(lambda n, v: gen_request([5, 6], logprobs=21))),
        Case("unknown model", ia, g(lambda n, v: _model("nope"))),
        Case(
            "random bytes as the message (5 seeds)",
            frozenset({IA}),
            _random_bytes,
            "service/grpc/wire.py refuses a message that does not parse",
        ),
        Case(
            "unknown method",
            frozenset({grpc.StatusCode.UNIMPLEMENTED}),
            _raw("/kvfence.v1.Inference/Explode", b"", stream=False),
        ),
        Case(
            "unknown service",
            frozenset({grpc.StatusCode.UNIMPLEMENTED}),
            _raw("/kvfence.v9.Nope/Nope", b"", stream=False),
        ),
    ]


def _model(name: str) -> inference_pb2.GenerateRequest:
    req = gen_request([5, 6], max_tokens=2)
    req.model = name
    return req


def _random_bytes(srv: ServerHandle, limits: Limits) -> tuple[grpc.StatusCode, str]:
    """Five seeded random payloads; the worst (any OK counts as the answer) is returned."""
    codes: list[tuple[grpc.StatusCode, str]] = []
    for seed in range(5):
        rng = random.Random(seed)
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(8, 4096)))
        codes.append(_raw(GENERATE, payload)(srv, limits))
    for code, details in codes:
        if code != IA:
            return code, details
    return codes[0]


def _serves_normally(srv: ServerHandle) -> bool:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    result = collect(
        stub.Generate(gen_request([5, 6, 7], max_tokens=6), metadata=srv.auth("acme"), timeout=30)
    )
    return not check_stream(result, prompt_tokens=3, max_tokens=6)


@pytest.mark.timeout(300)
def test_extreme_and_malformed_inputs_get_their_status_and_leave_no_trace(
    srv: ServerHandle, record: Recorder
) -> None:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    (model,) = stub.ListModels(inference_pb2.ListModelsRequest(), metadata=srv.auth("acme")).models
    limits = Limits(model.max_model_len, model.vocab_size)
    cases = _cases()
    failures: list[str] = []
    slowest = 0.0
    for case in cases:
        t0 = time.monotonic()
        code, details = case.call(srv, limits)
        elapsed = time.monotonic() - t0
        slowest = max(slowest, elapsed)
        state = wait_for_baseline(srv)
        if code not in case.expected:
            expected = sorted(c.name for c in case.expected)
            failures.append(f"{case.name}: got {code.name}, expected {expected} {case.note}")
        if SENTINEL in details:
            failures.append(f"{case.name}: the error message echoes the input")
        if not state.at_baseline:
            failures.append(f"{case.name}: pool not at baseline: {state.describe()}")
        if not _serves_normally(srv):
            failures.append(f"{case.name}: a normal request afterwards did not complete")
    # The same nested content, small enough, is just text: it must be served.
    ok_nested = _generate(_chat([("user", "[{(" * 40)]))(srv, limits)[0]
    if ok_nested != grpc.StatusCode.OK:
        failures.append(f"small nested chat content: got {ok_nested.name}, expected OK")
    handled = len(cases) - len({f.split(":")[0] for f in failures if not f.startswith("small")})
    record.info("cases", len(cases))
    assert record(
        "cases handled (status, baseline, still serving)",
        handled,
        f"== {len(cases)}",
        handled == len(cases) and not failures,
    ), failures
    assert record("slowest rejection (s)", slowest, "< 5", slowest < 5.0)
