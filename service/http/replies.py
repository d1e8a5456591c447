"""What the two answers to an OpenAI generation share: the started request they answer
(``Started``), and how a failure is logged without its text (``where``).

The answer is a server-sent event stream (``stream_reply``) or one JSON body
(``body_reply``), chosen by the request's ``stream`` field; both read the admitted
``Generation``'s events already counted (the request's metrics, the adapter's usage),
split (tool calls out of the text) and checked (an abnormal finish raises its
``ServiceError``), as on gRPC, so they only render them.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from structlog.typing import FilteringBoundLogger

from service.admission.generation import Generation
from service.http import render
from service.http.parse import HttpOptions
from service.telemetry.request_metrics import RequestMetrics


@dataclass(frozen=True, slots=True)
class Started:
    """A generation admitted and submitted, and what its answer needs."""

    gen: Generation
    head: render.ChunkHeader
    opts: HttpOptions
    recorder: RequestMetrics
    method: str
    log: FilteringBoundLogger


def where(exc: BaseException) -> dict[str, str]:
    """The exception type and the innermost frame, without the message (it may quote input)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return {"error": type(exc).__name__, "at": f"{frames[-1].filename}:{frames[-1].lineno}"
            if frames else ""}
