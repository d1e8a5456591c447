"""What the HTTP front's routes share with the gRPC server (``FrontDeps``), and the
steps every authenticated route takes first: the caller's tenant, its deadline and its body
limit."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import Request as HttpRequest
from structlog.typing import FilteringBoundLogger

from service.admission.auth import Authenticator
from service.admission.gate import Admission
from service.admission.limiter import Limiter
from service.admission.prep import RequestPrep
from service.admission.request_fields import prompt_token_limit
from service.admission.request_size import JSON_BYTES_PER_TOKEN, request_limit, too_large
from service.admission.tenant_adapters import Adapters
from service.admission.tenants import Tenant
from service.errors import invalid_argument, unavailable
from service.http.body import MAX_BODY_BYTES
from service.protocols import EngineLike
from service.telemetry.metrics import Metrics
from service.telemetry.request_metrics import PageAlert
from service.telemetry.tracing import Tracing

TIMEOUT_HEADER = "x-kvfence-timeout"


@dataclass(frozen=True, slots=True)
class FrontDeps:
    """Everything the HTTP front shares with the gRPC server."""

    engine: EngineLike
    admission: Admission
    prep: RequestPrep
    limiter: Limiter
    authenticator: Authenticator
    metrics: Metrics
    log: FilteringBoundLogger
    is_draining: Callable[[], bool]
    clock: Callable[[], float] = time.monotonic
    alert: PageAlert = field(default_factory=lambda: PageAlert(page_size=1))  # off
    tracing: Tracing = field(default_factory=Tracing.off)
    adapters: Adapters | None = None  # None = the base model alone
    wall: Callable[[], float] = time.time
    # Keys the hashed end-user ids in the log: stable for the process's life, and without it
    # a log reader cannot confirm a guessed user id.
    user_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    metrics_on_http: bool = False  # --metrics-on-http: GET /metrics here too


def tenant_of(deps: FrontDeps, request: HttpRequest) -> Tenant:
    """The tenant ``Authorization`` names; raises ServiceError (UNAVAILABLE while draining)."""
    if deps.is_draining():
        raise unavailable("server is shutting down")
    headers = [("authorization", v) for v in request.headers.getlist("authorization")]
    return deps.authenticator.authenticate(headers, {})


def deadline_of(deps: FrontDeps, request: HttpRequest) -> float | None:
    """The request's deadline on ``deps.clock`` from its ``x-kvfence-timeout`` header
    (seconds), or None; INVALID_ARGUMENT when the header is not a positive number."""
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise invalid_argument([(TIMEOUT_HEADER, "must be a positive number of seconds")])
    return deps.clock() + seconds


def body_limit(deps: FrontDeps, tenant: Tenant) -> tuple[int, Callable[[int], str]]:
    """The most body bytes ``tenant`` may send (``service/admission/request_size.py``), and the words
    of the refusal past it."""
    tokens = prompt_token_limit(deps.prep.model, tenant.quotas.max_prompt_tokens)
    limit = request_limit(tokens, JSON_BYTES_PER_TOKEN, MAX_BODY_BYTES)
    return limit, lambda size: too_large(size, limit, tokens, JSON_BYTES_PER_TOKEN)
