"""Engine events -> OpenAI response objects (pure functions over plain dicts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from service.engine.types import Delta, Finished, TokenLogprob
from service.http.parse import HttpOptions
from service.structured.tool_calls import ParsedCall

Endpoint = Literal["chat", "completion"]
TokenText = Callable[[int], str]


@dataclass(slots=True)
class Choice:
    """One of the ``n`` sequences as it accumulates (non-streaming) or streams."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finished | None = None
    cached_tokens: int = 0
    started: bool = False  # a streamed chat choice sends its role once
    prompt_tokens: int = 0  # from Admitted; streamed running usage only
    completion_tokens: int = 0  # tokens streamed so far; running usage only
    tool_calls: list[ParsedCall] = field(default_factory=list)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """``cached_tokens`` counts only hits in the caller's own tenant (the prefix cache is
    partitioned by tenant), as on gRPC."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def total_usage(choices: Sequence[Choice]) -> dict[str, Any]:
    """Prompt tokens once (the sequences share the prompt), completions summed; cached
    tokens as the first sequence saw them (the others reuse the pages it filled)."""
    done = [c.finish for c in choices if c.finish is not None]
    prompt = done[0].prompt_tokens if done else 0
    return usage(prompt, sum(f.completion_tokens for f in done), choices[0].cached_tokens)


def running_usage(choices: Sequence[Choice]) -> dict[str, Any]:
    """``total_usage`` while streaming: finished sequences count as they finished, the
    others as far as they have streamed."""
    prompt = next((c.prompt_tokens for c in choices if c.prompt_tokens), 0)
    completion = sum(
        c.finish.completion_tokens if c.finish is not None else c.completion_tokens
        for c in choices
    )
    return usage(prompt, completion, choices[0].cached_tokens)


def _chat_logprobs(lps: Sequence[TokenLogprob], top_n: int, text: TokenText) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        t = text(token_id)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob),
             "top_logprobs": [entry(t, p) for t, p in lp.top[:top_n]]}
            for lp in lps
        ]
    }


def _completion_logprobs(
    lps: Sequence[TokenLogprob], top_n: int, text: TokenText, offset: int
) -> dict[str, Any]:
    tokens = [text(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [_top_by_text(lp.top[:top_n], text) for lp in lps],
        "text_offset": offsets,
    }


def _top_by_text(top: Sequence[tuple[int, float]], text: TokenText) -> dict[str, float]:
    """Keyed by text, as OpenAI's format is: of tokens that decode alike (partial UTF-8),
    the most likely one (``top`` is sorted) keeps the key."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(text(token_id), logprob)
    return out


def logprobs_object(
    lps: Sequence[TokenLogprob], opts: HttpOptions, text: TokenText, offset: int = 0
) -> dict[str, Any] | None:
    if opts.logprobs == "chat":
        return _chat_logprobs(lps, opts.top_logprobs, text)
    if opts.logprobs == "completion":
        return _completion_logprobs(lps, opts.top_logprobs, text, offset)
    return None


def finish_reason(event: Finished, choice: Choice) -> str:
    if event.reason == "length":
        return "length"
    return "tool_calls" if choice.tool_calls else "stop"


def tool_call_object(call: ParsedCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def complete_body(
    endpoint: Endpoint,
    ident: str,
    created: int,
    model: str,
    choices: Sequence[Choice],
    opts: HttpOptions,
    text: TokenText,
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` or ``text_completion``."""
    out = []
    for c in choices:
        assert c.finish is not None
        body_text = "".join(c.text)
        item: dict[str, Any] = {
            "index": c.index,
            "logprobs": logprobs_object(c.logprobs, opts, text),
            "finish_reason": finish_reason(c.finish, c),
        }
        if endpoint == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": body_text}
            if c.tool_calls:
                message["content"] = body_text or None
                message["tool_calls"] = [tool_call_object(t) for t in c.tool_calls]
            item["message"] = message
        else:
            item["text"] = body_text
        out.append(item)
    return {
        "id": ident,
        "object": "chat.completion" if endpoint == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": total_usage(choices),
        "system_fingerprint": None,
    }


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    endpoint: Endpoint
    ident: str
    created: int
    model: str
    include_usage: bool

    def wrap(self, choices: list[dict[str, Any]], usage_obj: Any = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.ident,
            "object": "chat.completion.chunk" if self.endpoint == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.include_usage:
            chunk["usage"] = usage_obj
        return chunk


def delta_chunk(
    head: ChunkHeader,
    choice: Choice,
    event: Delta,
    opts: HttpOptions,
    text: TokenText,
    offset: int,
    usage_so_far: dict[str, Any] | None = None,
) -> dict[str, Any]:
    lps = logprobs_object(event.logprobs, opts, text, offset)
    if head.endpoint == "chat":
        delta: dict[str, Any] = {"content": event.text}
        if not choice.started:
            delta["role"] = "assistant"
        item = {"index": choice.index, "delta": delta, "logprobs": lps, "finish_reason": None}
    else:
        item = {"index": choice.index, "text": event.text, "logprobs": lps, "finish_reason": None}
    choice.started = True
    return head.wrap([item], usage_so_far)


def tool_call_chunks(
    head: ChunkHeader,
    choice: Choice,
    calls: Sequence[ParsedCall],
    usage_so_far: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """As OpenAI streams a call: its id and name (with empty arguments), then the arguments;
    ``index`` numbers the choice's calls."""
    out = []
    for call in calls:
        k = len(choice.tool_calls)
        choice.tool_calls.append(call)
        opening: dict[str, Any] = {"tool_calls": [{
            "index": k, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }]}
        if not choice.started:
            opening = {"role": "assistant", "content": None, **opening}
            choice.started = True
        for delta in (opening, {"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]}):
            out.append(head.wrap([{"index": choice.index, "delta": delta, "logprobs": None,
                                   "finish_reason": None}], usage_so_far))
    return out


def finish_chunk(
    head: ChunkHeader, choice: Choice, event: Finished, usage_so_far: dict[str, Any] | None = None
) -> dict[str, Any]:
    reason = finish_reason(event, choice)
    if head.endpoint == "chat":
        delta: dict[str, Any] = {} if choice.started else {"role": "assistant", "content": ""}
        item = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        item = {"index": choice.index, "text": "", "logprobs": None, "finish_reason": reason}
    return head.wrap([item], usage_so_far)
