"""Tool calling with the official ``openai`` SDK against a real server, and the same on
gRPC. Each test runs against the tiny random-weight Llama with a ChatML template that has no
tools (the generic rendering; a random model is the hard case for the constrained choices:
nothing but the grammar makes its calls valid) and, in the slow tier, against the default
SmolLM2 model (whose template has no tools either)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import jsonschema
import pytest

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.engine.types import Request
from service.serve.kvfence_server import ServerOptions
from tests.http.conftest import base_url
from tests.serverutil import TEST_SIZING, ServerHandle, TenantSpec, running_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 40}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "The weather forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module", params=["tiny", pytest.param("default", marks=pytest.mark.slow)])
def srv(request: pytest.FixtureRequest) -> Iterator[ServerHandle]:
    """Each test against the tiny random model, and (slow tier) the default SmolLM2 as
    ``kvfence serve`` loads it."""
    model = request.getfixturevalue("tiny_model" if request.param == "tiny" else "served_model")
    # The generic preamble is ~1,000 bytes: several hundred tokens of the tiny vocabulary.
    kv = "64MiB" if request.param == "tiny" else "512MiB"
    sizing = replace(TEST_SIZING, kv_memory=kv, max_model_len=2048)
    with running_server(model, {"acme": TenantSpec(max_concurrent_streams=32)},
                        sizing=sizing, options=ServerOptions(http_port=0)) as handle:
        yield handle


def client(srv: ServerHandle) -> Any:
    import openai

    return openai.OpenAI(base_url=base_url(srv), api_key=srv.keys["acme"], max_retries=0,
                         timeout=900)  # the default model, n=6 x 220 tokens, on 2 busy cores


def _model(srv: ServerHandle) -> str:
    return str(srv.stack.model.name)


def test_required_arguments_validate_against_the_schema_20_of_20(srv: ServerHandle) -> None:
    choices = [
        ch
        for seed in (11, 12)  # n is at most 16: two requests of 10 sampled sequences
        for ch in client(srv).chat.completions.create(
            model=_model(srv), messages=ASK, tools=TOOLS, tool_choice="required", n=10,
            seed=seed, max_tokens=220, temperature=1.0,
        ).choices
    ]
    assert len(choices) == 20
    valid = 0
    for choice in choices:
        # Up to MAX_PARALLEL_CALLS calls; a random model's third call may meet max_tokens,
        # and then only the calls it completed are calls.
        assert choice.finish_reason in ("tool_calls", "length"), choice
        calls = choice.message.tool_calls
        assert calls
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        valid += 1
    assert valid == 20
    ids = [c.id for ch in choices for c in ch.message.tool_calls]
    assert len(set(ids)) == len(ids)


def test_a_named_function_is_the_one_called_once(srv: ServerHandle) -> None:
    r = client(srv).chat.completions.create(
        model=_model(srv), messages=ASK, tools=TOOLS, n=4, seed=3, max_tokens=220,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    for choice in r.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_parallel_tool_calls_false_yields_at_most_one_call(srv: ServerHandle) -> None:
    for choice_kind in ("required", "auto"):
        r = client(srv).chat.completions.create(
            model=_model(srv), messages=ASK, tools=TOOLS, tool_choice=choice_kind, n=6, seed=5,
            max_tokens=220, parallel_tool_calls=False,
        )
        for choice in r.choices:
            assert len(choice.message.tool_calls or []) <= 1


def test_auto_without_parallel_calls_ends_generation_at_the_first_call(
    srv: ServerHandle, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine is asked to stop at the first call's closing tag (so no token is spent
    past it) only when one free-text call may count; the request's own stops stay first."""
    sent: list[Request] = []
    submit = srv.engine.submit

    def spy(request: Request) -> Any:
        sent.append(request)
        return submit(request)

    monkeypatch.setattr(srv.engine, "submit", spy)
    c = client(srv)
    for parallel, choice_kind in ((False, "auto"), (True, "auto"), (False, "required")):
        sent.clear()
        c.chat.completions.create(
            model=_model(srv), messages=ASK, tools=TOOLS, tool_choice=choice_kind, seed=3,
            max_tokens=8, parallel_tool_calls=parallel, stop=["END"],
        )
        [request] = sent
        tail = ("</tool_call>",) if (parallel, choice_kind) == (False, "auto") else ()
        assert request.stopping.stop == ("END", *tail), (parallel, choice_kind)
    sent.clear()
    list(inference_pb2_grpc.InferenceStub(srv.channel()).Generate(
        _grpc_request(inference_pb2.ToolChoice.MODE_AUTO, max_tokens=8),
        metadata=srv.auth("acme")))
    assert sent[0].stopping.stop == ("</tool_call>",)


def test_the_follow_up_turn_with_the_tool_result_completes(srv: ServerHandle) -> None:
    c = client(srv)
    first = c.chat.completions.create(
        model=_model(srv), messages=ASK, tools=TOOLS, tool_choice="required", seed=1,
        max_tokens=220, parallel_tool_calls=False,
    )
    message = first.choices[0].message
    [call] = message.tool_calls
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id,
                "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = c.chat.completions.create(
        model=_model(srv), messages=history, tools=TOOLS, tool_choice="none", max_tokens=24,
        temperature=0, extra_body={"ignore_eos": True},
    )
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content and not choice.message.tool_calls
    # The raw SDK object (with its null fields) is accepted as history too.
    third = c.chat.completions.create(
        model=_model(srv), messages=[*ASK, message, history[-1]], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert third.choices[0].message.content is not None


def test_streamed_tool_call_deltas_reassemble_into_the_same_call(srv: ServerHandle) -> None:
    kwargs: dict[str, Any] = dict(model=_model(srv), messages=ASK, tools=TOOLS, seed=9,
                                  tool_choice="required", max_tokens=220, temperature=0.7)
    whole = client(srv).chat.completions.create(**kwargs)
    chunks = list(client(srv).chat.completions.create(**kwargs, stream=True))
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += d.id or ""
            if d.function is not None:
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    expected = whole.choices[0].message.tool_calls
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in expected
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "<tool_call>" not in "".join(ch.choices[0].delta.content or "" for ch in chunks)


def _grpc_request(mode: Any, max_tokens: int) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(
            messages=[inference_pb2.ChatMessage(role="user", content=ASK[0]["content"])],
            tools=[inference_pb2.Tool(name="get_weather", description="The weather",
                                      parameters=json.dumps(WEATHER))],
            tool_choice=inference_pb2.ToolChoice(mode=mode),
            parallel_tool_calls=False,
        ),
        sampling=inference_pb2.SamplingParams(temperature=0.0),
        stopping=inference_pb2.StoppingParams(max_tokens=max_tokens),
    )


def test_grpc_gets_the_same_calls_as_an_event(srv: ServerHandle) -> None:
    req = _grpc_request(inference_pb2.ToolChoice.MODE_REQUIRED, max_tokens=220)
    out = list(inference_pb2_grpc.InferenceStub(srv.channel()).Generate(
        req, metadata=srv.auth("acme")))
    events = [m.WhichOneof("event") for m in out]
    assert events.count("tool_calls") == 1 and events[-1] == "finished"
    [call] = next(m for m in out if m.HasField("tool_calls")).tool_calls.calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert out[-1].finished.reason == inference_pb2.FINISH_REASON_TOOL_CALLS
    assert "<tool_call>" not in "".join(m.chunk.text for m in out if m.HasField("chunk"))
