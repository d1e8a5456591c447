"""Structured outputs through the HTTP front (``openai`` SDK) and gRPC, on the tiny random
model: whatever the weights, the constraint makes the output match."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from tests.http.conftest import client
from tests.serverutil import ServerHandle

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def _model(srv: ServerHandle) -> str:
    return str(srv.stack.model.name)


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_chat_output_validates(srv: ServerHandle, seed: int) -> None:
    r = client(srv).chat.completions.create(
        model=_model(srv), messages=MESSAGES, max_tokens=200, temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_json_schema_streamed_completion_validates_and_free_rows_share_steps(
    srv: ServerHandle,
) -> None:
    stream = client(srv).completions.create(
        model=_model(srv), prompt="JSON:", max_tokens=200, n=2, seed=3, stream=True,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": SCHEMA}}},
    )
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_and_grammar(srv: ServerHandle) -> None:
    c = client(srv)
    obj = c.chat.completions.create(
        model=_model(srv), messages=MESSAGES, max_tokens=60, seed=1,
        response_format={"type": "json_object"},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:  # unbounded object: cut by max_tokens, but it starts as one
        assert (obj.choices[0].message.content or "").startswith("{")
    rx = c.completions.create(
        model=_model(srv), prompt="Date:", max_tokens=20, seed=2,
        extra_body={"response_format": {"type": "regex", "regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"}},
    )
    assert rx.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", rx.choices[0].text)
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,3}/'
    g = c.completions.create(
        model=_model(srv), prompt="Answer:", max_tokens=20, seed=4,
        extra_body={"response_format": {"type": "grammar", "grammar": lark}},
    )
    assert re.fullmatch(r"yes|no|maybe [0-9]{1,3}", g.choices[0].text)


def test_unconstrained_tiny_model_output_is_not_json(srv: ServerHandle) -> None:
    """The guard the tests above rely on: without the mask the random model emits junk."""
    r = client(srv).chat.completions.create(
        model=_model(srv), messages=MESSAGES, max_tokens=40, seed=0, extra_body={"ignore_eos": True}
    )
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content or "")


@pytest.mark.parametrize(
    ("fmt", "reason"),
    [
        ({"type": "regex", "regex": "a(b"}, "regex"),
        ({"type": "grammar", "grammar": "start: undefined_rule"}, "undefined_rule"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}, "wat"),
        ({"type": "regex", "regex": "a" * 70_000}, "limit"),
    ],
)
def test_bad_grammars_are_400_with_the_reason(srv: ServerHandle, fmt: dict, reason: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(srv).completions.create(model=_model(srv), prompt="x", max_tokens=4,
                                       extra_body={"response_format": fmt})
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "response_format"
    assert reason in body["message"], body["message"]


def test_grpc_response_format(srv: ServerHandle) -> None:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    req = inference_pb2.GenerateRequest(
        text="JSON:",
        stopping=inference_pb2.StoppingParams(max_tokens=200),
        sampling=inference_pb2.SamplingParams(seed=5),
        response_format=inference_pb2.ResponseFormat(json_schema=json.dumps(SCHEMA)),
    )
    out = list(stub.Generate(req, metadata=srv.auth("acme")))
    text = "".join(m.chunk.text for m in out if m.HasField("chunk"))
    assert out[-1].finished.reason == inference_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads(text), SCHEMA)
    bad = inference_pb2.GenerateRequest(
        text="x", response_format=inference_pb2.ResponseFormat(regex="(")
    )
    import grpc

    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(bad, metadata=srv.auth("acme")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in (err.value.details() or "")


def test_purge_drops_the_callers_compiled_grammars_only(srv: ServerHandle) -> None:
    """Purge forgets the tenant's compiled grammars too, so a purged schema compiles (and
    times) as new; another tenant's grammars stay."""
    from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc

    grammars = srv.stack.grammars
    assert grammars is not None
    fmt = {"type": "regex", "regex": "purge-[0-9]{3}"}
    for tenant in ("acme", "globex"):
        client(srv, tenant).completions.create(model=_model(srv), prompt="x", max_tokens=8,
                                               extra_body={"response_format": fmt})
    acme, globex = grammars.cached("acme"), grammars.cached("globex")
    assert acme >= 1 and globex >= 1
    cache = cache_pb2_grpc.CacheStub(srv.channel())
    cache.Purge(cache_pb2.PurgeRequest(), metadata=srv.auth("acme"))
    assert (grammars.cached("acme"), grammars.cached("globex")) == (0, globex)
