"""Continuous-batching engine: scheduler, sampler, detokenizer and the engine loop.

Modules (one noun each):
- ``types``: Request, SamplingParams, StoppingParams, TenantSchedPolicy, EngineConfig,
  the events (Admitted, Delta, Finished, TokenLogprob) and errors (QueueFull, RequestTooLarge).
- ``invariants``: the engine's request invariants (the service validates first).
- ``request``: SeqState, the per-request state.
- ``fairness``: FairQueue, weighted deficit round-robin over tenants.
- ``scheduler``: Scheduler, token-budget iteration scheduling, preemption; the engine's
  only caller of ``kvcache.KVCacheManager`` (allocate, fence, commit, free).
- ``runner``: batch inputs and the model forward.
- ``sampler``: batched sampling and logprobs.
- ``stop``/``detokenizer``: stop strings and UTF-8-safe text deltas.
- ``tokens``: TokenSource, vocabulary facts from tokenizer + model config.
- ``core``: EngineCore, the single-threaded state machine (commands + step).
- ``warmup``: warm-up batches under a reserved tenant.
- ``engine``: Engine, the engine thread, its inbox, and the asyncio bridge.
- ``factory``: build_engine / build_core / build_cache.
- ``profile``: measure_step_overhead.
"""

from kvcache.config import TenantCachePolicy
from kvcache.stats import CacheStats, TenantUsage
from service.engine.engine import Engine
from service.engine.factory import build_cache, build_core, build_engine
from service.engine.types import (
    Admitted,
    Delta,
    EngineConfig,
    EngineCounters,
    EngineError,
    EngineEvent,
    EngineStats,
    EngineStopped,
    ErrorKind,
    Finished,
    FinishError,
    FinishReason,
    InvalidRequest,
    QueueFull,
    Request,
    RequestTooLarge,
    SamplingParams,
    StoppingParams,
    TenantSchedPolicy,
    TokenLogprob,
)

__all__ = [
    "Admitted",
    "CacheStats",
    "Delta",
    "Engine",
    "EngineConfig",
    "EngineCounters",
    "EngineError",
    "EngineEvent",
    "EngineStats",
    "EngineStopped",
    "ErrorKind",
    "FinishError",
    "FinishReason",
    "Finished",
    "InvalidRequest",
    "QueueFull",
    "Request",
    "RequestTooLarge",
    "SamplingParams",
    "StoppingParams",
    "TenantCachePolicy",
    "TenantSchedPolicy",
    "TenantUsage",
    "TokenLogprob",
    "build_cache",
    "build_core",
    "build_engine",
]
