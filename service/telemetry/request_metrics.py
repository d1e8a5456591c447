"""The per-tenant series one generation request records: the one place both fronts (gRPC
``Generate`` and the OpenAI-compatible HTTP routes) record them, so they count alike.

Per engine sequence: inter-token gaps as the front receives its deltas, then on ``Finished``
prompt, completion and cached tokens and the time to first token. Per request: one
``kvfence_requests`` sample with the status code, and for a refusal (an error the caller
gets instead of a generation) one ``kvfence_refusals`` sample with the reason. Every series
carries ``front`` ("grpc" or "http"). The request's trace (``service.telemetry.tracing``; a no-op
when tracing is off) is fed at the same points.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from google.rpc import error_details_pb2
from structlog.typing import FilteringBoundLogger

from service.engine.types import Finished
from service.errors import ServiceError
from service.telemetry.metrics import Metrics
from service.telemetry.tracing import RequestTrace

Front = Literal["grpc", "http"]

#: Outcomes that are not refusals: the request ran and ended this way.
_NOT_REFUSALS = frozenset({"OK", "CANCELLED", "DEADLINE_EXCEEDED", "INTERNAL"})


@dataclass(frozen=True, slots=True)
class PageAlert:
    """Warn (log and ``kvfence_kv_alerts{kind="request"}``) when one request's KV passes
    ``threshold`` pages of ``page_size`` tokens; ``threshold`` 0 = off."""

    page_size: int
    threshold: int = 0


def refusal_reason(err: ServiceError) -> str:
    """A bounded label: the quota subject or ErrorInfo reason, else the code's name."""
    for detail in err.details:
        if isinstance(detail, error_details_pb2.QuotaFailure) and detail.violations:
            return str(detail.violations[0].subject)
        if isinstance(detail, error_details_pb2.ErrorInfo):
            return str(detail.reason)
    return str(err.code.name).lower()


class RequestMetrics:
    """Records one request's series under (tenant, front)."""

    def __init__(
        self,
        metrics: Metrics,
        tenant: str,
        front: Front,
        alert: PageAlert,
        log: FilteringBoundLogger,
        trace: RequestTrace | None = None,
    ) -> None:
        self.trace = trace if trace is not None else RequestTrace()
        self._m = metrics
        self._label = metrics.label(tenant)
        self._front = front
        self._alert = alert
        self._log = log
        self._inter_token = metrics.inter_token.labels(self._label, front)  # once per request
        self._alerted = False

    def sequence(
        self, prompt_tokens: int, clock: Callable[[], float], index: int = 0
    ) -> SequenceMetrics:
        """The recorder of engine sequence ``index`` of this request."""
        return SequenceMetrics(self, prompt_tokens, clock, index)

    def _finished(self, event: Finished) -> None:
        label, front = self._label, self._front
        self._m.prompt_tokens.labels(label, front).inc(event.prompt_tokens)
        self._m.completion_tokens.labels(label, front).inc(event.completion_tokens)
        self._m.cached_tokens.labels(label, front).inc(event.cached_tokens)
        if event.ttft_s is not None:
            self._m.ttft.labels(label, front).observe(event.ttft_s)

    def done(self, method: str, code: str, error: ServiceError | None = None) -> None:
        """The request's outcome: ``code`` is a gRPC status name."""
        self._m.requests.labels(self._label, method, code, self._front).inc()
        self.trace.end(code)
        if error is not None and code not in _NOT_REFUSALS:
            reason = refusal_reason(error)
            self._m.refusals.labels(self._label, self._front, code, reason).inc()

    def _check_pages(self, tokens: int) -> None:
        threshold = self._alert.threshold
        if self._alerted or threshold <= 0:
            return
        pages = math.ceil(tokens / self._alert.page_size)
        if pages > threshold:
            self._alerted = True
            self._log.warning("kv.alert.request_pages", pages=pages, threshold=threshold)
            self._m.kv_alerts.labels(self._label, "request").inc()


class SequenceMetrics:
    """Inter-token gaps of one sequence, measured where the front receives its deltas."""

    def __init__(
        self, owner: RequestMetrics, prompt_tokens: int, clock: Callable[[], float], index: int
    ) -> None:
        self._owner = owner
        self._index = index
        self._clock = clock
        self._tokens = prompt_tokens
        self._completion = 0
        self._last = 0.0

    def delta(self, num_tokens: int) -> None:
        now = self._clock()
        if self._completion:
            self._owner._inter_token.observe(now - self._last)
        self._last = now
        self._completion += num_tokens
        self._owner._check_pages(self._tokens + self._completion)
        self._owner.trace.delta(self._index)

    def finished(self, event: Finished) -> None:
        """Prompt, completion and cached tokens and the TTFT of the sequence."""
        self._owner._finished(event)
        self._owner.trace.finished(self._index, event)
