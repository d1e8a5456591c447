"""Batch-invariance runs on a thread-free engine core: each request alone, then the same
requests inside batches of random size and composition, and the count of tokens that differ.

Used by ``tests/engine/test_batch_invariance.py`` (small, in ``make test``) and by
``tests/isolation/test_batch_invariance.py`` (the ``make verify`` row: 100 requests).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvcache import CacheConfig
from service.engine.core import EngineCore
from service.engine.factory import build_core
from service.engine.tuning import SchedulerTuning
from service.engine.types import (
    Delta,
    EngineConfig,
    EngineEvent,
    Request,
    SamplingParams,
    StoppingParams,
)
from service.model import LoadedModel


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def mixed_requests(n: int, vocab: int, *, max_prompt: int = 24, max_new: int = 12) -> list[Request]:
    """``n`` requests of two tenants: greedy and seeded (temperature 0.8, some with top-p),
    prompts of 3 to ``max_prompt`` own tokens, a third of them behind a shared 20-token
    prefix (a prefix-cache hit within each tenant)."""
    rng = random.Random(n)
    shared = _ids(rng, 20, vocab)
    out = []
    for i in range(n):
        own = _ids(rng, 3 + (i * 7) % (max_prompt - 2), vocab)
        sampling = SamplingParams(temperature=0.0)
        if i % 2:
            top_p = 0.95 if i % 4 == 1 else 1.0
            sampling = SamplingParams(temperature=0.8, top_p=top_p, seed=1000 + i)
        out.append(
            Request(
                request_id=f"r{i}",
                tenant=f"t{i % 2}",
                prompt_ids=tuple((shared if i % 3 == 0 else []) + own),
                sampling=sampling,
                stopping=StoppingParams(max_tokens=4 + (i * 5) % (max_new - 3), ignore_eos=True),
            )
        )
    return out


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def core(loaded: LoadedModel, pages: int, config: EngineConfig, ttl: float = 600.0) -> EngineCore:
    return build_core(
        loaded, config, CacheConfig(page_size=16, default_ttl_s=ttl), kv_pages=pages, clock=_Clock()
    )


class _Tokens:
    def __init__(self) -> None:
        self.by_id: dict[str, list[int]] = {}

    def sink(self, request_id: str) -> Callable[[EngineEvent], None]:
        tokens = self.by_id.setdefault(request_id, [])

        def on(event: EngineEvent) -> None:
            if isinstance(event, Delta):
                tokens.extend(event.token_ids)

        return on


def alone(loaded: LoadedModel, requests: list[Request]) -> dict[str, list[int]]:
    """Each request by itself on a fresh-state core (no prefix cache)."""
    c = core(loaded, 64, EngineConfig(warmup=False), ttl=0.0)
    out = _Tokens()
    for r in requests:
        c.add(r, out.sink(r.request_id))
        while c.has_work():
            c.step()
    return out.by_id


def batched(c: EngineCore, requests: list[Request], rng: random.Random) -> dict[str, list[int]]:
    """Every request added to ``c`` at a random step (up to ``len // 2``), so each lands in
    steps of every composition: its prefill chunks beside other requests' decode rows."""
    out = _Tokens()
    order = list(requests)
    rng.shuffle(order)
    at = sorted(rng.randrange(0, max(len(order) // 2, 4)) for _ in order)
    step = 0
    while order or c.has_work():
        while order and at[len(requests) - len(order)] <= step:
            r = order.pop()
            c.add(r, out.sink(r.request_id))
        c.step()
        step += 1
        assert step < 100_000, "engine did not finish"
    return out.by_id


def differing(got: dict[str, list[int]], want: dict[str, list[int]]) -> int:
    """Tokens of ``want``'s requests that differ in ``got`` (a missing or extra one counts)."""
    total = 0
    for rid, expected in want.items():
        actual = got.get(rid, [])
        total += sum(a != b for a, b in zip(actual, expected, strict=False))
        total += abs(len(actual) - len(expected))
    return total


@dataclass(frozen=True, slots=True)
class Trial:
    """One batched run: its engine limits, and what it measured."""

    budget: int  # max_num_batched_tokens
    seqs: int  # max_num_seqs
    pages: int
    requests: int
    preemptions: int
    differing: int


def trial(
    loaded: LoadedModel,
    requests: list[Request],
    want: dict[str, list[int]],
    rng: random.Random,
    pages: int,
    whole: bool = False,
) -> Trial:
    """``requests`` (all with ``whole``, else a random subset of at least half) in one
    batched run with a random token budget and sequence limit, over ``pages`` pages."""
    budget = rng.choice((8, 24, 64, 512))
    seqs = rng.randint(3, len(requests))
    subset = (
        requests if whole else rng.sample(requests, rng.randint(len(requests) // 2, len(requests)))
    )
    tuning = SchedulerTuning(max_num_batched_tokens=budget, max_step_ms=0.0)
    config = EngineConfig(warmup=False, tuning=tuning, max_num_seqs=seqs)
    c = core(loaded, pages, config)
    got = batched(c, subset, rng)
    bad = differing(got, {r.request_id: want[r.request_id] for r in subset})
    return Trial(budget, seqs, pages, len(subset), c.counters().num_preemptions, bad)
