"""What the process tells its operators: ``logs`` (structlog setup), ``metrics`` (Prometheus
on a dedicated registry), ``request_metrics`` (the series one generation records, on both
fronts) and ``tracing`` (OpenTelemetry spans over OTLP)."""
