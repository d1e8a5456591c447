"""Typed errors: one KvfenceError subclass per gRPC status, with the parsed rich details.

The server attaches a `google.rpc.Status` in the `grpc-status-details-bin` trailer; its
details (RetryInfo, ErrorInfo, BadRequest, QuotaFailure) are unpacked here so that callers
never touch raw trailers.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


class ClientError(ValueError):
    """Bad arguments or configuration, caught locally before anything is sent."""


@dataclass(frozen=True, slots=True)
class ErrorDetails:
    """The rich details a server attached to a failed call (each one optional)."""

    retry_info: error_details_pb2.RetryInfo | None = None
    error_info: error_details_pb2.ErrorInfo | None = None
    bad_request: error_details_pb2.BadRequest | None = None
    quota_failure: error_details_pb2.QuotaFailure | None = None

    @property
    def retry_delay(self) -> float | None:
        """Seconds the server asked the client to wait, when it sent RetryInfo."""
        if self.retry_info is None:
            return None
        return float(self.retry_info.retry_delay.ToTimedelta().total_seconds())


class KvfenceError(Exception):
    """A call failed with a non-OK gRPC status. `str(err)` is `CODE: message`."""

    def __init__(
        self, code: grpc.StatusCode, message: str, details: ErrorDetails | None = None
    ) -> None:
        self.code = code
        self.message = message
        self.details = details if details is not None else ErrorDetails()
        super().__init__(f"{code.name}: {message}")

    @property
    def retry_delay(self) -> float | None:
        return self.details.retry_delay


class Cancelled(KvfenceError): ...


class Unknown(KvfenceError): ...


class InvalidArgument(KvfenceError): ...


class DeadlineExceeded(KvfenceError): ...


class NotFound(KvfenceError): ...


class AlreadyExists(KvfenceError): ...


class PermissionDenied(KvfenceError): ...


class ResourceExhausted(KvfenceError): ...


class FailedPrecondition(KvfenceError): ...


class Aborted(KvfenceError): ...


class OutOfRange(KvfenceError): ...


class Unimplemented(KvfenceError): ...


class Internal(KvfenceError): ...


class Unavailable(KvfenceError): ...


class DataLoss(KvfenceError): ...


class Unauthenticated(KvfenceError): ...


_BY_CODE: dict[grpc.StatusCode, type[KvfenceError]] = {
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNKNOWN: Unknown,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def error_for(
    code: grpc.StatusCode, message: str, details: ErrorDetails | None = None
) -> KvfenceError:
    """The typed exception for `code` (KvfenceError itself for codes without a subclass)."""
    return _BY_CODE.get(code, KvfenceError)(code, message, details)


def from_rpc_error(error: grpc.RpcError) -> KvfenceError:
    """Convert a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`)."""
    code: grpc.StatusCode = error.code()
    message = str(error.details() or "")
    return error_for(code, message, _parse_details(error))


def _parse_details(call: grpc.RpcError) -> ErrorDetails:
    try:
        status: status_pb2.Status | None = rpc_status.from_call(call)
    except ValueError:
        # NOTE: a Status whose code/message disagree with the call's own is not trusted.
        return ErrorDetails()
    if status is None:
        return ErrorDetails()
    retry_info = error_details_pb2.RetryInfo()
    error_info = error_details_pb2.ErrorInfo()
    bad_request = error_details_pb2.BadRequest()
    quota_failure = error_details_pb2.QuotaFailure()
    seen: set[str] = set()
    for detail in status.details:
        for message in (retry_info, error_info, bad_request, quota_failure):
            name = message.DESCRIPTOR.full_name
            if name not in seen and detail.Is(message.DESCRIPTOR):
                detail.Unpack(message)
                seen.add(name)
    return ErrorDetails(
        retry_info=retry_info if retry_info.DESCRIPTOR.full_name in seen else None,
        error_info=error_info if error_info.DESCRIPTOR.full_name in seen else None,
        bad_request=bad_request if bad_request.DESCRIPTOR.full_name in seen else None,
        quota_failure=quota_failure if quota_failure.DESCRIPTOR.full_name in seen else None,
    )
