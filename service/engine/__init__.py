"""Continuous-batching engine: scheduler, sampler, detokenizer and the engine loop.

Modules (one noun each):
- ``types``: Request, SamplingParams, StoppingParams, TenantSchedPolicy, EngineConfig,
  the events (Admitted, Delta, Finished, TokenLogprob) and errors (QueueFull, RequestTooLarge).
- ``invariants``: the engine's request invariants (the service validates first).
- ``request``: SeqState, the per-request state.
- ``tuning``: SchedulerTuning, every scheduling constant and the one source of its default.
- ``fairness``: the fair share (weighted processed tokens): admission, chunk and decode order.
- ``cost_model``/``least_squares``: what a step costs on the hardware's regime.
- ``step_budget``: how much a step may carry (token budget, time bound, decode stretch).
- ``scheduler``: the scheduling loop and preemption; the engine's only caller of
  ``kvcache.KVCacheManager``'s scheduling API (open, allocate, fence, commit, free).
  ``plan``: the step plan it returns; ``kv_quota``: what can never fit, and whose pages an
  overcommitted pool takes. ``cache_queries``: the cache's queries and housekeeping (usage,
  purge, policy, stats, TTL), which the core asks directly.
- ``hooks``: the debug and test hooks on the cache, made by the factory.
- ``runner``: batch inputs and the model forward.
- ``sampler``: batched sampling and logprobs.
- ``stop``/``detokenizer``: stop strings and UTF-8-safe text deltas.
- ``tokens``: TokenSource, vocabulary facts from tokenizer + model config.
- ``core``: EngineCore, the single-threaded state machine (commands + step).
- ``shared_prefill``: the operator's shared prefixes, prefilled between steps.
- ``warmup``: warm-up batches under a reserved tenant.
- ``engine``: Engine, the engine thread, its inbox, and the asyncio bridge.
- ``factory``: build_engine / build_core / build_cache.
- ``profile``: measure_step_overhead.

The names below load on first use (PEP 562), so ``service.engine.tuning`` can be imported by
the CLI and the serve config without torch or the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcache.config import TenantCachePolicy
    from kvcache.results import SharedPublish
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

_HOME = {
    "TenantCachePolicy": "kvcache.config",
    "CacheStats": "kvcache.stats",
    "TenantUsage": "kvcache.stats",
    "SharedPublish": "kvcache.results",
    "Engine": "service.engine.engine",
    "build_cache": "service.engine.factory",
    "build_core": "service.engine.factory",
    "build_engine": "service.engine.factory",
    "Admitted": "service.engine.types",
    "Delta": "service.engine.types",
    "EngineConfig": "service.engine.types",
    "EngineCounters": "service.engine.types",
    "EngineError": "service.engine.types",
    "EngineEvent": "service.engine.types",
    "EngineStats": "service.engine.types",
    "EngineStopped": "service.engine.types",
    "ErrorKind": "service.engine.types",
    "Finished": "service.engine.types",
    "FinishError": "service.engine.types",
    "FinishReason": "service.engine.types",
    "InvalidRequest": "service.engine.types",
    "QueueFull": "service.engine.types",
    "Request": "service.engine.types",
    "RequestTooLarge": "service.engine.types",
    "SamplingParams": "service.engine.types",
    "StoppingParams": "service.engine.types",
    "TenantSchedPolicy": "service.engine.types",
    "TokenLogprob": "service.engine.types",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'service.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


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
    "SharedPublish",
    "StoppingParams",
    "TenantCachePolicy",
    "TenantSchedPolicy",
    "TenantUsage",
    "TokenLogprob",
    "build_cache",
    "build_core",
    "build_engine",
]
