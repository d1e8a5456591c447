"""INVALID_ARGUMENT: every malformed request is refused with a BadRequest field violation,
before the engine or the KV cache sees it (the tenant's prefix lookups do not move)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import grpc
import pytest

from protos.kvfence.v1 import inference_pb2
from tests.serverutil import ServerHandle
from tests.service.leaks import SECRET, SECRET_FRAGMENTS, leaked, log_strings
from tests.service.rpc import details, generate, request, usage, violations

Case = Callable[[], inference_pb2.GenerateRequest]


def _with(**kw: object) -> Case:
    def make() -> inference_pb2.GenerateRequest:
        req = request("Hello world")
        for path, value in kw.items():
            msg_name, field = path.split("__")
            msg = getattr(req, msg_name)
            if isinstance(value, list):
                getattr(msg, field).extend(value)
            else:
                setattr(msg, field, value)
        return req

    return make


def _chat(messages: list[tuple[str, str]]) -> Case:
    def make() -> inference_pb2.GenerateRequest:
        req = request(None)
        req.chat.SetInParent()
        for role, content in messages:
            req.chat.messages.add(role=role, content=content)
        return req

    return make


CASES: list[tuple[str, Case, str]] = [
    ("empty text", lambda: request(""), "text"),
    ("no input", lambda: request(None), "input"),
    ("token id too big", lambda: request(ids=[1, 2, 10**6]), "token_ids.ids[2]"),
    ("negative token id", lambda: request(ids=[-1]), "token_ids.ids[0]"),
    ("empty ids", lambda: request(ids=[]), "token_ids.ids"),
    ("temperature NaN", _with(sampling__temperature=math.nan), "sampling.temperature"),
    ("temperature inf", _with(sampling__temperature=math.inf), "sampling.temperature"),
    ("temperature < 0", _with(sampling__temperature=-0.5), "sampling.temperature"),
    ("top_p 0", _with(sampling__top_p=0.0), "sampling.top_p"),
    ("top_p > 1", _with(sampling__top_p=1.5), "sampling.top_p"),
    ("min_p < 0", _with(sampling__min_p=-0.1), "sampling.min_p"),
    ("top_k < 0", _with(sampling__top_k=-1), "sampling.top_k"),
    ("repetition 0", _with(sampling__repetition_penalty=0.0), "sampling.repetition_penalty"),
    # Degenerate values that could give NaN logprobs or empty text.
    ("temperature 1e-45", _with(sampling__temperature=1e-45), "sampling.temperature"),
    ("temperature 0.009", _with(sampling__temperature=0.009), "sampling.temperature"),
    ("repetition 1e-45", _with(sampling__repetition_penalty=1e-45), "sampling.repetition_penalty"),
    ("repetition 101", _with(sampling__repetition_penalty=101.0), "sampling.repetition_penalty"),
    ("presence 3", _with(sampling__presence_penalty=3.0), "sampling.presence_penalty"),
    ("frequency NaN", _with(sampling__frequency_penalty=math.nan), "sampling.frequency_penalty"),
    ("max_tokens 0", _with(stopping__max_tokens=0), "stopping.max_tokens"),
    ("max_tokens < 0", _with(stopping__max_tokens=-5), "stopping.max_tokens"),
    ("over context", _with(stopping__max_tokens=510), "stopping.max_tokens"),
    ("min > max", _with(stopping__min_tokens=9), "stopping.min_tokens"),
    ("17 stop strings", _with(stopping__stop=[f"s{i}" for i in range(17)]), "stopping.stop"),
    ("long stop string", _with(stopping__stop=["x" * 257]), "stopping.stop[0]"),
    ("empty stop string", _with(stopping__stop=[""]), "stopping.stop[0]"),
    ("bad stop token", _with(stopping__stop_token_ids=[10**6]), "stopping.stop_token_ids[0]"),
    ("logprobs 21", lambda: request("hi", logprobs=21), "logprobs"),
    ("unknown model", lambda: request("hi", model="nope"), "model"),
    ("long client id", lambda: request("hi", client_request_id="x" * 129), "client_request_id"),
    ("ids over context", lambda: request(ids=[5] * 600), "token_ids.ids"),
    ("text over bytes", lambda: request("a" * (511 * 32 + 1)), "text"),
    ("empty chat", _chat([]), "chat.messages"),
    ("bad chat role", _chat([("wizard", "hi")]), "chat.messages[0].role"),
    ("huge chat message", _chat([("user", "y" * 20_000)]), "chat.messages[0].content"),
    ("too many chat messages", _chat([("user", "hi")] * 513), "chat.messages"),
]


@pytest.mark.parametrize(
    ("make", "field"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_request_is_invalid_argument_before_any_kv(
    srv: ServerHandle, make: Case, field: str
) -> None:
    before = usage(srv, "globex")
    with pytest.raises(grpc.RpcError) as info:
        generate(srv, "globex", make())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in violations(info.value)
    after = usage(srv, "globex")
    assert after.prefix_miss_tokens == before.prefix_miss_tokens  # no sequence was opened
    assert after.pages_in_use == 0


def test_tenant_max_prompt_tokens_is_checked_after_tokenizing(srv: ServerHandle) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(srv, "short", request("Hello world, how are you today? I'm fine, thanks."))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(info.value) == ["text"]
    assert "the limit is 8" in details(info.value)["BadRequest"].field_violations[0].description
    assert len(generate(srv, "short", request(ids=[5] * 8, max_tokens=1))) == 3


@pytest.mark.parametrize("as_text", [False, True], ids=["ids", "text"])
def test_681280_token_prompt_is_refused_quickly(srv: ServerHandle, as_text: bool) -> None:
    n = 681_280
    req = request("abcd" * n) if as_text else request(ids=[7] * n)
    misses = usage(srv, "globex").prefix_miss_tokens
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        generate(srv, "globex", req)
    elapsed = time.monotonic() - started
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Past the tenant's request bytes (service/admission/request_size.py): refused before decoding.
    assert violations(info.value) == ["request"]
    assert elapsed < 5.0
    assert usage(srv, "globex").prefix_miss_tokens == misses


def test_message_over_the_receive_limit_is_resource_exhausted_by_grpc(srv: ServerHandle) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(srv, "globex", request("z" * (9 * 1024 * 1024)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_smallest_accepted_sampling_values_give_finite_logprobs(srv: ServerHandle) -> None:
    """The edges of the accepted ranges (README) still sample: finite logprobs, real tokens."""
    for fields in ({"temperature": 0.01}, {"temperature": 0.0, "repetition_penalty": 0.01}):
        req = request("Hello world", max_tokens=4, logprobs=2)
        for name, value in fields.items():
            setattr(req.sampling, name, value)
        out = generate(srv, "globex", req)
        chunks = [r.chunk for r in out if r.HasField("chunk")]
        assert sum(len(c.token_ids) for c in chunks) == 4
        logprobs = [lp.logprob for c in chunks for lp in c.logprobs]
        assert logprobs and all(math.isfinite(x) and x <= 0 for x in logprobs), fields


# Each request carries SECRET in (or next to) the field it gets wrong.
CONTENT_CASES: list[tuple[str, str, Case, str]] = [
    ("bad chat role, secret content", "globex", _chat([("wizard", SECRET)]),
     "chat.messages[0].role"),
    ("secret as the chat role", "globex", _chat([(SECRET, "hi")]), "chat.messages[0].role"),
    ("huge chat message", "globex", _chat([("user", SECRET * 600)]), "chat.messages[0].content"),
    ("long stop string", "globex", _with(stopping__stop=[SECRET * 10]), "stopping.stop[0]"),
    ("text over bytes", "globex", lambda: request(SECRET * 400), "text"),
    ("over context", "globex", lambda: request(SECRET, max_tokens=510), "stopping.max_tokens"),
    ("over the tenant's prompt limit", "short", lambda: request(SECRET), "text"),
]


def _error_strings(err: grpc.RpcError) -> list[str]:
    out = [err.details() or ""]
    for name, detail in details(err).items():
        out.append(str(detail))  # protobuf text format escapes non-ASCII: also search decoded
        if name == "BadRequest":
            out.extend(f"{v.field} {v.description}" for v in detail.field_violations)
        elif name == "ErrorInfo":
            out.extend([detail.reason, detail.domain, *detail.metadata.values()])
    return out


@pytest.mark.parametrize(
    ("tenant", "make", "field"), [c[1:] for c in CONTENT_CASES], ids=[c[0] for c in CONTENT_CASES]
)
def test_invalid_argument_never_echoes_request_content(
    srv: ServerHandle, tenant: str, make: Case, field: str
) -> None:
    before = len(srv.log_lines())
    with pytest.raises(grpc.RpcError) as info:
        generate(srv, tenant, make())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in violations(info.value)
    new_lines = srv.log_lines()[before:]
    assert any('"generate.error"' in line for line in new_lines)  # the text reaches the log
    assert not leaked([*_error_strings(info.value), *log_strings(new_lines)], SECRET_FRAGMENTS)
