"""Tool-call parsing per format, as text streams in pieces, and the generic rendering."""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import count

import pytest

from protos.kvfence.v1 import inference_pb2
from service.engine.types import Delta, Finished
from service.model.chat_template import tool_format_of
from service.structured import tools
from service.structured.tool_calls import CallsMade, ParsedCall, ToolCallStream, ToolSplitter
from service.structured.tools import ToolPlan

NAMES = frozenset({"get_weather", "get_time"})


def ids() -> object:
    n = count()
    return lambda: f"call_{next(n)}"


def run(plan: ToolPlan, text: str, piece: int) -> tuple[str, list[ParsedCall]]:
    """Feed ``text`` in pieces of ``piece`` characters, then close."""
    stream = ToolCallStream(plan, ids())  # type: ignore[arg-type]
    content, calls = [], []
    for i in range(0, len(text), piece):
        c, k = stream.feed(text[i : i + piece])
        content.append(c)
        calls += k
    c, k = stream.close()
    return "".join(content) + c, calls + k


HERMES = ToolPlan("hermes", NAMES, True, False)


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_hermes_blocks_become_calls_and_the_rest_stays_content(piece: int) -> None:
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}'
            "</tool_call> done <tool")
    content, calls = run(HERMES, text, piece)
    assert content == "Sure.\n done <tool"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_0", "get_weather", {"city": "Paris"}), ("call_1", "get_time", {"tz": "CET"})]


def test_a_block_that_is_not_a_call_of_an_offered_tool_stays_content() -> None:
    for block in ('{"name": "rm_rf", "arguments": {}}', "not json", '{"name": "get_time", '
                  '"arguments": [1]}'):
        text = f"a<tool_call>{block}</tool_call>b"
        assert run(HERMES, text, 2) == (text, [])


def test_a_cut_off_block_stays_content() -> None:
    assert run(HERMES, 'x<tool_call>{"name": "get_', 4) == ('x<tool_call>{"name": "get_', [])


def test_without_parallel_calls_only_the_first_counts() -> None:
    plan = ToolPlan("hermes", NAMES, False, False)
    one = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = run(plan, one + "\n" + one, 5)
    assert len(calls) == 1 and content == ""


def test_only_a_free_single_call_turn_in_the_hermes_format_stops_at_the_call() -> None:
    assert ToolPlan("hermes", NAMES, False, False).stop_strings() == ("</tool_call>",)
    assert ToolPlan("hermes", NAMES, True, False).stop_strings() == ()  # parallel
    assert ToolPlan("hermes", NAMES, False, True).stop_strings() == ()  # the grammar ends it
    assert ToolPlan("llama3_json", NAMES, False, False).stop_strings() == ()


def _finished(reason: str) -> Finished:
    return Finished(reason=reason, prompt_tokens=3, completion_tokens=9,  # type: ignore[arg-type]
                    cached_tokens=0, queue_s=0.0, ttft_s=None, total_s=0.0)


def test_a_call_the_stop_string_ended_is_closed_and_made() -> None:
    """The engine trims the stop string: the block ends without its closing tag."""
    plan = ToolPlan("hermes", NAMES, False, False)
    splitter = ToolSplitter(plan, ids())  # type: ignore[arg-type]
    assert splitter.split(Delta((1,), 'ok <tool_call>\n{"name": "get_time", ')) == [
        Delta((1,), "ok ")]
    assert splitter.split(Delta((2,), '"arguments": {"tz": "UTC"}}\n')) == [Delta((2,), "")]
    done = _finished("stop")
    assert splitter.split(done) == [
        CallsMade((ParsedCall("call_0", "get_time", '{"tz": "UTC"}'),)), done]
    assert splitter.called
    # Cut off by max_tokens instead, the same text is no call: it stays content.
    cut = ToolSplitter(plan, ids())  # type: ignore[arg-type]
    cut.split(Delta((1,), '<tool_call>{"name": "get_time", "arguments": {}}'))
    length = _finished("length")
    assert cut.split(length) == [
        Delta((), '<tool_call>{"name": "get_time", "arguments": {}}'), length]
    assert not cut.called


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_llama3_json_output_is_calls(piece: int) -> None:
    plan = ToolPlan("llama3_json", NAMES, True, False)
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "parameters": {}}')
    content, calls = run(plan, text, piece)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert run(plan, "Hello {there}", piece) == ("Hello {there}", [])
    assert run(plan, '{"no": "call"}', piece) == ('{"no": "call"}', [])


def test_mistral_output_is_calls() -> None:
    plan = ToolPlan("mistral", NAMES, True, False)
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]'
    content, calls = run(plan, text, 3)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", '{"tz": "UTC"}')]
    assert run(plan, "[1, 2]", 3) == ("[1, 2]", [])


def test_the_template_decides_the_format() -> None:
    assert tool_format_of("{{ '<tool_call>' }}{{ tools }}") == "hermes"
    assert tool_format_of("{{ '<|python_tag|>' }}{{ tools }}") == "llama3_json"
    assert tool_format_of("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert tool_format_of("{{ messages }}") == "hermes"  # no tools: the generic rendering


def test_the_splitter_keeps_token_ids_and_moves_held_text_to_the_end() -> None:
    splitter = ToolSplitter(HERMES, ids())  # type: ignore[arg-type]
    out = splitter.split(Delta((1, 2), "hi <tool_"))
    assert out == [Delta((1, 2), "hi ")]
    out = splitter.split(Delta((3,), 'call>{"name": "get_time", "arguments": {}}</tool_call>'))
    assert out == [Delta((3,), ""), CallsMade((ParsedCall("call_0", "get_time", "{}"),))]
    done = Finished(reason="stop", prompt_tokens=3, completion_tokens=3, cached_tokens=0,
                    queue_s=0.0, ttft_s=None, total_s=0.0)
    assert splitter.split(done) == [done] and splitter.called
    assert ToolSplitter(None).split(Delta((1,), "<tool_call>")) == [Delta((1,), "<tool_call>")]


def _chat() -> inference_pb2.ChatMessages:
    chat = inference_pb2.ChatMessages()
    chat.messages.add(role="system", content="Be brief.")
    chat.messages.add(role="user", content="Weather?")
    asked = chat.messages.add(role="assistant", content="")
    asked.tool_calls.add(id="call_1", name="get_weather", arguments='{"city": "Rome"}')
    chat.messages.add(role="tool", content='{"t": 20}', tool_call_id="call_1")
    chat.messages.add(role="tool", content='{"t": 21}', tool_call_id="call_2")
    chat.tools.add(name="get_weather", description="Forecast", parameters='{"type": "object"}')
    return chat


def test_the_generic_rendering_spells_out_tools_calls_and_results() -> None:
    messages, tool_list = tools.template_messages(_chat(), native=False)
    assert tool_list is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou may call functions")
    assert '{"type":"function","function":{"name":"get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    assert messages[3]["content"] == (
        '<tool_response>\n{"t": 20}\n</tool_response>\n<tool_response>\n{"t": 21}\n</tool_response>')


def test_a_template_with_tools_gets_the_hugging_face_form() -> None:
    messages, tool_list = tools.template_messages(_chat(), native=True)
    assert tool_list == [{"type": "function", "function": {
        "name": "get_weather", "description": "Forecast", "parameters": {"type": "object"}}}]
    assert messages[2]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Rome"}}}]
    assert messages[3] == {"role": "tool", "content": '{"t": 20}', "tool_call_id": "call_1"}


def test_tool_choice_none_renders_no_tools_and_reads_no_calls() -> None:
    chat = _chat()
    chat.tool_choice.mode = inference_pb2.ToolChoice.MODE_NONE
    messages, _ = tools.template_messages(chat, native=False)
    assert messages[0]["content"] == "Be brief."
    assert tools.plan(chat, "hermes") is None


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c: setattr(c.tools[0], "name", "bad name"), "chat.tools[0].name"),
        (lambda c: setattr(c.tools[0], "parameters", "[1]"), "chat.tools[0].parameters"),
        (lambda c: c.tools.add(name="get_weather"), "chat.tools[1].name"),
        (lambda c: (setattr(c.tool_choice, "mode", inference_pb2.ToolChoice.MODE_FUNCTION),
                    setattr(c.tool_choice, "function", "nope")), "chat.tool_choice"),
        (lambda c: setattr(c.messages[2].tool_calls[0], "arguments", "[]"),
         "chat.messages[2].tool_calls[0].arguments"),
        (lambda c: c.messages[1].tool_calls.add(name="x"), "chat.messages[1].tool_calls"),
    ],
)
def test_bad_tools_are_refused_by_field(edit: object, field: str) -> None:
    chat = _chat()
    edit(chat)  # type: ignore[operator]
    out: list[tuple[str, str]] = []
    tools.check_tools(chat, "chat", out)
    assert [f for f, _ in out] == [field]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c, big: setattr(c.messages[2].tool_calls[0], "arguments", big),
         "chat.messages[2].tool_calls[0].arguments"),
        (lambda c, big: setattr(c.messages[2].tool_calls[0], "id", big),
         "chat.messages[2].tool_calls[0].id"),
        (lambda c, big: setattr(c.messages[3], "content", big), "chat.messages[3].content"),
        (lambda c, big: setattr(c.tools[0], "parameters", big), "chat.tools[0].parameters"),
        (lambda c, big: setattr(c.tools[0], "description", big), "chat.tools[0].description"),
    ],
)
def test_every_field_that_reaches_the_template_counts_toward_the_chat_size(
    edit: Callable[[inference_pb2.ChatMessages, str], None], field: str
) -> None:
    """The field where the running total passes the limit is named; 7 MB of it is refused
    without being encoded or parsed (the limit is met on characters first)."""
    chat = _chat()
    edit(chat, "x" * 7_000_000)
    out: list[tuple[str, str]] = []
    tools.check_size(chat, "chat", 8184, out)
    assert out == [(field, "chat is longer than 8184 bytes")]
    fits: list[tuple[str, str]] = []
    tools.check_size(_chat(), "chat", 8184, fits)
    assert fits == []


def test_multibyte_text_is_counted_in_bytes_and_each_history_call_with_its_markup() -> None:
    chat = _chat()
    limit = tools.chat_bytes(chat)
    out: list[tuple[str, str]] = []
    tools.check_size(chat, "chat", limit, out)
    assert out == []
    chat.tools[0].description = "Forecast\u00e9"  # one more character, two more bytes
    tools.check_size(chat, "chat", limit + 1, out)
    # Passed on the last field counted (the schema), by bytes: in characters it fits.
    assert out == [("chat.tools[0].parameters", f"chat is longer than {limit + 1} bytes")]
    empty = inference_pb2.ChatMessages()
    msg = empty.messages.add(role="assistant")
    for _ in range(tools.MAX_HISTORY_CALLS + 1):
        msg.tool_calls.add()
    refused: list[tuple[str, str]] = []
    tools.check_size(empty, "chat", 1 << 30, refused)
    assert [f for f, _ in refused] == ["chat.messages"]
    assert tools.chat_bytes(_chat()) > sum(len(t.encode()) for _, t in tools.text_fields(_chat(), ""))


@pytest.mark.parametrize("depth", [3_000, 30_000])
def test_tool_json_nested_past_the_limit_is_refused_by_field(depth: int) -> None:
    """Deeper than Python's JSON reader goes: a violation, never a RecursionError."""
    deep = "[" * depth + "]" * depth
    chat = _chat()
    chat.tools[0].parameters = '{"type": "object", "default": ' + deep + "}"
    chat.messages[2].tool_calls[0].arguments = '{"a": ' + deep + "}"
    out: list[tuple[str, str]] = []
    tools.check_tools(chat, "chat", out)
    assert out == [
        ("chat.tools[0].parameters", "must be a JSON Schema object: it nests deeper than 200 levels"),
        ("chat.messages[2].tool_calls[0].arguments",
         "must be a JSON object: it nests deeper than 200 levels"),
    ]


def test_a_schema_must_allow_an_object_and_hold_only_unicode_text() -> None:
    for parameters, ok in (('{"type": "string"}', False), ('{"type": ["null", "object"]}', True),
                           ('{"$ref": "#"}', True), ('{"description": "\\ud800"}', False)):
        chat = _chat()
        chat.tools[0].parameters = parameters
        out: list[tuple[str, str]] = []
        tools.check_tools(chat, "chat", out)
        assert (out == []) == ok, (parameters, out)


def test_each_tool_schema_is_its_own_root_and_its_line_names_it() -> None:
    """``$defs`` stay resolvable (the schema is not embedded in a wrapper); the root is held
    to objects; a compile error's line maps to the tool's ``parameters``."""
    chat = _chat()
    person = {"$defs": {"A": {"type": "object"}}, "properties": {"a": {"$ref": "#/$defs/A"}}}
    chat.tools.add(name="other", parameters='{"type": "object"}')
    chat.tools.add(name="person", parameters=json.dumps(person))
    plan = ToolPlan("hermes", frozenset({"person", "get_weather"}), False, True)
    spec = tools.grammar(chat, plan)
    lines = spec.source.splitlines()
    assert spec.line_fields == ((4, "chat.tools[0].parameters"), (5, "chat.tools[2].parameters"))
    assert lines[2] == ('body: "{\\"name\\": \\"get_weather\\", \\"arguments\\": " args0 "}" | '
                        '"{\\"name\\": \\"person\\", \\"arguments\\": " args1 "}"')
    schema = json.loads(lines[4].removeprefix("args1: %json "))
    closed_person = {"$defs": {"A": {"type": "object", "additionalProperties": False}},
                     "properties": {"a": {"$ref": "#/$defs/A"}}, "additionalProperties": False}
    assert schema == {**closed_person, "type": "object",
                      "x-guidance": {"whitespace_flexible": False}}
