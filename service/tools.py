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
from dataclasses import dataclass
from typing import Any

from protos.kvfence.v1 import inference_pb2
from service.engine.grammar import GrammarSpec
from service.errors import Violations
from service.model.chat_template import ToolFormat

MAX_TOOLS = 128
#: Calls one constrained turn may make with parallel calls on: the grammar ends the turn
#: after this many, so a model that keeps calling cannot run into max_tokens mid-call.
MAX_PARALLEL_CALLS = 3
MAX_TOOLS_BYTES = 64 * 1024
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


def check_tools(chat: inference_pb2.ChatMessages, field: str, out: Violations) -> None:
    """Tools, the choice and the history's calls: shapes that need no tokenizer."""
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
            try:
                schema = json.loads(tool.parameters)
            except ValueError:
                schema = None
            if not isinstance(schema, dict):
                out.append((f"{where}.parameters", "must be a JSON Schema object"))
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
            if not _json_object(call.arguments or "{}"):
                out.append((f"{where}.tool_calls[{j}].arguments", "must be a JSON object"))


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def plan(chat: inference_pb2.ChatMessages, fmt: ToolFormat) -> ToolPlan | None:
    mode = chat.tool_choice.mode
    if not chat.tools or mode == Mode.MODE_NONE:
        return None
    parallel = not chat.HasField("parallel_tool_calls") or chat.parallel_tool_calls
    if mode == Mode.MODE_FUNCTION:
        return ToolPlan(fmt, frozenset({chat.tool_choice.function}), False, True)
    names = frozenset(t.name for t in chat.tools)
    return ToolPlan(fmt, names, parallel, mode == Mode.MODE_REQUIRED)


def grammar(chat: inference_pb2.ChatMessages, tool_plan: ToolPlan) -> GrammarSpec:
    """A Lark grammar whose every sentence is one call (or, with parallel calls, one or
    more) of the allowed tools, in the plan's format, with arguments valid against the
    tool's schema; the output ends after the last call."""
    options: list[dict[str, Any]] = []
    for tool in chat.tools:
        if tool.name not in tool_plan.names:
            continue
        key = "parameters" if tool_plan.format == "llama3_json" else "arguments"
        options.append({
            "type": "object",
            "properties": {"name": {"const": tool.name}, key: parameters(tool)},
            "required": ["name", key],
            "additionalProperties": False,
        })
    call = {"anyOf": options} if len(options) > 1 else options[0]
    body = json.dumps({**call, "x-guidance": {"whitespace_flexible": False}})
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
    return GrammarSpec("lark", f"{start}\n{rule}\nbody: %json {body}\n")


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
