"""Service errors -> OpenAI error JSON, with the HTTP status that matches the gRPC status.

| gRPC status         | HTTP | OpenAI ``type``          | notes                                   |
|---------------------|------|--------------------------|-----------------------------------------|
| INVALID_ARGUMENT    | 400  | invalid_request_error    | ``param`` = the first offending field   |
| (body too large)    | 413  | invalid_request_error    | ``param`` = ``body``; connection closed |
| UNAUTHENTICATED     | 401  | authentication_error     |                                         |
| PERMISSION_DENIED   | 403  | permission_error         |                                         |
| (no such route)     | 404  | not_found_error          |                                         |
| RESOURCE_EXHAUSTED  | 429  | rate_limit_error         | ``Retry-After`` when waiting can help   |
| CANCELLED           | 499  | cancelled                | the client is gone; nobody reads it     |
| INTERNAL            | 500  | server_error             |                                         |
| UNAVAILABLE         | 503  | service_unavailable      | ``Retry-After``; draining or stopped    |
| DEADLINE_EXCEEDED   | 504  | timeout                  | ``X-Kvfence-Timeout`` passed            |

The message is the gRPC status message (it never carries prompt or output text), with what
names a gRPC method said the HTTP way (``HTTP_WORDS``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import grpc
from google.rpc import error_details_pb2
from starlette.responses import JSONResponse

from service.errors import ServiceError

#: gRPC field paths (what the shared validator names) -> OpenAI parameter names.
PARAM_NAMES = {
    "sampling.temperature": "temperature",
    "sampling.top_k": "top_k",
    "sampling.top_p": "top_p",
    "sampling.min_p": "min_p",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "stopping.max_tokens": "max_tokens",
    "stopping.min_tokens": "min_tokens",
    "stopping.stop": "stop",
    "chat": "messages",
    "chat.messages": "messages",
    "text": "prompt",
    "token_ids": "prompt",
    "token_ids.ids": "prompt",
    "logprobs": "top_logprobs",
    "sampling.logit_bias": "logit_bias",
}


_FUNCTION_PART = re.compile(r"((?:^tools|\.tool_calls)\[\d+\])\.(name|description|parameters|arguments)")


def param_name(field: str) -> str:
    """The OpenAI parameter a gRPC field path refers to (``stopping.stop[2]`` -> ``stop``)."""
    if field in PARAM_NAMES:
        return PARAM_NAMES[field]
    if field.startswith("chat."):  # chat.messages[2].content, chat.tools[0].name, ...
        # The wire's Tool and ToolCall hold in one message what OpenAI nests in ``function``.
        return _FUNCTION_PART.sub(r"\1.function.\2", field.removeprefix("chat."))
    head = field.split("[", 1)[0]
    if head in PARAM_NAMES:
        return PARAM_NAMES[head]
    return field

_MAP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


#: gRPC words in shared error texts -> what an HTTP client can act on.
HTTP_WORDS = (
    ("(see ListModels)", "(see GET /v1/models)"),
    ("send text or token_ids", "send a prompt to /v1/completions"),
)


def http_words(text: str) -> str:
    for grpc_words, http in HTTP_WORDS:
        text = text.replace(grpc_words, http)
    return text


def http_status(err: ServiceError) -> int:
    return _MAP.get(err.code, (500, ""))[0]


def retry_after(err: ServiceError) -> str | None:
    """Whole seconds (rounded up, at least 1) from the error's RetryInfo, if any."""
    for detail in err.details:
        if isinstance(detail, error_details_pb2.RetryInfo):
            delay = detail.retry_delay
            return str(max(1, math.ceil(delay.seconds + delay.nanos / 1e9)))
    return None


def error_body(err: ServiceError) -> dict[str, Any]:
    _, kind = _MAP.get(err.code, (500, "server_error"))
    param: str | None = None
    reason: str | None = None
    for detail in err.details:
        if isinstance(detail, error_details_pb2.BadRequest) and detail.field_violations:
            param = param_name(detail.field_violations[0].field)
        elif isinstance(detail, error_details_pb2.ErrorInfo):
            reason = detail.reason
        elif isinstance(detail, error_details_pb2.QuotaFailure) and detail.violations:
            reason = detail.violations[0].subject
    message = err.message
    if err.code == grpc.StatusCode.INVALID_ARGUMENT:
        message = "; ".join(
            f"{param_name(v.field)}: {v.description}"
            for d in err.details
            if isinstance(d, error_details_pb2.BadRequest)
            for v in d.field_violations
        ) or message
    return {"error": {"message": http_words(message), "type": kind, "param": param,
                      "code": reason}}


def error_response(
    err: ServiceError, status: int | None = None, close: bool = False
) -> JSONResponse:
    """The error's JSON answer; ``status`` overrides the code's (413 for a body past its
    limit), ``close`` ends the connection after it (the request's body left unread)."""
    headers = {}
    after = retry_after(err)
    if after is not None:
        headers["Retry-After"] = after
    if close:
        headers["Connection"] = "close"
    return JSONResponse(
        error_body(err), status_code=status or http_status(err), headers=headers
    )
