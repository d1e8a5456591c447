"""The real ``Scheduler`` and ``KVCacheManager`` driven without a model: a fake clock and a
fake machine whose step time is a known ``StepCost``, taught to the scheduler's cost model
before the run, so the budget's predictions are the machine's times. Each step records who
was served what, for the property tests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvcache import CacheConfig, KVCacheManager, PagePool
from service.engine.cost_model import Regime, StepCost, StepShape, chunk_keys
from service.engine.request import SeqState
from service.engine.scheduler import Scheduler
from service.engine.tuning import SchedulerTuning
from service.engine.types import (
    EngineConfig,
    Request,
    SamplingParams,
    StoppingParams,
    TenantSchedPolicy,
)

PAGE = 16


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds after the start
    tenant: str
    prompt: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Step:
    """One planned step: the counts before it, its rows and chunks per tenant, its time."""

    served: dict[str, float]  # weighted processed tokens before the step
    rows: dict[str, list[int]]  # tenant -> keys each of its decode rows read
    chunks: list[tuple[str, int, int]]  # (tenant, context, tokens), in planning order
    seconds: float
    waiting: dict[str, int]  # tenant -> its requests waiting or prefilling


@dataclass
class Sim:
    machine: StepCost
    tuning: SchedulerTuning
    weights: dict[str, float]
    now: float = 1000.0
    steps: list[Step] = field(default_factory=list)
    processed: dict[str, int] = field(default_factory=dict)  # tokens computed per tenant

    def __post_init__(self) -> None:
        pool = PagePool(1, 4096, PAGE, 1, 4)
        cache = KVCacheManager(pool, CacheConfig(page_size=PAGE), self.clock)
        config = EngineConfig(max_num_seqs=1024, max_model_len=8192, tuning=self.tuning)
        self.sched = Scheduler(
            config, cache, self.policy, self.clock, self.machine.regime
        )
        _teach(self.sched, self.machine)

    def clock(self) -> float:
        return self.now

    def policy(self, tenant: str) -> TenantSchedPolicy:
        return TenantSchedPolicy(weight=self.weights.get(tenant, 1.0), max_running=1024)

    def run(self, arrivals: list[Arrival], max_steps: int = 400) -> None:
        pending = sorted(arrivals, key=lambda a: a.at)
        start = self.now
        for n in range(max_steps):
            while pending and pending[0].at <= self.now - start:
                self._add(pending.pop(0), n)
            if not self.sched.running and not len(self.sched.waiting):
                if not pending:
                    return
                self.now = start + pending[0].at
                continue
            self._step()

    def _add(self, a: Arrival, n: int) -> None:
        rid = f"{a.tenant}-{n}-{len(self.sched.running) + len(self.sched.waiting)}-{a.at}"
        ids = tuple((hash((rid, i)) % 300) + 1 for i in range(a.prompt))
        request = Request(
            rid, a.tenant, ids, SamplingParams(temperature=0.0),
            StoppingParams(max_tokens=a.max_tokens, ignore_eos=True), bypass_prefix_cache=True,
        )
        seq = SeqState(request, lambda e: None, None, None, frozenset(), a.max_tokens, self.now)  # type: ignore[arg-type]
        self.sched.add(seq)

    def _step(self) -> None:
        sched = self.sched
        served = {t: sched.counter[t] for t in self.weights}
        waiting = {t: sched.waiting.num_waiting(t) for t in sched.waiting.tenants()}
        for s in sched.running:
            if s.num_tokens - s.num_computed > 1:
                waiting[s.tenant] = waiting.get(s.tenant, 0) + 1
        out = sched.schedule()
        assert not out.rejected and not out.refused and not out.preempted
        shape = out.shape()
        rows: dict[str, list[int]] = {}
        chunks = []
        for e in out.entries:
            if e.num_new == 1 and e.samples:
                rows.setdefault(e.seq.tenant, []).append(e.seq.num_computed + 1)
            else:
                chunks.append((e.seq.tenant, e.seq.num_computed, e.num_new))
            self.processed[e.seq.tenant] = self.processed.get(e.seq.tenant, 0) + e.num_new
        seconds = step_seconds(self.machine, shape)
        self.steps.append(Step(served, rows, chunks, seconds, waiting))
        samplers = [e.seq for e in out.entries if e.samples]  # before update advances them
        sched.update(out.entries)
        for seq in samplers:
            sched.append(seq, 1)
            if seq.num_output >= seq.max_tokens:
                sched.finish(seq)
        # The machine is the taught cost model: the run observes nothing new.
        self.now += seconds


def step_seconds(machine: StepCost, shape: StepShape) -> float:
    """The fake machine's time for a step: its decode part (the fixed cost of a step, with
    or without rows), then its chunks in order."""
    seconds = machine.decode_seconds(shape.rows, shape.row_keys)
    tokens = shape.rows
    for context, n in shape.chunks:
        seconds += machine.chunk_seconds(context, n, tokens)
        tokens += n
    return seconds


def _teach(sched: Scheduler, machine: StepCost) -> None:
    """Teach the scheduler's cost model the machine, on varied shapes in both regimes."""
    packed = machine.regime.packed_rows or 64
    for _ in range(30):
        for rows, keys in ((1, 40), (2, 500), (3, 90), (5, 2000), (8, 700), (packed + 3, 5000),
                           (packed + 9, 900)):
            sched.observe_step(StepShape(rows, keys, ()), step_seconds(machine, StepShape(rows, keys, ())))
        for rows, keys, chunks in (
            (0, 0, ((0, 8),)), (1, 30, ((100, 4),)), (2, 60, ((0, 20), (300, 6))),
            (0, 0, ((50, packed + 20),)), (3, 200, ((900, packed),)), (1, 10, ((10, 2),)),
        ):
            shape = StepShape(rows, keys, chunks)
            sched.observe_step(shape, step_seconds(machine, shape))


def machine(
    base_ms: float, row_ms: float, token_ms: float, key_us: float, packed: int, jump_ms: float
) -> StepCost:
    """A fake CPU: decode steps ``base + row * rows``, chunks ``1 ms + token * tokens``,
    every key read ``key_us``; past ``packed`` tokens a step pays ``jump_ms`` more."""
    ms, us = 1e-3, 1e-6
    regime = Regime(packed_rows=packed)
    return StepCost(base_ms * ms, row_ms * ms, key_us * us, 1 * ms, token_ms * ms, key_us * us,
                    jump_ms * ms, jump_ms * ms, regime)


def chunk_line(machine: StepCost, context: int, tokens: int) -> float:
    """A chunk's time without the regime's jump."""
    return (machine.per_chunk_s + machine.per_token_s * tokens
            + machine.per_key_s * chunk_keys(context, tokens))


def with_tuning(**kw: Any) -> SchedulerTuning:
    return dataclasses.replace(SchedulerTuning(), **kw)
