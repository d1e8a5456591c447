"""Channels and credentials.

Over TLS the API key travels as call credentials (composited with the SSL channel
credentials), so gRPC attaches it only to calls on a secure channel. On an insecure channel
gRPC refuses call credentials, so the key is sent as plain `authorization: Bearer <key>`
metadata on every call instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from clients.errors import ClientError

DEFAULT_TARGET = "127.0.0.1:50051"
TARGET_ENV = "KVFENCE_TARGET"
API_KEY_ENV = "KVFENCE_API_KEY"

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS settings. No CA file means the system roots; a cert and key together enable mTLS."""

    ca_file: str | Path | None = None
    cert_file: str | Path | None = None
    key_file: str | Path | None = None
    server_name: str | None = None  # name to check the server certificate against

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ClientError("mTLS needs both a client certificate and its key")

    def channel_credentials(self) -> Any:
        """`grpc.ChannelCredentials` built from the files (read now, not at call time)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "CA certificate"),
            private_key=_read(self.key_file, "client key"),
            certificate_chain=_read(self.cert_file, "client certificate"),
        )


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ClientError(f"cannot read {what} {str(path)!r}: {e.strerror}") from None


def resolve_api_key(api_key: str | None) -> str | None:
    """The explicit key, else $KVFENCE_API_KEY, else None (mTLS-only or no auth)."""
    if api_key is not None:
        return api_key or None
    return os.environ.get(API_KEY_ENV) or None


class _BearerAuth:
    """A grpc.AuthMetadataPlugin: adds the bearer key to every call on a secure channel."""

    def __init__(self, api_key: str) -> None:
        self._metadata = (("authorization", f"Bearer {api_key}"),)

    def __call__(self, context: object, callback: Callable[[Metadata, None], None]) -> None:
        callback(self._metadata, None)


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    target: str
    api_key: str | None = None
    tls: TlsConfig | None = None
    options: tuple[tuple[str, str | int], ...] = ()

    def __post_init__(self) -> None:
        if not self.target:
            raise ClientError("target must be host:port")
        if self.api_key is not None and any(c in self.api_key for c in "\r\n"):
            raise ClientError("API key must be a single line")

    def call_metadata(self) -> Metadata:
        """Per-call metadata: the bearer key, but only where call credentials cannot carry it."""
        if self.tls is None and self.api_key:
            return (("authorization", f"Bearer {self.api_key}"),)
        return ()

    def _all_options(self) -> list[tuple[str, str | int]]:
        options = list(self.options)
        if self.tls is not None and self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return options

    def _credentials(self) -> Any:
        assert self.tls is not None
        credentials = self.tls.channel_credentials()
        if self.api_key:
            call = grpc.metadata_call_credentials(_BearerAuth(self.api_key), name="kvfence")
            credentials = grpc.composite_channel_credentials(credentials, call)
        return credentials

    def open(self) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.target, options=self._all_options())
        return grpc.secure_channel(self.target, self._credentials(), options=self._all_options())

    def open_aio(self) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(self.target, options=self._all_options())
        return grpc.aio.secure_channel(
            self.target, self._credentials(), options=self._all_options()
        )
