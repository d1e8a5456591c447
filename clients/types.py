"""Typed results of the kvfence API: what clients hand back instead of raw protos."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from protos.kvfence.v1 import cache_pb2, inference_pb2

FinishReason: TypeAlias = Literal["unspecified", "stop", "length", "abort", "deadline", "error"]

_FINISH_REASONS: dict[int, FinishReason] = {
    inference_pb2.FINISH_REASON_UNSPECIFIED: "unspecified",
    inference_pb2.FINISH_REASON_STOP: "stop",
    inference_pb2.FINISH_REASON_LENGTH: "length",
    inference_pb2.FINISH_REASON_ABORT: "abort",
    inference_pb2.FINISH_REASON_DEADLINE: "deadline",
    inference_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class Started:
    """The server admitted the request. Always the first event of a stream."""

    request_id: str
    client_request_id: str
    prompt_tokens: int
    cached_prompt_tokens: int
    model: str


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Newly generated tokens and their UTF-8-safe text delta."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    queue_s: float
    ttft_s: float
    total_s: float


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a stream."""

    reason: FinishReason
    usage: Usage
    timings: Timings


GenerateEvent: TypeAlias = Started | Chunk | Finished


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A whole generation, collected from its events."""

    text: str
    finish_reason: FinishReason
    usage: Usage
    token_ids: tuple[int, ...] = ()
    request_id: str = ""
    timings: Timings | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Tokenized:
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    dtype: str
    base_model: str = ""  # set on the caller's LoRA adapters: the model they adapt


@dataclass(frozen=True, slots=True)
class Quotas:
    max_kv_pages: int  # 0 = unlimited
    max_concurrent_streams: int
    max_prompt_tokens: int
    tokens_per_minute: int  # 0 = unlimited
    prefix_cache_ttl_s: float


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """The caller's own KV usage; no field ever describes another tenant."""

    pages_in_use: int
    pages_cached: int
    cached_prefixes: int
    prefix_hit_tokens: int
    prefix_miss_tokens: int
    hit_rate: float
    page_size: int
    running_requests: int
    quotas: Quotas
    adapters: tuple[AdapterUsage, ...] = ()  # the caller's own LoRA adapters
    shared_prefix_hit_tokens: int = 0  # read from the operator's shared prefixes
    tier_hit_tokens: int = 0  # of prefix_hit_tokens, restored from the server's KV tier
    tier_bytes: int = 0  # the caller's records in the server's KV tier


@dataclass(frozen=True, slots=True)
class AdapterUsage:
    """One of the caller's LoRA adapters: what its requests used since the server started."""

    name: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    resident: bool  # its weights are in the server's memory now


class ProtocolError(Exception):
    """The server sent something the v1 contract does not allow."""


def event_from_proto(response: inference_pb2.GenerateResponse) -> GenerateEvent:
    kind = response.WhichOneof("event")
    if kind == "started":
        s = response.started
        return Started(
            s.request_id, s.client_request_id, s.prompt_tokens, s.cached_prompt_tokens, s.model
        )
    if kind == "chunk":
        c = response.chunk
        return Chunk(tuple(c.token_ids), c.text, tuple(_logprob(lp) for lp in c.logprobs))
    if kind == "finished":
        f = response.finished
        return Finished(
            reason=_FINISH_REASONS.get(f.reason, "unspecified"),
            usage=Usage(
                f.usage.prompt_tokens, f.usage.completion_tokens, f.usage.cached_prompt_tokens
            ),
            timings=Timings(
                f.timings.queue_seconds, f.timings.ttft_seconds, f.timings.total_seconds
            ),
        )
    raise ProtocolError("GenerateResponse with no event set")


def _logprob(lp: inference_pb2.TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(
        lp.token_id, lp.logprob, tuple(TopLogprob(t.token_id, t.logprob, t.token) for t in lp.top)
    )


def tokenized_from_proto(response: inference_pb2.TokenizeResponse) -> Tokenized:
    return Tokenized(tuple(response.token_ids), tuple(response.tokens))


def models_from_proto(response: inference_pb2.ListModelsResponse) -> tuple[ModelInfo, ...]:
    return tuple(
        ModelInfo(m.name, m.architecture, m.max_model_len, m.vocab_size, m.dtype, m.base_model)
        for m in response.models
    )


def usage_from_proto(response: cache_pb2.GetUsageResponse) -> CacheUsage:
    q = response.quotas
    return CacheUsage(
        pages_in_use=response.pages_in_use,
        pages_cached=response.pages_cached,
        cached_prefixes=response.cached_prefixes,
        prefix_hit_tokens=response.prefix_hit_tokens,
        prefix_miss_tokens=response.prefix_miss_tokens,
        hit_rate=response.hit_rate,
        page_size=response.page_size,
        running_requests=response.running_requests,
        quotas=Quotas(
            q.max_kv_pages,
            q.max_concurrent_streams,
            q.max_prompt_tokens,
            q.tokens_per_minute,
            q.prefix_cache_ttl_seconds,
        ),
        adapters=tuple(
            AdapterUsage(a.name, a.requests, a.prompt_tokens, a.completion_tokens, a.resident)
            for a in response.adapters
        ),
        shared_prefix_hit_tokens=response.shared_prefix_hit_tokens,
        tier_hit_tokens=response.tier_hit_tokens,
        tier_bytes=response.tier_bytes,
    )


@dataclass(slots=True)
class ResultBuilder:
    """Folds a stream's events into one GenerateResult (shared by both clients)."""

    # All set by add() as events arrive.
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    started: Started | None = None
    finished: Finished | None = None

    def add(self, event: GenerateEvent) -> None:
        if isinstance(event, Started):
            self.started = event
        elif isinstance(event, Chunk):
            self.parts.append(event.text)
            self.token_ids.extend(event.token_ids)
            self.logprobs.extend(event.logprobs)
        else:
            self.finished = event

    def result(self) -> GenerateResult:
        if self.finished is None:
            raise ProtocolError("stream ended without a finished event")
        return GenerateResult(
            text="".join(self.parts),
            finish_reason=self.finished.reason,
            usage=self.finished.usage,
            token_ids=tuple(self.token_ids),
            request_id=self.started.request_id if self.started else "",
            timings=self.finished.timings,
            logprobs=tuple(self.logprobs),
        )


def collect(events: Iterable[GenerateEvent]) -> GenerateResult:
    builder = ResultBuilder()
    for event in events:
        builder.add(event)
    return builder.result()
