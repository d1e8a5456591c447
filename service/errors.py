"""Service errors and how each maps to a gRPC status with ``google.rpc.Status`` details.

| Case                                                     | Code                | Details                       |
|----------------------------------------------------------|---------------------|-------------------------------|
| no credential, unknown/revoked key, duplicate            | UNAUTHENTICATED     | ErrorInfo(reason)             |
|   ``authorization`` headers, unmapped client cert        |                     |                               |
| valid credential, action not allowed (model not in the   | PERMISSION_DENIED   | ErrorInfo(reason)             |
|   tenant's ``models``, reflection without permission)    |                     |                               |
| malformed request: empty/oversized prompt, token id out  | INVALID_ARGUMENT    | BadRequest(field_violations)  |
|   of range, NaN/out-of-range sampling, max_tokens <= 0,  |                     |                               |
|   prompt + max_tokens over context, bad stop strings,    |                     |                               |
|   huge chat messages, unknown model, request bytes that  |                     |                               |
|   do not parse (service/grpc/wire.py)                         |                     |                               |
| concurrency quota, tokens-per-minute, tenant queue full, | RESOURCE_EXHAUSTED  | QuotaFailure, RetryInfo (when |
|   KV page quota, request larger than the KV pool         |                     |   waiting can help)           |
| message larger than the receive limit (8 MiB)            | RESOURCE_EXHAUSTED  | (set by gRPC itself)          |
| server draining (SIGTERM) or engine stopped              | UNAVAILABLE         | RetryInfo                     |
| request deadline passed (engine ``deadline``)            | DEADLINE_EXCEEDED   |                               |
| client cancelled                                         | CANCELLED           | (set by gRPC itself)          |
| KV fence violation: request aborted before any token     | INTERNAL            | ErrorInfo(reason="KV_FENCE")  |
|   that depends on the bad page is sent                   |                     |                               |
| any other engine failure                                 | INTERNAL            | ErrorInfo(reason="ENGINE")    |

Error messages never carry prompt or output text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NoReturn, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "kvfence.dev"


DetailT = TypeVar("DetailT", bound=Message)


class ServiceError(Exception):
    """An error the servicer turns into a gRPC status (see the table above)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, details: Sequence[Message] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = tuple(details)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def detail(self, kind: type[DetailT]) -> DetailT:
        """The first of :attr:`details` of type ``kind`` (``ErrorInfo``, ``RetryInfo``, ...);
        ``LookupError`` when it carries none."""
        for d in self.details:
            if isinstance(d, kind):
                return d
        raise LookupError(f"{self} carries no {kind.__name__}")

    def to_status(self) -> grpc.Status:
        packed = []
        for detail in self.details:
            item = any_pb2.Any()
            item.Pack(detail)
            packed.append(item)
        proto = status_pb2.Status(
            code=getattr(code_pb2, self.code.name), message=self.message, details=packed
        )
        return rpc_status.to_status(proto)


async def abort(context: grpc.aio.ServicerContext, error: ServiceError) -> NoReturn:
    await context.abort_with_status(error.to_status())
    raise AssertionError("abort_with_status returned")  # pragma: no cover


def _error_info(reason: str, **metadata: str) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata)


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    whole = math.floor(seconds)
    nanos = min(int((seconds - whole) * 1e9), 999_999_999)
    return error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=whole, nanos=nanos)
    )


def unauthenticated(message: str, reason: str = "UNAUTHENTICATED") -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAUTHENTICATED, message, (_error_info(reason),))


def permission_denied(message: str, reason: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.PERMISSION_DENIED, message, (_error_info(reason),))


#: (field path, description) pairs: a request's problems, reported together.
Violations = list[tuple[str, str]]


def raise_if(violations: Violations) -> None:
    """INVALID_ARGUMENT with every violation, if there is any."""
    if violations:
        raise invalid_argument(violations)


def invalid_argument(violations: Sequence[tuple[str, str]]) -> ServiceError:
    """``violations`` are (field path, description) pairs."""
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
            for f, d in violations
        ]
    )
    message = "; ".join(f"{f}: {d}" for f, d in violations)
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, (bad,))


def resource_exhausted(
    subject: str, description: str, retry_after_s: float | None = None
) -> ServiceError:
    """A quota or capacity limit. ``retry_after_s`` only when waiting can help."""
    details: list[Message] = [
        error_details_pb2.QuotaFailure(
            violations=[
                error_details_pb2.QuotaFailure.Violation(subject=subject, description=description)
            ]
        )
    ]
    if retry_after_s is not None:
        details.append(_retry_info(retry_after_s))
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, description, tuple(details))


def unavailable(message: str, retry_after_s: float = 1.0) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, (_retry_info(retry_after_s),))


def deadline_exceeded() -> ServiceError:
    return ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed")


def cancelled() -> ServiceError:
    return ServiceError(grpc.StatusCode.CANCELLED, "request cancelled")


def fence_violation() -> ServiceError:
    return ServiceError(
        grpc.StatusCode.INTERNAL,
        "request aborted: KV cache isolation check failed",
        (_error_info("KV_FENCE"),),
    )


def internal(reason: str = "ENGINE", cause: str = "") -> ServiceError:
    """INTERNAL; ``cause`` (the engine's words for one request's failure, naming no prompt or
    output text) follows the message where there is one."""
    message = f"internal engine error: {cause}" if cause else "internal engine error"
    return ServiceError(grpc.StatusCode.INTERNAL, message, (_error_info(reason),))
