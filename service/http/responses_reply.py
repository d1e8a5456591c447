"""``POST /v1/responses``, the answer: the chat answer of the translated request
(``service.http.responses_request``) as a ``response`` object (``response_object``) or as
the Responses event stream (``events``), built from the chat stream's chunks."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any


def _usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every rendering of one response shares."""

    ident: str  # ``resp_<hex>``
    created: int
    model: str
    echo: Mapping[str, Any]

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = status == "incomplete"
        return {
            "id": self.ident, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": output, "usage": usage,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "previous_response_id": None, "reasoning": None, "store": False,
            "truncation": "disabled", **self.echo,
        }

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": "msg_" + self.ident.removeprefix("resp_"),
                "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: Mapping[str, Any], status: str) -> dict[str, Any]:
    call_id = str(call["id"])
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"),
            "call_id": call_id, "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def response_object(chat: Mapping[str, Any], head: ResponseHead) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` (one choice) as a ``response``."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("content"):
        output.append(head.message_item(message["content"], "completed"))
    output.extend(_call_item(call, "completed") for call in message.get("tool_calls") or ())
    return head.response(_status(choice["finish_reason"]), output, _usage(chat["usage"]))


async def events(
    chunks: AsyncGenerator[dict[str, Any], None], head: ResponseHead
) -> AsyncIterator[bytes]:
    """The Responses event stream (``response.created`` ... ``response.completed``) from
    a chat stream's chunks (with ``include_usage``); an error chunk ends it with ``error``
    and ``response.failed``, as OpenAI's stream does."""
    seq = 0
    output: list[dict[str, Any]] = []
    text: list[str] = []  # the open message item's text; none open when empty and not open
    text_open = False
    finish: str | None = None
    usage: dict[str, Any] | None = None

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def close_text() -> list[bytes]:
        nonlocal text_open
        if not text_open:
            return []
        text_open = False
        item = output[-1]
        whole = "".join(text)
        text.clear()
        item.update(head.message_item(whole, "completed"))
        where = {"item_id": item["id"], "output_index": len(output) - 1}
        return [
            event("response.output_text.done", **where, content_index=0, text=whole,
                  logprobs=[]),
            event("response.content_part.done", **where, content_index=0,
                  part=_text_part(whole)),
            event("response.output_item.done", output_index=len(output) - 1, item=item),
        ]

    yield event("response.created", response=head.response("in_progress", [], None))
    yield event("response.in_progress", response=head.response("in_progress", [], None))
    # aclosing: a client gone mid-stream closes the chunks too (gen closed, outcome recorded).
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if "error" in chunk:
                err = chunk["error"]
                yield event("error", code=err.get("code"), message=err["message"],
                            param=err.get("param"))
                failed = {"code": err.get("code") or err.get("type"), "message": err["message"]}
                yield event("response.failed",
                            response=head.response("failed", output, usage, error=failed))
                return
            if chunk.get("usage") is not None and not chunk["choices"]:
                usage = _usage(chunk["usage"])
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("content"):
                    if not text_open:
                        text_open = True
                        output.append(head.message_item("", "in_progress"))
                        where = {"item_id": output[-1]["id"], "output_index": len(output) - 1}
                        yield event("response.output_item.added", output_index=len(output) - 1,
                                    item=dict(output[-1]))
                        yield event("response.content_part.added", **where, content_index=0,
                                    part=_text_part(""))
                    text.append(delta["content"])
                    yield event("response.output_text.delta", item_id=output[-1]["id"],
                                output_index=len(output) - 1, content_index=0,
                                delta=delta["content"], logprobs=[])
                for call in delta.get("tool_calls") or ():
                    if "id" in call:  # the call's opening: id and name, empty arguments
                        for done in close_text():
                            yield done
                        output.append(_call_item(call, "in_progress"))
                        yield event("response.output_item.added", output_index=len(output) - 1,
                                    item=dict(output[-1]))
                    else:  # its arguments, whole (the chat stream sends them in one piece)
                        item = output[-1]
                        item["arguments"] = call["function"]["arguments"]
                        item["status"] = "completed"
                        where = {"item_id": item["id"], "output_index": len(output) - 1}
                        yield event("response.function_call_arguments.delta", **where,
                                    delta=item["arguments"])
                        yield event("response.function_call_arguments.done", **where,
                                    name=item["name"], arguments=item["arguments"])
                        yield event("response.output_item.done", output_index=len(output) - 1,
                                    item=item)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
    for done in close_text():
        yield done
    status = _status(finish)
    kind = "response.incomplete" if status == "incomplete" else "response.completed"
    yield event(kind, response=head.response(status, output, usage))
