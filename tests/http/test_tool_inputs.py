"""Tool inputs through a real server, on both fronts: every tool field counts toward the chat's
size before anything is tokenized, tool JSON nested past the limit and text that is not
Unicode are refused by field, and Pydantic-generated schemas (``$defs``/``$ref``) are served
under every ``tool_choice`` (or, where a schema cannot be honoured, refused by name)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.serve.kvfence_server import ServerOptions
from tests.http.conftest import base_url
from tests.serverutil import TEST_SIZING, ServerHandle, TenantSpec, running_server
from tests.service.rpc import details

MAX_MODEL_LEN = 1024  # the tiny model's context
CHAT_BYTES = (MAX_MODEL_LEN - 1) * 8  # the prompt-token limit at 8 bytes a token


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")  # closed objects: the call ends in max_tokens
    city: str = Field(max_length=3)
    country: str = Field(max_length=3)


class Person(BaseModel):
    """A nested model: Pydantic puts ``Address`` in ``$defs`` and refers to it by ``$ref``."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=3)
    address: Address


class Node(BaseModel):
    """A self-referencing model: the root itself is a ``$ref`` into ``$defs``."""

    model_config = ConfigDict(extra="forbid")
    label: str = Field(max_length=3)
    child: Node | None = None


ASK = [{"role": "user", "content": "Who lives in Paris?"}]


@pytest.fixture(scope="module")
def srv(tiny_model: Any) -> Iterator[ServerHandle]:
    sizing = replace(TEST_SIZING, kv_memory="64MiB", max_model_len=MAX_MODEL_LEN)
    with running_server(tiny_model, {"acme": TenantSpec(max_concurrent_streams=8)},
                        sizing=sizing, options=ServerOptions(http_port=0)) as handle:
        yield handle


def _post(srv: ServerHandle, body: dict[str, Any] | bytes,
          path: str = "/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base_url(srv) + path, content=content, timeout=300, headers={
        "Authorization": f"Bearer {srv.keys['acme']}", "Content-Type": "application/json"})


def _tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _refused(r: httpx.Response, param: str, reason: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert reason in error["message"], error


def _grpc_refused(srv: ServerHandle, req: inference_pb2.GenerateRequest) -> tuple[str, str]:
    """(field, description) of the one violation a refused Generate carries."""
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, metadata=srv.auth("acme")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    [violation] = details(err.value)["BadRequest"].field_violations
    return violation.field, violation.description


def _grpc_chat(*messages: inference_pb2.ChatMessage, tools: Any = (),
               mode: Any = inference_pb2.ToolChoice.MODE_AUTO) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(
            messages=[inference_pb2.ChatMessage(role="user", content="hi"), *messages],
            tools=list(tools), tool_choice=inference_pb2.ToolChoice(mode=mode)),
        sampling=inference_pb2.SamplingParams(temperature=0.0),
        stopping=inference_pb2.StoppingParams(max_tokens=120),
    )


def _pydantic_tools() -> list[tuple[str, type[BaseModel], dict[str, Any]]]:
    import openai

    return [
        ("person", Person, _tool("person", Person.model_json_schema())),
        ("node", Node, _tool("node", Node.model_json_schema())),
        ("person_sdk", Person, dict(openai.pydantic_function_tool(Person, name="person_sdk"))),
    ]


@pytest.mark.parametrize("choice", ["auto", "required", "named", "none"])
def test_pydantic_schemas_with_defs_are_served_under_every_tool_choice(
    srv: ServerHandle, choice: str
) -> None:
    for name, model, tool in _pydantic_tools():
        assert "$defs" in json.dumps(tool)
        tool_choice: Any = {"type": "function", "function": {"name": name}} if choice == "named" \
            else choice
        r = _post(srv, {"messages": ASK, "tools": [tool], "tool_choice": tool_choice,
                        "max_tokens": 120, "temperature": 0, "parallel_tool_calls": False})
        assert r.status_code == 200, (name, r.text)
        message = r.json()["choices"][0]["message"]
        if choice in ("required", "named"):
            [call] = message["tool_calls"]
            assert call["function"]["name"] == name
            model.model_validate_json(call["function"]["arguments"])
        elif choice == "none":
            assert not message.get("tool_calls")


def test_grpc_serves_a_pydantic_schema_under_a_required_choice(srv: ServerHandle) -> None:
    tool = inference_pb2.Tool(name="person", parameters=json.dumps(Person.model_json_schema()))
    req = _grpc_chat(tools=[tool], mode=inference_pb2.ToolChoice.MODE_REQUIRED)
    req.chat.parallel_tool_calls = False
    out = list(inference_pb2_grpc.InferenceStub(srv.channel()).Generate(
        req, metadata=srv.auth("acme")))
    [call] = next(m for m in out if m.HasField("tool_calls")).tool_calls.calls
    assert call.name == "person"
    Person.model_validate_json(call.arguments)


def test_a_recursive_root_ref_is_refused_by_name_where_a_call_is_required(
    srv: ServerHandle,
) -> None:
    """``{"$ref": "#"}`` can be no object the call needs; a constrained choice refuses it
    naming the schema, never answering without a call. Under auto it is only rendered."""
    tools = [_tool("ok", {"type": "object"}), _tool("loop", {"$ref": "#"})]
    for choice in ("required", {"type": "function", "function": {"name": "loop"}}):
        r = _post(srv, {"messages": ASK, "tools": tools, "tool_choice": choice, "max_tokens": 30})
        _refused(r, "tools[1].function.parameters", "failed to compile JSON schema")
    r = _post(srv, {"messages": ASK, "tools": tools, "tool_choice": "auto", "max_tokens": 4})
    assert r.status_code == 200, r.text
    grpc_tools = [inference_pb2.Tool(name="loop", parameters='{"$ref": "#"}')]
    field, reason = _grpc_refused(srv, _grpc_chat(
        tools=grpc_tools, mode=inference_pb2.ToolChoice.MODE_REQUIRED))
    assert field == "chat.tools[0].parameters" and "failed to compile" in reason


def test_a_schema_that_allows_no_object_is_refused(srv: ServerHandle) -> None:
    r = _post(srv, {"messages": ASK, "tools": [_tool("f", {"type": "string"})],
                    "tool_choice": "required", "max_tokens": 4})
    _refused(r, "tools[0].function.parameters", "must describe a JSON object")


def _call_message(arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


@pytest.mark.parametrize("where", ["arguments", "parameters", "description", "result"])
def test_every_tool_field_counts_toward_the_chat_size_before_tokenizing(
    srv: ServerHandle, where: str
) -> None:
    """Just over the limit in one tool field: refused by the byte check naming that field
    (a refusal after tokenizing would say "prompt has N tokens")."""
    big = "x " * (CHAT_BYTES // 2 + 50)
    messages: list[Any] = list(ASK)
    tool: dict[str, Any] = {"type": "function", "function": {"name": "f"}}
    if where == "arguments":
        messages.append(_call_message(json.dumps({"a": big})))
        param = "messages[1].tool_calls[0].function.arguments"
    elif where == "result":
        messages += [_call_message("{}"), {"role": "tool", "tool_call_id": "call_1",
                                           "content": big}]
        param = "messages[2].content"
    elif where == "parameters":
        tool["function"]["parameters"] = {"type": "object", "description": big}
        param = "tools[0].function.parameters"
    else:
        tool["function"]["description"] = big
        param = "tools[0].function.description"
    r = _post(srv, {"messages": messages, "tools": [tool], "max_tokens": 4})
    _refused(r, param, f"chat is longer than {CHAT_BYTES} bytes")


def test_grpc_refuses_oversized_call_arguments_before_tokenizing(srv: ServerHandle) -> None:
    """200 KB: within what the front lets a message carry beyond its prompt (tool schemas,
    grammars), so only the chat's own byte check can refuse it before tokenizing."""
    arguments = json.dumps({"a": "x " * 100_000})
    call = inference_pb2.ToolCall(id="call_1", name="f", arguments=arguments)
    field, reason = _grpc_refused(srv, _grpc_chat(
        inference_pb2.ChatMessage(role="assistant", tool_calls=[call])))
    assert field == "chat.messages[1].tool_calls[0].arguments"
    assert reason == f"chat is longer than {CHAT_BYTES} bytes"
    tool = inference_pb2.Tool(name="f", parameters=json.dumps({"description": "x" * 60_000}))
    field, reason = _grpc_refused(srv, _grpc_chat(tools=[tool]))
    assert (field, reason) == ("chat.tools[0].parameters", f"chat is longer than {CHAT_BYTES} bytes")


@pytest.mark.parametrize("where", ["parameters", "arguments"])
def test_grpc_tool_json_nested_past_the_limit_is_refused_by_field(
    srv: ServerHandle, where: str
) -> None:
    """Deeper than Python's JSON reader goes (a RecursionError), within the size limit."""
    deep = "[" * 3000 + "]" * 3000
    if where == "parameters":
        req = _grpc_chat(tools=[inference_pb2.Tool(
            name="f", parameters='{"type": "object", "default": ' + deep + "}")])
        expected = "chat.tools[0].parameters"
    else:
        call = inference_pb2.ToolCall(id="c", name="f", arguments='{"a": ' + deep + "}")
        req = _grpc_chat(inference_pb2.ChatMessage(role="assistant", tool_calls=[call]))
        expected = "chat.messages[1].tool_calls[0].arguments"
    field, reason = _grpc_refused(srv, req)
    assert field == expected and reason.endswith("nests deeper than 200 levels")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', "prompt"),
        ("/completions", b'{"prompt": "a", "stop": ["x", "\\udfff"], "max_tokens": 2}',
         "stop[1]"),
        ("/chat/completions",
         b'{"messages": [{"role": "user", "content": "\\uDBFF!"}], "max_tokens": 2}',
         "messages[0].content"),
        ("/chat/completions",
         b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}],'
         b' "max_tokens": 2}', "messages[0].content[0].text"),
        # Inside a client's own JSON the path stops at the field: no property names echoed.
        ("/chat/completions",
         b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{"type":'
         b' "function", "function": {"name": "f", "parameters": {"properties": {"secret": '
         b'{"description": "\\ud800"}}}}}]}', "tools[0].function.parameters"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(
    srv: ServerHandle, path: str, body: bytes, param: str
) -> None:
    _refused(_post(srv, body, path), param, "lone surrogate")


def test_a_lone_surrogate_escaped_inside_tool_json_text_is_refused(srv: ServerHandle) -> None:
    """Call arguments arrive as JSON text: a ``\\ud800`` escape inside it is no surrogate in
    the body, only once the text is read; HTTP and gRPC refuse it by field."""
    arguments = '{"a": "\\ud800"}'
    r = _post(srv, {"messages": [*ASK, _call_message(arguments)], "max_tokens": 2})
    _refused(r, "messages[1].tool_calls[0].function.arguments", "lone surrogate")
    call = inference_pb2.ToolCall(id="c", name="f", arguments=arguments)
    field, reason = _grpc_refused(srv, _grpc_chat(
        inference_pb2.ChatMessage(role="assistant", tool_calls=[call])))
    assert field == "chat.messages[1].tool_calls[0].arguments" and "lone surrogate" in reason
    tool = inference_pb2.Tool(name="f", parameters='{"description": "\\udfff"}')
    field, reason = _grpc_refused(srv, _grpc_chat(tools=[tool]))
    assert field == "chat.tools[0].parameters" and "lone surrogate" in reason


def test_grpc_text_that_is_not_utf8_is_refused(srv: ServerHandle) -> None:
    """A protobuf string must be UTF-8: bytes that are not (a lone surrogate's encoding)
    do not parse, and the request is INVALID_ARGUMENT."""
    good = _grpc_chat().SerializeToString()
    bad = good.replace(b"hi", b"\xed\xa0")  # U+D800 as (invalid) UTF-8, same length
    assert bad != good
    call = srv.channel().unary_stream("/kvfence.v1.Inference/Generate",
                                      request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        list(call(bad, metadata=srv.auth("acme")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
