"""``POST /v1/responses``, the request: the OpenAI Responses API, as the official SDK's
``client.responses.create`` sends it, on the chat-completions path.

The body is translated into a chat-completions body (``ResponsesRequest.parse``) and from
there runs exactly as ``/v1/chat/completions`` does: the same parsing and shared
validation, admission, tool-call parsing and ``tool_choice`` grammar. Its answer is the
chat answer re-shaped (``service.http.responses_reply``).

Nothing is stored. ``store: true``, ``previous_response_id``, ``conversation`` and
``background: true`` are refused by name; a follow-up sends the whole conversation in
``input`` (the ``function_call`` items it got back and its ``function_call_output`` items).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protos.kvfence.v1 import inference_pb2
from service.errors import Violations, invalid_argument
from service.http.parse import HttpOptions, parse_chat

#: Copied to the chat body as they are (kvfence's sampling extensions included).
PASSED = frozenset({
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "logit_bias",
    "cache_salt", "user", "safety_identifier", "parallel_tool_calls",
})
#: Translated here.
TRANSLATED = frozenset({
    "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "stream",
    "store", "truncation", "include", "background",
})
#: Accepted and ignored: bookkeeping that changes no output here.
IGNORED: Mapping[str, str] = {
    "metadata": "only meaningful with store",
    "prompt_cache_key": "the prefix cache is keyed by tenant (and cache_salt), not routed",
    "prompt_cache_retention": "cache lifetime is the tenant's TTL",
    "service_tier": "one tier; the tenant's limits apply",
    "reasoning": "the served model has no reasoning settings",
    "stream_options": "no obfuscation padding is sent",
}
#: Refused by name, with the reason.
REFUSED: Mapping[str, str] = {
    "previous_response_id": "kvfence stores no responses: send the whole conversation in input",
    "conversation": "kvfence stores no conversations: send the whole conversation in input",
    "prompt": "stored prompts are not supported",
    "max_tool_calls": "is not supported",
    "top_logprobs": "is not supported here; /v1/chat/completions returns logprobs",
}
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
ROLES = frozenset({"user", "system", "developer", "assistant"})


@dataclass(slots=True)
class ResponsesRequest:
    """One request's translation; ``echo`` holds the request fields a response repeats
    (set by ``parse``)."""

    echo: dict[str, Any] = field(default_factory=dict)

    def parse(self, body: Mapping[str, Any]) -> tuple[inference_pb2.GenerateRequest, HttpOptions]:
        """The body as a chat request; raises INVALID_ARGUMENT naming Responses fields."""
        out: Violations = []
        for name in sorted(body):
            if body[name] is None or name in PASSED or name in TRANSLATED or name in IGNORED:
                continue
            out.append((name, REFUSED.get(name, "unknown or unsupported field")))
        if body.get("store"):
            out.append(("store", "kvfence stores no responses: send store: false or leave it out"))
        if body.get("background"):
            out.append(("background", "background responses are not supported"))
        if body.get("truncation") not in (None, "disabled"):
            out.append(("truncation", 'only "disabled" is supported (a conversation longer '
                        "than the context is refused)"))
        if body.get("include") not in (None, []):
            out.append(("include", "no additional output data is available"))
        chat: dict[str, Any] = {k: body[k] for k in PASSED if body.get(k) is not None}
        chat["messages"] = _messages(body, out)
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        if body.get("tools") is not None:
            chat["tools"] = _tools(body["tools"], out)
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"], out)
        fmt = _response_format(body.get("text"), out)
        if fmt is not None:
            chat["response_format"] = fmt
        if body.get("stream"):
            chat["stream"] = body["stream"]
            chat["stream_options"] = {"include_usage": True}  # the usage goes in the last event
        if out:
            raise invalid_argument(out)
        self.echo = {
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": body.get("text") or {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {},
            "user": body.get("user"),
        }
        return parse_chat(chat)


def _messages(body: Mapping[str, Any], out: Violations) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if isinstance(instructions, str):
            msgs.append({"role": "system", "content": instructions})
        else:
            out.append(("instructions", "must be a string"))
    items = body.get("input")
    if isinstance(items, str):
        msgs.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            _item(item, f"input[{i}]", msgs, out)
    else:
        out.append(("input", "must be a string or an array of input items"))
    return msgs


def _item(item: Any, where: str, msgs: list[dict[str, Any]], out: Violations) -> None:
    if not isinstance(item, dict):
        out.append((where, "must be an object"))
        return
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            out.append((f"{where}.role", f"must be one of {sorted(ROLES)}"))
            return
        msgs.append({"role": role, "content": _text(item.get("content"), where, out)})
    elif kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not all(isinstance(v, str) for v in (call_id, name, arguments)):
            out.append((where, "call_id, name and arguments must be strings"))
            return
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}
        last = msgs[-1] if msgs else None
        if last is not None and last["role"] == "assistant":  # the same assistant turn
            last.setdefault("tool_calls", []).append(call)
        else:
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            out.append((f"{where}.call_id", "must be a string"))
            return
        output = _text(item.get("output"), f"{where}.output", out)
        msgs.append({"role": "tool", "tool_call_id": call_id, "content": output})
    else:
        out.append((f"{where}.type", f"{str(kind)[:40]!r} is not supported (message, "
                    "function_call, function_call_output)"))


def _text(content: Any, where: str, out: Violations) -> str:
    """A string, or text parts joined; other parts (images, files, audio) are refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (isinstance(part, dict) and part.get("type") in TEXT_PARTS
                    and isinstance(part.get("text"), str)):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else None
                out.append((f"{where}.content[{j}]",
                            f"only text parts are supported (got {str(kind)[:40]!r})"))
        return "".join(texts)
    out.append((f"{where}.content", "must be a string or an array of text parts"))
    return ""


def _tools(tools: Any, out: Violations) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        out.append(("tools", "must be an array"))
        return []
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            out.append((f"tools[{i}]", f'only "function" tools are supported (got {str(kind)[:40]!r})'))
            continue
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": fn})
    return chat_tools


def _tool_choice(choice: Any, out: Violations) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
        choice.get("name"), str
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    out.append(("tool_choice", 'must be "auto", "none", "required" or '
                '{"type": "function", "name": ...}'))
    return None


def _response_format(text: Any, out: Violations) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    out.append(("text.format", "must be {type: text | json_object} or {type: json_schema, ...}"))
    return None
