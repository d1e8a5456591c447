"""The schema a constrained tool call compiles with (``service.structured.tool_schema``): objects are
closed unless the schema allows extra keys, and allowed extras are counted, so the call's
grammar always reaches its closing brace. Checked on the schema and on the compiled grammar
walked byte by byte."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from protos.kvfence.v1 import inference_pb2
from service.structured import tools
from service.structured.grammar import GrammarCompiler, GrammarLimits, GrammarMatcher, Vocabulary
from service.structured.tool_schema import MAX_EXTRA_PROPERTIES, MAX_STRING_CHARS, closed
from service.structured.tools import ToolPlan

EOS = 256


class Address(BaseModel):
    city: str


class Person(BaseModel):
    """As Pydantic emits it by default: objects that say nothing of extra keys."""

    name: str
    address: Address
    nickname: str | None = None


def test_objects_without_additional_properties_are_closed_and_refs_left_as_written() -> None:
    schema = Person.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    before = json.dumps(schema)
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["name"]["maxLength"] == MAX_STRING_CHARS
    assert out["properties"]["nickname"]["anyOf"][0] == {"type": "string",
                                                          "maxLength": MAX_STRING_CHARS}
    assert out["$defs"]["Address"]["additionalProperties"] is False
    assert out["properties"]["address"] == {"$ref": "#/$defs/Address"}
    assert json.dumps(schema) == before  # the client's schema is not changed
    composed = {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}]}
    assert closed(composed) == {"type": "object", "allOf": [
        {"properties": {"a": {"type": "integer"}}, "additionalProperties": False}]}


def test_explicit_extras_are_counted_or_left_out_where_keys_cannot_be_counted() -> None:
    assert closed({"type": "object", "additionalProperties": {"type": "integer"}}) == {
        "type": "object", "additionalProperties": {"type": "integer"},
        "maxProperties": MAX_EXTRA_PROPERTIES}
    required = {"type": "object", "properties": {"a": {}}, "required": ["a"],
                "additionalProperties": True}
    assert closed(required)["maxProperties"] == 1 + MAX_EXTRA_PROPERTIES
    assert closed({**required, "maxProperties": 2})["maxProperties"] == 2  # never raised
    optional = {"type": "object", "properties": {"a": {}}, "additionalProperties": True,
                "patternProperties": {"^x": {}}}
    assert closed(optional) == {"type": "object", "properties": {"a": {}},
                                "additionalProperties": False}
    assert closed({"type": "object", "additionalProperties": False}) == {
        "type": "object", "additionalProperties": False}


def _compiler() -> GrammarCompiler:
    vocab = Vocabulary(
        token_bytes=[bytes([i]) for i in range(256)] + [b"<eos>"], eos_token_ids=(EOS,),
        bos_token_id=None, special_token_ids=(EOS,),
        encode=lambda text: list(text.encode("utf-8")))
    return GrammarCompiler(vocab, GrammarLimits())


def _call_matcher(parameters: dict[str, Any]) -> GrammarMatcher:
    chat = inference_pb2.ChatMessages(
        messages=[inference_pb2.ChatMessage(role="user", content="hi")],
        tools=[inference_pb2.Tool(name="f", parameters=json.dumps(parameters))],
        tool_choice=inference_pb2.ToolChoice(mode=inference_pb2.ToolChoice.MODE_REQUIRED))
    plan = ToolPlan("hermes", frozenset({"f"}), False, True)
    return _compiler().compile("t", tools.grammar(chat, plan)).matcher()


def _feed(m: GrammarMatcher, text: str) -> bool:
    return all(m.accept(b) for b in text.encode())


@pytest.mark.parametrize("extra", [True, False])
def test_the_call_grammar_refuses_an_undeclared_key_and_closes(extra: bool) -> None:
    m = _call_matcher({"type": "object", "properties": {"a": {"type": "boolean"}}})
    assert _feed(m, '<tool_call>\n{"name": "f", "arguments": {"a":true')
    if extra:
        assert not m.accept(ord(","))  # a second key: the schema declares none
    else:
        assert _feed(m, '}}\n</tool_call>') and m.finished


def test_the_call_grammar_stops_allowed_extra_keys_at_the_bound() -> None:
    schema = {"type": "object", "additionalProperties": {"type": "integer"}}
    pairs = ",".join(f'"k{i}":{i}' for i in range(MAX_EXTRA_PROPERTIES))
    head = '<tool_call>\n{"name": "f", "arguments": {' + pairs
    more, done = _call_matcher(schema), _call_matcher(schema)
    assert _feed(more, head) and not more.accept(ord(","))
    assert _feed(done, head + '}}\n</tool_call>') and done.finished


def test_strings_are_bounded_unless_the_schema_bounds_them() -> None:
    assert closed({"type": "string"}) == {"type": "string", "maxLength": MAX_STRING_CHARS}
    assert closed({"type": "string", "maxLength": 3}) == {"type": "string", "maxLength": 3}
    long = {"type": "string", "minLength": MAX_STRING_CHARS + 5}
    assert closed(long)["maxLength"] == MAX_STRING_CHARS + 5
    m = _call_matcher({"type": "object", "properties": {"s": {"type": "string"}},
                       "required": ["s"]})
    assert _feed(m, '<tool_call>\n{"name": "f", "arguments": {"s":"' + "a" * MAX_STRING_CHARS)
    assert not m.accept(ord("a"))
