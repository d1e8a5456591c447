"""Continuous-batching engine: scheduler, sampler, detokenizer and the engine loop.

Modules (one noun each):
- ``types``: Request, SamplingParams, StoppingParams, TenantSchedPolicy, EngineConfig,
  the events (Admitted, Delta, Finished, TokenLogprob) and errors (QueueFull, RequestTooLarge).
- ``validate``: request checks before queueing.
- ``request``: Sequence, the per-request state.
- ``fairness``: FairQueue, weighted deficit round-robin over tenants.
- ``scheduler``: Scheduler, token-budget iteration scheduling, preemption.
- ``cache_api``: the KVCacheManager calls the engine makes, as a Protocol.
- ``runner``: batch inputs, the fence call, the model forward.
- ``sampler``: batched sampling and logprobs.
- ``stop``/``detokenizer``: stop strings and UTF-8-safe text deltas.
- ``tokens``: TokenSource, vocabulary facts from tokenizer + model config.
- ``core``: EngineCore, the thread-free step loop.
- ``warmup``: warm-up batches under a reserved tenant.
- ``engine``: Engine, the engine thread and the asyncio bridge.
- ``factory``: build_engine / build_cache.
- ``profile``: measure_step_overhead.
"""

from service.engine.engine import Engine
from service.engine.factory import build_cache, build_engine
from service.engine.types import (
    Admitted,
    Delta,
    EngineConfig,
    EngineError,
    EngineEvent,
    EngineStopped,
    Finished,
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
    "Delta",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineEvent",
    "EngineStopped",
    "FinishReason",
    "Finished",
    "InvalidRequest",
    "QueueFull",
    "Request",
    "RequestTooLarge",
    "SamplingParams",
    "StoppingParams",
    "TenantSchedPolicy",
    "TokenLogprob",
    "build_cache",
    "build_engine",
]
