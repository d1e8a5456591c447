"""Failed OTLP exports are one rate-limited structured line (service/telemetry/tracing.py ExportReporter)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
from opentelemetry.sdk.trace.export import SpanExportResult
from structlog.testing import capture_logs

from service.telemetry.tracing import ExportReporter


class Collector:
    """A span exporter whose collector is up or down as the test says."""

    def __init__(self) -> None:
        self.up = False
        self.batches: list[int] = []

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.batches.append(len(spans))
        return SpanExportResult.SUCCESS if self.up else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def test_failures_are_one_line_per_interval_with_what_was_dropped() -> None:
    now = [0.0]
    collector = Collector()
    with capture_logs() as logs:
        reporter = ExportReporter(collector, "otel:4317", structlog.get_logger(),
                                  clock=lambda: now[0], every_s=60.0)
        for t, spans in [(0.0, 3), (10.0, 2), (59.0, 1), (60.0, 4), (61.0, 5)]:
            now[0] = t
            assert reporter.export([object()] * spans) == SpanExportResult.FAILURE
        collector.up = True
        now[0] = 62.0
        assert reporter.export([object()]) == SpanExportResult.SUCCESS
        assert reporter.export([object()]) == SpanExportResult.SUCCESS
    assert collector.batches == [3, 2, 1, 4, 5, 1, 1]
    assert logs == [
        {"event": "tracing.export_failed", "log_level": "warning", "endpoint": "otel:4317",
         "batches": 1, "spans_dropped": 3, "next_report_s": 60.0},
        {"event": "tracing.export_failed", "log_level": "warning", "endpoint": "otel:4317",
         "batches": 3, "spans_dropped": 7, "next_report_s": 60.0},
        {"event": "tracing.export_recovered", "log_level": "info", "endpoint": "otel:4317"},
    ]


def test_an_exporter_that_raises_counts_as_a_failed_export() -> None:
    class Broken(Collector):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            raise RuntimeError("boom")

    with capture_logs() as logs:
        reporter = ExportReporter(Broken(), "otel:4317", structlog.get_logger())
        assert reporter.export([object()]) == SpanExportResult.FAILURE
    assert [entry["event"] for entry in logs] == ["tracing.export_failed"]
