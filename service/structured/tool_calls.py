"""Tool calls read out of one sequence's streamed text, as it streams.

``ToolCallStream.feed`` takes each text delta and returns the text that is content (safe to
send now) and the calls completed so far; ``close`` flushes at the end. Text that may still
turn out to be call markup is held back, never sent twice and never lost: content joined
plus the calls' markup is the model's output. A block that does not parse as a call of an
offered tool stays content, as the model wrote it.

Formats (chosen from the chat template, ``service.model.chat_template``):

- ``hermes`` (Qwen, Hermes, and the generic rendering): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks anywhere in the text;
- ``llama3_json`` (Llama 3.x): the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;``;
- ``mistral``: the whole output is ``[TOOL_CALLS]`` and a JSON array of
  ``{"name": ..., "arguments": {...}}``.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.engine.types import Admitted, Delta, EngineEvent, Finished
from service.structured.tools import CALL_CLOSE, CALL_OPEN, ToolPlan

OPEN, CLOSE = CALL_OPEN, CALL_CLOSE
_ALPHABET = string.ascii_letters + string.digits
_WHOLE_OUTPUT_MARKERS = {"llama3_json": ("<|python_tag|>", "{"), "mistral": ("[TOOL_CALLS]",)}


def new_call_id() -> str:
    """``call_`` and 24 random letters and digits, as OpenAI's ids look."""
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass(frozen=True, slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object as compact JSON text


class ToolCallStream:
    """Splits one sequence's output into content and tool calls (see the module doc)."""

    def __init__(self, plan: ToolPlan, new_id: Callable[[], str] = new_call_id) -> None:
        self._plan = plan
        self._new_id = new_id
        self._buf = ""
        self._inside = False  # hermes: within a <tool_call> block
        self._after_call = False  # hermes: newlines right after a call are its separator
        self._whole: bool | None = None  # llama3/mistral: output is calls (None: not known)
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buf += text
        if self._plan.format == "hermes":
            return self._hermes(final=False)
        return self._whole_output(final=False)

    def close(self, stopped: bool = False) -> tuple[str, list[ParsedCall]]:
        """The held-back text and calls at the end. ``stopped``: the output ended on a stop
        string; with ``plan.stops_after_one_call`` that is the call's trimmed closing tag."""
        if self._plan.format == "hermes":
            if stopped and self._inside and self._plan.stops_after_one_call:
                self._buf += CLOSE
            return self._hermes(final=True)
        return self._whole_output(final=True)

    def _take(self, name: Any, arguments: Any) -> ParsedCall | None:
        if not isinstance(name, str) or name not in self._plan.names:
            return None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):  # not JSON, or nested past the reader
                return None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None
        call = ParsedCall(self._new_id(), name, json.dumps(arguments, ensure_ascii=False))
        return call

    def _accept(self, call: ParsedCall, out: list[ParsedCall]) -> None:
        # Without parallel calls only the first counts; the rest of the markup is dropped.
        if self._plan.parallel or not self.calls:
            self.calls.append(call)
            out.append(call)

    def _hermes(self, final: bool) -> tuple[str, list[ParsedCall]]:
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if not self._inside:
                if self._after_call:
                    self._buf = self._buf.lstrip("\n")
                    self._after_call = not self._buf
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buf, OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:at])
                self._buf = self._buf[at + len(OPEN) :]
                self._inside = True
            end = self._buf.find(CLOSE)
            if end < 0:
                if final:  # cut off (max_tokens): what there is stays text
                    content.append(OPEN + self._buf)
                    self._buf = ""
                break
            block = self._buf[:end]
            self._buf = self._buf[end + len(CLOSE) :]
            self._inside = False
            call = self._parse_object(block.strip())
            if call is None:
                content.append(OPEN + block + CLOSE)
            else:
                self._accept(call, calls)
                self._after_call = True
        return "".join(content), calls

    def _parse_object(self, text: str) -> ParsedCall | None:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or nested past the reader
            return None
        if not isinstance(obj, dict):
            return None
        return self._take(obj.get("name"), obj.get("arguments", obj.get("parameters")))

    def _whole_output(self, final: bool) -> tuple[str, list[ParsedCall]]:
        markers = _WHOLE_OUTPUT_MARKERS[self._plan.format]
        if self._whole is None:
            head = self._buf.lstrip()
            if any(head.startswith(m) for m in markers):
                self._whole = True
            elif (head and not any(m.startswith(head) for m in markers)) or final:
                self._whole = False
            else:
                return "", []  # too short to tell
        if not self._whole:
            text, self._buf = self._buf, ""
            return text, []
        if not final:
            return "", []
        text, self._buf = self._buf, ""
        calls = self._parse_whole(text.strip())
        if calls is None:
            return text, []
        out: list[ParsedCall] = []
        for call in calls:
            self._accept(call, out)
        return "", out

    def _parse_whole(self, text: str) -> list[ParsedCall] | None:
        for marker in ("<|python_tag|>", "[TOOL_CALLS]"):
            text = text.removeprefix(marker).lstrip()
        decoder = json.JSONDecoder()
        items: list[Any] = []
        at = 0
        while at < len(text):
            try:
                value, at = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):  # not JSON, or nested past the reader
                return None
            items.extend(value if isinstance(value, list) else [value])
            while at < len(text) and text[at] in " \n\t;,":
                at += 1
        calls = []
        for item in items:
            if not isinstance(item, dict):
                return None
            call = self._take(item.get("name"), item.get("arguments", item.get("parameters")))
            if call is None:
                return None
            calls.append(call)
        return calls or None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True, slots=True)
class CallsMade:
    """Tool calls completed by one sequence's latest output."""

    calls: tuple[ParsedCall, ...]


class ToolSplitter:
    """One sequence's engine events with its tool calls split out, the same for both fronts:
    a ``Delta`` keeps its token ids and logprobs and carries only the content text; each
    completed call comes as ``CallsMade`` after the delta that completed it; at ``Finished``
    the held-back text and calls come first. ``called`` says whether the sequence made any
    call (its finish reason is then ``tool_calls`` where it would be ``stop``)."""

    def __init__(self, plan: ToolPlan | None, new_id: Callable[[], str] = new_call_id) -> None:
        self._stream = ToolCallStream(plan, new_id) if plan is not None else None

    @property
    def called(self) -> bool:
        return self._stream is not None and bool(self._stream.calls)

    def split(self, event: EngineEvent) -> list[EngineEvent | CallsMade]:
        stream = self._stream
        if stream is None or isinstance(event, Admitted):
            return [event]
        if isinstance(event, Delta):
            text, calls = stream.feed(event.text)
            out: list[EngineEvent | CallsMade] = [dataclasses.replace(event, text=text)]
        else:
            text, calls = stream.close(stopped=event.reason == "stop")
            out = [Delta((), text)] if text else []
        if calls:
            out.append(CallsMade(tuple(calls)))
        if isinstance(event, Finished):
            out.append(event)
        return out
