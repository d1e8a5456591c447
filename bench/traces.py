"""Per-request timing traces and the vLLM `bench serve`-style summary built from them."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.common import percentile


@dataclass(slots=True)
class RequestTrace:
    """Client-side clock readings of one streamed request (perf_counter seconds)."""

    tenant: str
    prompt_tokens: int
    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    output_tokens: int = 0
    cached_tokens: int = 0
    end: float = 0.0
    finish_reason: str = ""
    token_ids: list[int] = field(default_factory=list)  # the generated ids, where the front gives them

    def on_chunk(self, now: float, num_tokens: int, ids: Sequence[int] = ()) -> None:
        if num_tokens:
            self.chunk_times.append(now)
            self.output_tokens += num_tokens
            self.token_ids.extend(ids)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, as vLLM defines it."""
        if self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]


def summarize(traces: Sequence[RequestTrace], wall_s: float) -> dict[str, Any]:
    """Request rate, token throughput and TTFT/TPOT/ITL p50/p99 in milliseconds."""
    done = [t for t in traces if t.chunk_times]
    ttft = [t.ttft for t in done]
    tpot = [p for t in done if (p := t.tpot) is not None]
    itl = [x for t in done for x in t.itls]
    out_tokens = sum(t.output_tokens for t in traces)
    return {
        "requests": len(traces),
        "completed": len(done),
        "wall_s": wall_s,
        "req_s": len(done) / wall_s,
        "output_tok_s": out_tokens / wall_s,
        "total_tok_s": (out_tokens + sum(t.prompt_tokens for t in traces)) / wall_s,
        "output_tokens": out_tokens,
        **_ms("ttft", ttft),
        **_ms("tpot", tpot),
        **_ms("itl", itl),
    }


def by_tenant(traces: Iterable[RequestTrace], wall_s: float) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[RequestTrace]] = {}
    for t in traces:
        groups.setdefault(t.tenant, []).append(t)
    return {name: summarize(ts, wall_s) for name, ts in sorted(groups.items())}


def _ms(name: str, values: Sequence[float]) -> dict[str, float]:
    return {
        f"{name}_mean_ms": 1000 * sum(values) / len(values) if values else float("nan"),
        f"{name}_p50_ms": 1000 * percentile(values, 50),
        f"{name}_p99_ms": 1000 * percentile(values, 99),
    }
