"""OpenAI chat ``messages`` and ``tools``/``tool_choice``/``parallel_tool_calls`` -> the
gRPC ``ChatMessages``. Shapes only; the shared validator (``service.structured.tools``) checks names,
schemas and the choice against the tools."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from protos.kvfence.v1 import inference_pb2
from service.errors import Violations

# Fields an assistant message echoed back by the SDKs carries as null or empty.
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
ECHOED_EMPTY = frozenset({"refusal", "annotations", "audio", "function_call", "reasoning_content"})
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
MODES = {
    "auto": inference_pb2.ToolChoice.MODE_AUTO,
    "none": inference_pb2.ToolChoice.MODE_NONE,
    "required": inference_pb2.ToolChoice.MODE_REQUIRED,
}


def messages(items: list[Any], chat: inference_pb2.ChatMessages, out: Violations) -> None:
    for i, msg in enumerate(items):
        _message(msg, f"messages[{i}]", chat, out)


def _message(msg: Any, field: str, chat: inference_pb2.ChatMessages, out: Violations) -> None:
    if not isinstance(msg, dict):
        out.append((field, "must be an object"))
        return
    extra = {k for k, v in msg.items() if k not in MESSAGE_FIELDS and not (
        k in ECHOED_EMPTY and not v)}
    if extra:
        out.append((field, f"unsupported fields {sorted(extra)}"))
    role = ROLES.get(msg.get("role"))  # type: ignore[arg-type]
    if role is None:
        out.append((f"{field}.role", f"must be one of {sorted(ROLES)}"))
        role = "user"
    added = chat.messages.add(role=role, content=_content(msg, role, field, out))
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            out.append((f"{field}.tool_calls", "must be an array, on an assistant message"))
        else:
            for j, call in enumerate(calls):
                _call(call, f"{field}.tool_calls[{j}]", added, out)
    call_id = msg.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str) or not call_id:
            out.append((f"{field}.tool_call_id", "a tool message needs the id of its call"))
        else:
            added.tool_call_id = call_id
    elif call_id is not None:
        out.append((f"{field}.tool_call_id", "only tool messages carry tool_call_id"))


def _content(msg: Mapping[str, Any], role: str, field: str, out: Violations) -> str:
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if content is None and role == "assistant" and msg.get("tool_calls"):
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    out.append((f"{field}.content", "must be a string or an array of text parts"))
    return ""


def _call(call: Any, field: str, msg: inference_pb2.ChatMessage, out: Violations) -> None:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function":
        out.append((field, 'must be {"id", "type": "function", "function": {name, arguments}}'))
        return
    name, arguments, ident = fn.get("name"), fn.get("arguments", "{}"), call.get("id", "")
    if isinstance(arguments, dict):  # some clients send the object itself
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not (isinstance(name, str) and isinstance(arguments, str) and isinstance(ident, str)):
        out.append((field, "id, function.name and function.arguments must be strings"))
        return
    msg.tool_calls.add(id=ident, name=name, arguments=arguments)


def tools(body: Mapping[str, Any], chat: inference_pb2.ChatMessages, out: Violations) -> None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` onto ``chat``."""
    items = body.get("tools")
    if items is not None:
        if not isinstance(items, list) or not items:
            out.append(("tools", "must be a non-empty array"))
            items = []
        for i, tool in enumerate(items):
            _tool(tool, f"tools[{i}]", chat, out)
    choice = body.get("tool_choice")
    if choice is not None:
        if items is None:
            out.append(("tool_choice", "needs tools"))
        elif isinstance(choice, str) and choice in MODES:
            chat.tool_choice.mode = MODES[choice]
        elif (isinstance(choice, dict) and choice.get("type") == "function"
              and isinstance(choice.get("function"), dict)
              and isinstance(choice["function"].get("name"), str)):
            chat.tool_choice.mode = inference_pb2.ToolChoice.MODE_FUNCTION
            chat.tool_choice.function = choice["function"]["name"]
        else:
            out.append(("tool_choice", 'must be "auto", "none", "required" or '
                        '{"type": "function", "function": {"name": ...}}'))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            out.append(("parallel_tool_calls", "must be a boolean"))
        else:
            chat.parallel_tool_calls = parallel


def _tool(tool: Any, field: str, chat: inference_pb2.ChatMessages, out: Violations) -> None:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or tool.get("type") != "function":
        out.append((field, 'must be {"type": "function", "function": {...}}'))
        return
    name, description = fn.get("name"), fn.get("description") or ""
    params = fn.get("parameters")
    if not isinstance(name, str) or not isinstance(description, str):
        out.append((field, "function.name and function.description must be strings"))
        return
    if params is not None and not isinstance(params, dict):
        out.append((f"{field}.function.parameters", "must be a JSON Schema object"))
        return
    chat.tools.add(name=name, description=description,
                   parameters=json.dumps(params) if params is not None else "")
