"""Structured logs: one JSON object per line (console rendering on a TTY).

``make_logger`` returns a logger bound to its own stream and processors, which the server
passes to whatever logs. Only the ``serve`` process also configures structlog globally, so the
engine's and model's module loggers print in the same format from the first line. Prompt and output text are never
logged unless the server runs with ``--log-content``; callers bind ``tenant``,
``request_id``, ``peer`` and timings instead.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog
from structlog.typing import FilteringBoundLogger, Processor

LogFormat = Literal["json", "console", "auto"]


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at write time.

    NOTE: the global structlog configuration outlives the call that made it; binding the
    stream object itself would keep writing to a stream that was replaced and closed since
    (pytest's capture does exactly that between tests).
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def make_logger(
    fmt: LogFormat = "auto",
    stream: TextIO | None = None,
    level: int = logging.INFO,
    *,
    module_loggers: bool = False,
) -> FilteringBoundLogger:
    """A structlog logger writing to ``stream`` (stderr by default).

    ``auto`` picks the console renderer when ``stream`` is a TTY and JSON otherwise.
    ``module_loggers=True`` (the ``serve`` process only) also routes the engine's and model's
    ``structlog.get_logger`` loggers through the same format and stream, so a server prints
    one log format from its first line.
    """
    out = stream if stream is not None else sys.stderr
    if fmt == "auto":
        fmt = "console" if out.isatty() else "json"
    renderer: Processor = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    processors: list[Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]
    if module_loggers:
        structlog.configure(
            processors=processors,
            logger_factory=structlog.PrintLoggerFactory(
                file=out if stream is not None else _CurrentStderr()  # type: ignore[arg-type]
            ),
            wrapper_class=structlog.make_filtering_bound_logger(level),
            cache_logger_on_first_use=False,
        )
    logger: FilteringBoundLogger = structlog.wrap_logger(
        structlog.PrintLogger(file=out),
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=False,
    )
    return logger.bind(service="kvfence")
