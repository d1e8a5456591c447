"""OpenTelemetry spans for generation requests, exported over OTLP when
``--otlp-endpoint`` is set.

Off (the default) costs nothing: ``Tracing.off()`` hands out a no-op trace and nothing
imports opentelemetry. On, each request is one ``kvfence.request`` span with children:
``auth`` (the tenant check: in the HTTP route, or in the gRPC interceptor, which hands its
timing to the handler), ``tokenize`` (tokenizing, the context check and any grammar
compile), and per sequence ``queue``, ``prefill`` and ``decode`` from the engine's own timings, and ``stream`` (first to
last delta as the front handed them on). Attributes carry the tenant, the front, the request
id, token counts and the outcome: never prompt or output text.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from structlog.typing import FilteringBoundLogger

from service.engine.types import Finished

# The OTLP/gRPC exporter's own logger: it logs every retry and every failed batch.
_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"


class RequestTrace:
    """One request's spans; this base class is the no-op used when tracing is off."""

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        yield

    def timed(self, name: str, start_ns: int, end_ns: int) -> None:
        """A child span that already ran (wall-clock nanoseconds)."""

    def submitted(self) -> None:
        """The first sequence went to the engine now (the engine timings count from here)."""

    def delta(self, seq: int) -> None:
        """Sequence ``seq`` handed a delta to the client now."""

    def finished(self, seq: int, event: Finished) -> None:
        """Sequence ``seq`` ended: its queue, prefill, decode and stream spans."""

    def end(self, code: str) -> None:
        """The request's outcome (a gRPC status name); closes the root span."""


class Tracing:
    """Hands out request traces: no-ops when off, OpenTelemetry spans when on."""

    def __init__(self, tracer: Any = None, provider: Any = None) -> None:
        self._tracer = tracer
        self._provider = provider

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def otlp(cls, endpoint: str, log: FilteringBoundLogger) -> Tracing:
        """Spans batched and exported over OTLP/gRPC to ``endpoint`` (host:port or URL).
        Failed exports are reported by :class:`ExportReporter`, not by the exporter's own
        per-batch and per-retry log lines (filtered out)."""
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        logger = logging.getLogger(_EXPORTER_LOGGER)
        if not any(isinstance(f, _ExportNoise) for f in logger.filters):
            logger.addFilter(_ExportNoise())
        # NOTE: Any: the reporter is a SpanExporter by shape, not by base class (see there).
        reporter: Any = ExportReporter(OTLPSpanExporter(endpoint=endpoint), endpoint, log)
        return cls.with_processor(BatchSpanProcessor(reporter))

    @classmethod
    def with_processor(cls, processor: Any) -> Tracing:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        # NOTE: a provider of our own, not the global one: no module-level state.
        provider = TracerProvider(resource=Resource.create({"service.name": "kvfence"}))
        provider.add_span_processor(processor)
        return cls(provider.get_tracer("kvfence"), provider)

    def close(self) -> None:
        """Export what is still queued and stop the exporter (the server's close)."""
        if self._provider is not None:
            self._provider.shutdown()

    def request(
        self, tenant: str, front: str, request_id: str, start_ns: int | None = None
    ) -> RequestTrace:
        """A request's trace; its root span starts at ``start_ns`` (default now)."""
        if self._tracer is None:
            return _OFF
        return _OtelTrace(self._tracer, tenant, front, request_id, start_ns)


_OFF = RequestTrace()


class ExportReporter:
    """A span exporter around another that reports failed exports as one structured line
    (``tracing.export_failed``: the endpoint, failed batches and spans dropped since the last
    line) at most every ``every_s`` seconds, and ``tracing.export_recovered`` once exports
    succeed again. An unreachable collector costs one line a minute, not a line per batch
    and per retry. Duck-types the SDK's ``SpanExporter`` (export, shutdown, force_flush) so
    that nothing imports opentelemetry while tracing is off."""

    def __init__(
        self,
        inner: Any,
        endpoint: str,
        log: FilteringBoundLogger,
        *,
        clock: Callable[[], float] = time.monotonic,
        every_s: float = 60.0,
    ) -> None:
        self._inner = inner
        self._endpoint = endpoint
        self._log = log
        self._clock = clock
        self._every_s = every_s
        self._last_line: float | None = None  # when export_failed was last logged
        self._batches = 0  # failed since the last line
        self._spans = 0
        self._failing = False

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self._inner.export(spans)
        except Exception:  # the exporter's bug must not kill the processor's thread
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            if self._failing:
                self._log.info("tracing.export_recovered", endpoint=self._endpoint)
            self._failing, self._batches, self._spans = False, 0, 0
            return result
        self._failing = True
        self._batches += 1
        self._spans += len(spans)
        now = self._clock()
        if self._last_line is None or now - self._last_line >= self._every_s:
            self._log.warning(
                "tracing.export_failed",
                endpoint=self._endpoint,
                batches=self._batches,
                spans_dropped=self._spans,
                next_report_s=self._every_s,
            )
            self._last_line, self._batches, self._spans = now, 0, 0
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._inner.force_flush(timeout_millis))


class _ExportNoise(logging.Filter):
    """Drops the OTLP exporter's per-batch failure and per-retry lines (ExportReporter
    reports them); its other lines pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Failed to export", "Transient error"))


class _OtelTrace(RequestTrace):
    def __init__(
        self, tracer: Any, tenant: str, front: str, request_id: str, start_ns: int | None
    ) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._tracer = tracer
        self._root = tracer.start_span("kvfence.request", start_time=start_ns, attributes={
            "kvfence.tenant": tenant, "kvfence.front": front, "kvfence.request_id": request_id,
        })
        self._ctx = trace.set_span_in_context(self._root)
        self._submitted_ns = 0
        self._first: dict[int, int] = {}
        self._last: dict[int, int] = {}

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        with self._tracer.start_as_current_span(name, context=self._ctx):
            yield

    def submitted(self) -> None:
        self._submitted_ns = time.time_ns()

    def delta(self, seq: int) -> None:
        now = time.time_ns()
        self._first.setdefault(seq, now)
        self._last[seq] = now

    def finished(self, seq: int, event: Finished) -> None:
        base = self._submitted_ns or time.time_ns()
        queue_end = base + int(event.queue_s * 1e9)
        first_token = base + int((event.ttft_s or event.total_s) * 1e9)
        end = base + int(event.total_s * 1e9)
        attrs = {"kvfence.sequence": seq}
        self._timed("queue", base, queue_end, attrs)
        self._timed("prefill", queue_end, max(queue_end, first_token),
                    {**attrs, "kvfence.prompt_tokens": event.prompt_tokens,
                     "kvfence.cached_tokens": event.cached_tokens})
        self._timed("decode", max(queue_end, first_token), max(queue_end, first_token, end),
                    {**attrs, "kvfence.completion_tokens": event.completion_tokens,
                     "kvfence.finish_reason": event.reason})
        if seq in self._first:
            self._timed("stream", self._first[seq], self._last[seq], attrs)

    def timed(self, name: str, start_ns: int, end_ns: int) -> None:
        self._timed(name, start_ns, end_ns, {})

    def _timed(self, name: str, start: int, end: int, attrs: dict[str, Any]) -> None:
        span = self._tracer.start_span(name, context=self._ctx, start_time=start,
                                       attributes=attrs)
        span.end(end_time=end)

    def end(self, code: str) -> None:
        self._root.set_attribute("kvfence.code", code)
        if code != "OK":
            self._root.set_status(self._trace.Status(self._trace.StatusCode.ERROR, code))
        self._root.end()
