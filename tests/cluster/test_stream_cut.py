"""A stream that a proxy ends without a gRPC status (its replica died) reaches the caller as
Unavailable, as a lost direct connection does; other UNKNOWN errors stay Unknown."""

from __future__ import annotations

import grpc

from clients.errors import Unavailable, Unknown, from_rpc_error
from clients.retry import is_retryable


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_a_stream_removed_without_status_is_unavailable() -> None:
    err = from_rpc_error(
        _Failed(grpc.StatusCode.UNKNOWN, "Stream removed (Data frame with END_STREAM flag received)")
    )
    assert isinstance(err, Unavailable)
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert is_retryable(err)  # before the first token the client may retry it


def test_other_unknown_errors_stay_unknown() -> None:
    err = from_rpc_error(_Failed(grpc.StatusCode.UNKNOWN, "Exception iterating responses"))
    assert isinstance(err, Unknown) and not is_retryable(err)
