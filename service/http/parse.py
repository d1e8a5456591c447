"""OpenAI request bodies -> the gRPC ``GenerateRequest`` plus the few HTTP-only options.

Only shapes and JSON types are checked here; ranges and sizes are checked by the same
validator the gRPC front uses, on the ``GenerateRequest`` this builds. Which fields are
honoured, ignored or refused is decided in ``fields`` (and listed in docs/openai.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from protos.kvfence.v1 import inference_pb2
from service.admission.request_fields import MAX_LOGIT_BIAS
from service.errors import Violations, invalid_argument
from service.http import body_fields, chat_parse
from service.json_input import (
    NOT_TEXT,
    JsonInputError,
    lone_surrogate,
    may_hold_surrogate,
)
from service.json_input import load as load_json

MAX_N = 16
MAX_COMPLETION_LOGPROBS = 5


LogprobsKind = Literal["none", "chat", "completion"]


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """What the HTTP front needs beyond the ``GenerateRequest``."""

    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: LogprobsKind = "none"
    top_logprobs: int = 0  # alternatives to render per token
    # vLLM's ``stream_options.continuous_usage_stats`` (GuideLLM sends it): with
    # include_usage, every chunk carries the usage so far, not only the last one.
    continuous_usage: bool = False
    user: str = ""  # the caller's end-user id (``user`` / ``safety_identifier``); logged hashed


def load_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object: 400 naming ``body`` when it is not JSON, nests too deep
    or is not an object, and naming the field when a string in it is not Unicode text."""
    try:
        body = load_json(raw)
    except JsonInputError as err:
        raise invalid_argument([("body", str(err))]) from None
    if not isinstance(body, dict):
        raise invalid_argument([("body", "must be a JSON object")])
    if may_hold_surrogate(raw):
        where = lone_surrogate(body)
        if where is not None:
            raise invalid_argument([(where or "body", NOT_TEXT)])
    return body


class _Fields:
    """Typed reads of a JSON object that record violations instead of raising."""

    def __init__(self, body: Mapping[str, Any], out: Violations) -> None:
        self.body = body
        self.out = out

    def get(self, name: str, kind: str) -> Any:
        value = self.body.get(name)
        if value is None:
            return None
        ok = _TYPES[kind](value)
        if not ok:
            self.out.append((name, f"must be {kind}"))
            return None
        return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


_TYPES: dict[str, Callable[[Any], bool]] = {
    "an integer": _is_int,
    "a number": _is_number,
    "a boolean": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
    "an array": lambda v: isinstance(v, list),
}


def _common(
    f: _Fields, req: inference_pb2.GenerateRequest, max_tokens_field: str
) -> tuple[int, bool, bool, bool]:
    """Fields shared by both endpoints. Returns (n, stream, include_usage, continuous_usage)."""
    model = f.get("model", "a string")
    if model:
        req.model = model
    max_tokens = f.get(max_tokens_field, "an integer")
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = f.get("max_tokens", "an integer")
    if max_tokens is not None:
        req.stopping.max_tokens = _clamp_i32(max_tokens)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = f.get(name, "a number")
        if value is not None:
            setattr(req.sampling, name, float(value))
    top_k = f.get("top_k", "an integer")
    if top_k is not None:
        # OpenAI-style servers use -1 for "off"; kvfence uses 0.
        req.sampling.top_k = 0 if top_k == -1 else _clamp_i32(top_k)
    seed = f.get("seed", "an integer")
    if seed is not None:
        if not 0 <= seed < 2**64:
            f.out.append(("seed", "must be in [0, 2^64)"))
        else:
            req.sampling.seed = seed
    min_tokens = f.get("min_tokens", "an integer")
    if min_tokens is not None:
        req.stopping.min_tokens = _clamp_i32(min_tokens)
    ignore_eos = f.get("ignore_eos", "a boolean")
    req.stopping.ignore_eos = bool(ignore_eos)
    _stop(f, req)
    _response_format(f, req)
    _logit_bias(f, req)
    salt = f.get("cache_salt", "a string")
    if salt is not None:
        if not salt:
            f.out.append(("cache_salt", "must be a non-empty string when set"))
        req.cache_salt = salt
    n = f.get("n", "an integer")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        f.out.append(("n", f"must be in [1, {MAX_N}]"))
    stream = bool(f.get("stream", "a boolean"))
    flags = {"include_usage": False, "continuous_usage_stats": False}
    options = f.get("stream_options", "an object")
    if options is not None:
        if not stream:
            f.out.append(("stream_options", "is only allowed with stream: true"))
        extra = set(options) - set(flags)
        if extra:
            f.out.append(("stream_options", f"unknown fields {sorted(extra)}"))
        for name in flags:
            value = options.get(name)
            if value is not None and not isinstance(value, bool):
                f.out.append((f"stream_options.{name}", "must be a boolean"))
            flags[name] = bool(value)
    include_usage = flags["include_usage"]
    return n, stream, include_usage, include_usage and flags["continuous_usage_stats"]


def _clamp_i32(value: int) -> int:
    """Out-of-range integers still reach the validator (as a value it refuses)."""
    return max(-(2**31), min(2**31 - 1, value))


def _stop(f: _Fields, req: inference_pb2.GenerateRequest) -> None:
    stop = f.body.get("stop")
    if stop is None:
        return
    if isinstance(stop, str):
        req.stopping.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        req.stopping.stop.extend(stop)
    else:
        f.out.append(("stop", "must be a string or an array of strings"))


def _logit_bias(f: _Fields, req: inference_pb2.GenerateRequest) -> None:
    """``{"<token id>": bias}``; ids and ranges are checked by the shared validator."""
    bias = f.get("logit_bias", "an object")
    if bias is None:
        return
    if len(bias) > MAX_LOGIT_BIAS:  # counted before any entry is read
        f.out.append(("logit_bias", f"at most {MAX_LOGIT_BIAS} entries"))
        return
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()) or len(key) > 10:
            f.out.append(("logit_bias", f"key {key[:16]!r} is not a token id"))
            return
        if not _is_number(value):
            f.out.append(("logit_bias", f"bias of token {key} must be a number"))
            return
        req.sampling.logit_bias[_clamp_i32(int(key))] = float(value)


def end_user(f: _Fields) -> str:
    """``safety_identifier`` (OpenAI's current name) or else ``user``."""
    for name in ("safety_identifier", "user"):
        value = f.get(name, "a string")
        if value:
            return str(value)
    return ""


def _response_format(f: _Fields, req: inference_pb2.GenerateRequest) -> None:
    fmt = f.get("response_format", "an object")
    if fmt is None:
        return
    kind = fmt.get("type")
    rf = req.response_format
    if kind == "text" and set(fmt) == {"type"}:
        return
    if kind == "json_object" and set(fmt) == {"type"}:
        rf.json_object = True
    elif kind == "json_schema" and set(fmt) == {"type", "json_schema"}:
        spec = fmt["json_schema"]
        allowed = {"name", "schema", "strict", "description"}
        if not isinstance(spec, dict) or not set(spec) <= allowed:
            f.out.append(("response_format.json_schema", f"must be an object with {sorted(allowed)}"))
        elif not isinstance(spec.get("schema", {}), dict):
            f.out.append(("response_format.json_schema.schema", "must be an object"))
        else:
            rf.json_schema = json.dumps(spec.get("schema", {}))
    elif kind == "regex" and set(fmt) == {"type", "regex"} and isinstance(fmt["regex"], str):
        rf.regex = fmt["regex"]
    elif kind == "grammar" and set(fmt) == {"type", "grammar"} and isinstance(fmt["grammar"], str):
        rf.lark_grammar = fmt["grammar"]
    else:
        f.out.append(
            (
                "response_format",
                "must be {type: text | json_object}, {type: json_schema, json_schema: {...}}, "
                "{type: regex, regex: str} or {type: grammar, grammar: <Lark>}",
            )
        )


def parse_chat(body: Mapping[str, Any]) -> tuple[inference_pb2.GenerateRequest, HttpOptions]:
    """``POST /v1/chat/completions`` -> (request, options); raises INVALID_ARGUMENT."""
    out: Violations = []
    body_fields.check_names(body, body_fields.CHAT, out)
    f = _Fields(body, out)
    req = inference_pb2.GenerateRequest()
    n, stream, usage, continuous = _common(f, req, "max_completion_tokens")
    messages = f.get("messages", "an array")
    if messages is None:
        out.append(("messages", "is required"))
    else:
        chat = req.chat
        chat_parse.messages(messages, chat, out)
        chat_parse.tools(body, chat, out)
        chat.add_generation_prompt = True
        if not messages:
            req.chat.SetInParent()
    logprobs: LogprobsKind = "none"
    top = 0
    if f.get("logprobs", "a boolean"):
        logprobs = "chat"
        top = f.get("top_logprobs", "an integer") or 0
        req.logprobs = max(1, top)  # the chosen token's logprob comes with any top-n
    elif body.get("top_logprobs") is not None:
        out.append(("top_logprobs", "needs logprobs: true"))
    if out:
        raise invalid_argument(out)
    return req, HttpOptions(n, stream, usage, logprobs, top, continuous, end_user(f))


def parse_completion(
    body: Mapping[str, Any],
) -> tuple[inference_pb2.GenerateRequest, HttpOptions]:
    """``POST /v1/completions`` -> (request, options); raises INVALID_ARGUMENT."""
    out: Violations = []
    body_fields.check_names(body, body_fields.COMPLETION, out)
    f = _Fields(body, out)
    req = inference_pb2.GenerateRequest()
    n, stream, usage, continuous = _common(f, req, "max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        req.token_ids.ids.extend(_clamp_i32(t) for t in prompt)
        req.token_ids.SetInParent()
    else:
        out.append(("prompt", "must be a string or an array of token ids (one prompt)"))
    if body.get("echo"):
        out.append(("echo", "is not supported"))
    best_of = f.get("best_of", "an integer")
    if best_of is not None and best_of != n:
        out.append(("best_of", "must equal n when set"))
    logprobs: LogprobsKind = "none"
    top = f.get("logprobs", "an integer")
    if top is not None:
        if not 0 <= top <= MAX_COMPLETION_LOGPROBS:
            out.append(("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}]"))
        logprobs = "completion"
        req.logprobs = max(1, top)
    if out:
        raise invalid_argument(out)
    return req, HttpOptions(n, stream, usage, logprobs, top or 0, continuous, end_user(f))
