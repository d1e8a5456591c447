"""A request's bytes are bounded by its tenant's prompt limit before it is decoded.

Tenant ``short`` may send 8 prompt tokens: its Generate and Tokenize messages may take
8 x 8 bytes + 256 KiB. A larger one is refused INVALID_ARGUMENT on ``request`` from its
length alone, naming the limit; the same message from a tenant with the model's whole
context passes the size bound and is refused by the field it overflows.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.admission.request_fields import MAX_LOGIT_BIAS
from service.admission.request_size import (
    GRPC_BYTES_PER_TOKEN,
    JSON_BYTES_PER_TOKEN,
    REQUEST_ALLOWANCE_BYTES,
    request_limit,
)
from tests.service.rpc import details, request, violations

SHORT_LIMIT = 8 * GRPC_BYTES_PER_TOKEN + REQUEST_ALLOWANCE_BYTES


def test_the_limit_is_prompt_bytes_plus_the_allowance_within_the_front_cap() -> None:
    assert request_limit(8, GRPC_BYTES_PER_TOKEN, 8 << 20) == SHORT_LIMIT
    assert request_limit(1000, JSON_BYTES_PER_TOKEN, 8 << 20) == 24_000 + 256 * 1024
    assert request_limit(10**7, GRPC_BYTES_PER_TOKEN, 8 << 20) == 8 << 20


def _refusal(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_a_message_past_the_tenants_limit_is_refused_from_its_size(srv: Any) -> None:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    req = request("x" * (SHORT_LIMIT + 1), max_tokens=1)
    size = req.ByteSize()
    err = _refusal(lambda: list(stub.Generate(req, metadata=srv.auth("short"), timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(err) == ["request"]
    text = details(err)["BadRequest"].field_violations[0].description
    assert f"is {size} bytes" in text and f"the {SHORT_LIMIT} bytes" in text
    assert "8 prompt tokens" in text
    tok = inference_pb2.TokenizeRequest(text="x" * (SHORT_LIMIT + 1))
    err = _refusal(lambda: stub.Tokenize(tok, metadata=srv.auth("short"), timeout=30))
    assert violations(err) == ["request"]
    # The whole context's tenant: within its bound, refused by the text's own limit.
    err = _refusal(lambda: list(stub.Generate(req, metadata=srv.auth("globex"), timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(err) == ["text"]


def test_a_message_within_the_limit_is_served(srv: Any) -> None:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    out = list(stub.Generate(request("Hi", max_tokens=1), metadata=srv.auth("short"), timeout=30))
    assert out[-1].WhichOneof("event") == "finished"


def test_logit_bias_is_counted_before_its_entries_are_read(srv: Any) -> None:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    req = request("Hi", max_tokens=1)
    # Past the count, and every entry out of range: only the count is reported.
    req.sampling.logit_bias.update({10**9 + i: 500.0 for i in range(MAX_LOGIT_BIAS + 1)})
    err = _refusal(lambda: list(stub.Generate(req, metadata=srv.auth("globex"), timeout=30)))
    assert violations(err) == ["sampling.logit_bias"]
    text = details(err)["BadRequest"].field_violations[0].description
    assert text == f"at most {MAX_LOGIT_BIAS} entries"
