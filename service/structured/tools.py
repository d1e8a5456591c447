"""Tool calling at the service boundary, the same for both fronts: the checks on the wire's
``tools``/``tool_choice``/history, the conversation as the chat template receives it, and the
grammar that makes ``required`` and named choices produce valid calls.

Rendering: a template that uses the ``tools`` variable (Qwen, Llama 3.x, Mistral, Hermes...)
gets the tools and the history in the Hugging Face format (``tools`` as OpenAI function
objects, assistant ``tool_calls`` with parsed arguments, ``tool`` messages with
``tool_call_id``) and renders them in its family's own convention. A template without tools
(the default SmolLM2 model's) gets the generic rendering: the Hermes convention spelled out
in text, which ``tool_calls.py`` parses back:

- a system message (appended to the conversation's first system message, or put first)
  listing the tools as JSON inside ``<tools></tools>`` and asking for each call as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an assistant turn's calls as those same blocks after its text;
- each ``tool`` message as a user turn ``<tool_response>...</tool_response>`` (consecutive
  results in one turn).

In the generic rendering all of this is message content, so it is tokenized as plain text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from protos.kvfence.v1 import inference_pb2
from service.errors import Violations
from service.json_input import NOT_TEXT, JsonInputError, lone_surrogate
from service.json_input import load as load_json
from service.model.chat_template import ToolFormat
from service.structured.grammar import GrammarSpec
from service.structured.tool_schema import closed

MAX_TOOLS = 128
#: Calls one constrained turn may make with parallel calls on: the grammar ends the turn
#: after this many, so a model that keeps calling cannot run into max_tokens mid-call.
MAX_PARALLEL_CALLS = 3
MAX_TOOLS_BYTES = 64 * 1024
#: Tool calls a conversation's history may hold (each renders its markup into the prompt).
MAX_HISTORY_CALLS = 1024
#: Bytes each history call is counted for beyond its fields: the markup it renders as.
CALL_MARKUP_BYTES = 48
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # the Hermes convention's markup
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
Mode = inference_pb2.ToolChoice.Mode

GENERIC_PREAMBLE = (
    "You may call functions to answer. Their JSON signatures:\n<tools>\n{tools}\n</tools>\n"
    "For each call, answer with its name and arguments as JSON in <tool_call></tool_call> "
    "tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-object>}}\n"
    "</tool_call>"
)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's output is read for tool calls (None when it has no tools, or
    ``tool_choice`` is none)."""

    format: ToolFormat
    names: frozenset[str]
    parallel: bool  # False: at most one call
    constrained: bool  # required or a named function: the grammar forces the calls

    @property
    def stops_after_one_call(self) -> bool:
        """Generation ends at the first call's closing tag (``stop_strings``): the output
        is free text (``auto``) read in the Hermes format, and only one call may count, so
        tokens past that call would be thrown away. Constrained turns end in their grammar."""
        return self.format == "hermes" and not self.parallel and not self.constrained

    def stop_strings(self) -> tuple[str, ...]:
        """Stop strings the engine adds to the request's own (see ``stops_after_one_call``);
        the engine trims them, and ``tool_calls.ToolCallStream`` closes the call it ended."""
        return (CALL_CLOSE,) if self.stops_after_one_call else ()


def function_object(tool: inference_pb2.Tool) -> dict[str, Any]:
    """The OpenAI ``{"type": "function", "function": {...}}`` form of a tool."""
    fn: dict[str, Any] = {"name": tool.name}
    if tool.description:
        fn["description"] = tool.description
    fn["parameters"] = parameters(tool)
    return {"type": "function", "function": fn}


def parameters(tool: inference_pb2.Tool) -> dict[str, Any]:
    """The tool's JSON schema (checked by ``check_tools``); no parameters = no arguments."""
    if not tool.parameters:
        return {"type": "object", "properties": {}}
    value = json.loads(tool.parameters)
    assert isinstance(value, dict)
    return value


def text_fields(chat: inference_pb2.ChatMessages, field: str) -> Iterator[tuple[str, str]]:
    """(field path, text) of every string of a chat that reaches the chat template, and so
    the tokenizer: message content (tool results included), the history's calls (id, name,
    arguments) and the tools (name, description, schema)."""
    for i, msg in enumerate(chat.messages):
        where = f"{field}.messages[{i}]"
        yield f"{where}.content", msg.content
        yield f"{where}.tool_call_id", msg.tool_call_id
        for j, call in enumerate(msg.tool_calls):
            yield f"{where}.tool_calls[{j}].id", call.id
            yield f"{where}.tool_calls[{j}].name", call.name
            yield f"{where}.tool_calls[{j}].arguments", call.arguments
    for k, tool in enumerate(chat.tools):
        yield f"{field}.tools[{k}].name", tool.name
        yield f"{field}.tools[{k}].description", tool.description
        yield f"{field}.tools[{k}].parameters", tool.parameters


def check_size(chat: inference_pb2.ChatMessages, field: str, max_bytes: int, out: Violations) -> None:
    """The chat's text (``text_fields``, each history call with its markup) within
    ``max_bytes`` UTF-8 bytes, refused on the field where the running total passes it. No
    text is parsed, rendered or encoded past the limit: characters are counted first
    (a character is at least one byte), and only text within the limit is encoded."""
    calls = sum(len(msg.tool_calls) for msg in chat.messages)
    if calls > MAX_HISTORY_CALLS:
        out.append((f"{field}.messages", f"at most {MAX_HISTORY_CALLS} tool calls in the history"))
        return
    chars = size = calls * CALL_MARKUP_BYTES
    for where, text in text_fields(chat, field):
        chars += len(text)
        if chars <= max_bytes:
            size += len(text.encode("utf-8"))
        if chars > max_bytes or size > max_bytes:
            out.append((where, f"chat is longer than {max_bytes} bytes"))
            return


def chat_bytes(chat: inference_pb2.ChatMessages) -> int:
    """The UTF-8 bytes ``check_size`` counts for a chat that passed it."""
    calls = sum(len(msg.tool_calls) for msg in chat.messages)
    return calls * CALL_MARKUP_BYTES + sum(
        len(text.encode("utf-8")) for _, text in text_fields(chat, "")
    )


def check_tools(chat: inference_pb2.ChatMessages, field: str, out: Violations) -> None:
    """Tools, the choice and the history's calls: shapes that need no tokenizer. A schema
    or arguments text is read with ``json_input.load`` (nesting bounded, no recursion
    error) and holds only Unicode text; a schema must describe an object (the arguments
    are one)."""
    tools = chat.tools
    if len(tools) > MAX_TOOLS:
        out.append((f"{field}.tools", f"at most {MAX_TOOLS} tools"))
        return
    size = sum(len(t.description) + len(t.parameters) for t in tools)
    if size > MAX_TOOLS_BYTES:
        out.append((f"{field}.tools", f"tools are larger than {MAX_TOOLS_BYTES} bytes"))
        return
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{field}.tools[{i}]"
        if not _NAME.match(tool.name):
            out.append((f"{where}.name", "must match [A-Za-z0-9_-]{1,64}"))
        elif tool.name in names:
            out.append((f"{where}.name", f"duplicate tool name {tool.name!r}"))
        names.add(tool.name)
        if tool.parameters:
            reason = _schema_problem(tool.parameters)
            if reason is not None:
                out.append((f"{where}.parameters", reason))
    choice = chat.tool_choice
    if choice.mode == Mode.MODE_FUNCTION and choice.function not in names:
        out.append((f"{field}.tool_choice", f"names no tool in tools: {choice.function[:64]!r}"))
    elif choice.mode == Mode.MODE_REQUIRED and not tools:
        out.append((f"{field}.tool_choice", "required needs tools"))
    for i, msg in enumerate(chat.messages):
        where = f"{field}.messages[{i}]"
        if msg.tool_calls and msg.role != "assistant":
            out.append((f"{where}.tool_calls", "only assistant messages carry tool calls"))
        for j, call in enumerate(msg.tool_calls):
            if not call.name:
                out.append((f"{where}.tool_calls[{j}].name", "must not be empty"))
            reason = _object_problem(call.arguments or "{}")
            if reason is not None:
                out.append((f"{where}.tool_calls[{j}].arguments", reason))


def _object_problem(text: str) -> str | None:
    try:
        value = load_json(text)
    except JsonInputError as err:
        return f"must be a JSON object: it {err}"
    if not isinstance(value, dict):
        return "must be a JSON object"
    return _text_problem(value)


def _schema_problem(text: str) -> str | None:
    try:
        schema = load_json(text)
    except JsonInputError as err:
        return f"must be a JSON Schema object: it {err}"
    if not isinstance(schema, dict):
        return "must be a JSON Schema object"
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return 'must describe a JSON object (its "type" must allow "object"): arguments are one'
    return _text_problem(schema)


def _text_problem(value: dict[str, Any]) -> str | None:
    """JSON text may escape a lone surrogate (``"\\ud800"``), which the template and the
    tokenizer cannot encode."""
    return None if lone_surrogate(value) is None else NOT_TEXT


def plan(chat: inference_pb2.ChatMessages, fmt: ToolFormat) -> ToolPlan | None:
    mode = chat.tool_choice.mode
    if not chat.tools or mode == Mode.MODE_NONE:
        return None
    parallel = not chat.HasField("parallel_tool_calls") or chat.parallel_tool_calls
    if mode == Mode.MODE_FUNCTION:
        return ToolPlan(fmt, frozenset({chat.tool_choice.function}), False, True)
    names = frozenset(t.name for t in chat.tools)
    return ToolPlan(fmt, names, parallel, mode == Mode.MODE_REQUIRED)


#: Lines of a tool grammar before its per-tool rules (``grammar``).
_GRAMMAR_HEAD_LINES = 3


def grammar(
    chat: inference_pb2.ChatMessages, tool_plan: ToolPlan, field: str = "chat"
) -> GrammarSpec:
    """A Lark grammar whose every sentence is one call (or, with parallel calls, one or
    more) of the allowed tools, in the plan's format, with arguments valid against the
    tool's schema; the output ends after the last call.

    Each tool's schema is its own ``%json`` root, as the client wrote it but closed
    (``tool_schema.closed``: no key the schema does not allow, extra keys counted, so the
    call always ends): its local ``$ref``s (``#``, ``#/$defs/...``, what Pydantic generates)
    resolve against it, not against a wrapper. Its root is held to ``"type": "object"`` (the arguments must be an object);
    a schema that cannot be so constrained fails to compile, and the spec's ``line_fields``
    name that tool's ``parameters``, so the refusal names the schema."""
    key = "parameters" if tool_plan.format == "llama3_json" else "arguments"
    bodies: list[str] = []
    rules: list[str] = []
    line_fields: list[tuple[int, str]] = []
    for i, tool in enumerate(chat.tools):
        if tool.name not in tool_plan.names:
            continue
        n = len(rules)
        head = json.dumps(f'{{"name": {json.dumps(tool.name)}, "{key}": ')  # a Lark literal
        bodies.append(f'{head} args{n} "}}"')
        schema = {**closed(_object_root(parameters(tool))), "x-guidance": {"whitespace_flexible": False}}
        rules.append(f"args{n}: %json {json.dumps(schema)}")  # ASCII, on one line
        line_fields.append((_GRAMMAR_HEAD_LINES + n + 1, f"{field}.tools[{i}].parameters"))
    more = f"{{0,{MAX_PARALLEL_CALLS - 1}}}"

    def calls(sep: str) -> str:
        return f'call ("{sep}" call){more}' if tool_plan.parallel else "call"

    if tool_plan.format == "hermes":
        rule = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        start = f"start: {calls(chr(92) + 'n')}"
    elif tool_plan.format == "llama3_json":
        rule = "call: body"
        start = f"start: {calls('; ')}"
    else:
        rule = "call: body"
        start = f'start: "[TOOL_CALLS][" {calls(", ")} "]"'
    head_lines = [start, rule, "body: " + " | ".join(bodies)]
    assert len(head_lines) == _GRAMMAR_HEAD_LINES
    source = "\n".join([*head_lines, *rules]) + "\n"
    return GrammarSpec("lark", source, tuple(line_fields))


def _object_root(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its root held to objects (``check_tools`` refused a root type that
    allows none)."""
    return {**schema, "type": "object"}


def template_messages(
    chat: inference_pb2.ChatMessages, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: the Hugging Face form when the template
    renders tools itself, else the generic rendering (tools None)."""
    with_tools = bool(chat.tools) and chat.tool_choice.mode != Mode.MODE_NONE
    tools = [function_object(t) for t in chat.tools] if with_tools else []
    if native:
        return [_hf_message(m) for m in chat.messages], tools or None
    messages: list[dict[str, Any]] = []
    for m in chat.messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if messages and messages[-1].get("_tool_results"):
                messages[-1]["content"] += "\n" + block
            else:
                messages.append({"role": "user", "content": block, "_tool_results": True})
            continue
        content = m.content
        if m.tool_calls:
            blocks = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c.name, "arguments": _args(c.arguments)},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in m.tool_calls
            )
            content = f"{content}\n{blocks}" if content else blocks
        messages.append({"role": m.role, "content": content})
    for turn in messages:
        turn.pop("_tool_results", None)
    if tools:
        preamble = GENERIC_PREAMBLE.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools)
        )
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{preamble}"
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    return messages, None


def _args(text: str) -> Any:
    return json.loads(text) if text else {}


def _hf_message(m: inference_pb2.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": _args(c.arguments)}}
            for c in m.tool_calls
        ]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out
