"""Python clients for kvfence: Client (blocking) and AsyncClient (asyncio).

Imports only grpc, protobuf, grpcio-status, tenacity, structlog and the protos, so that the
base install (no torch) can talk to a server.
"""

from clients.aio import AsyncClient
from clients.channel import TlsConfig
from clients.client import Client
from clients.errors import (
    Cancelled,
    ClientError,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    KvfenceError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from clients.retry import RetryPolicy
from clients.types import (
    AdapterUsage,
    CacheUsage,
    Chunk,
    Finished,
    GenerateEvent,
    GenerateResult,
    ModelInfo,
    Started,
    Tokenized,
    Usage,
)

__all__ = [
    "AdapterUsage",
    "AsyncClient",
    "CacheUsage",
    "Cancelled",
    "Chunk",
    "Client",
    "ClientError",
    "DeadlineExceeded",
    "Finished",
    "GenerateEvent",
    "GenerateResult",
    "Internal",
    "InvalidArgument",
    "KvfenceError",
    "ModelInfo",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RetryPolicy",
    "Started",
    "TlsConfig",
    "Tokenized",
    "Unauthenticated",
    "Unavailable",
    "Usage",
]
