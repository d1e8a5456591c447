"""Sampling costs inside the step budget: each row's grammar mask and its share of the
sampler stages it opted into are measured, charged to its tenant, and counted in the step's
cost, so a tenant whose rows are expensive to sample cannot stretch another's steps."""

from __future__ import annotations

import ctypes
import dataclasses
import time

import torch

from service.engine.cost_model import StepCost, StepCostModel
from service.engine.sampler import Sampler, SampleRow
from service.engine.tuning import SchedulerTuning
from service.engine.types import EngineConfig, SamplingParams
from service.model import LoadedModel
from service.structured.grammar import GrammarMatcher
from tests.engine.conftest import Recorder, make_core, prompt_ids, req

V = 384
MASK_S = 0.02  # what an ambiguous grammar's mask costs a token on a big vocabulary


class _SlowMask:
    """Stands in for ``llguidance.LLMatcher``: every mask takes ``seconds`` of CPU."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        ctypes.memset(ptr, 0xFF, nbytes)  # every token allowed

    def consume_token(self, token: int) -> bool:
        return True

    def is_stopped(self) -> bool:
        return False

    def get_error(self) -> str:
        return ""


class _SlowGrammar:
    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(_SlowMask(MASK_S))  # type: ignore[arg-type]


class _FixedCost(StepCostModel):
    def fit(self) -> StepCost:
        return StepCost(0.005, 0.0, 0.0, 0.0, 0.001, 0.0)

    def observe(self, *args: object) -> None:
        pass


def test_each_rows_mask_and_opted_in_stages_are_measured() -> None:
    sampler = Sampler(seed=0)
    plain = SamplingParams(temperature=0.0)
    heavy = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.3)
    rows = [
        SampleRow(plain, None, [1, 2], []),
        SampleRow(plain, None, [1, 2], [], grammar=_SlowGrammar().matcher()),
        SampleRow(heavy, None, [1, 2], [3], num_logprobs=20),
    ]
    sampler.sample(torch.randn(3, V), rows)  # torch's first calls are slow: warm them
    result = sampler.sample(torch.randn(3, V), rows)
    free, masked, sampled = result.row_s
    assert free == 0.0  # a greedy row without extras owes nothing beyond the argmax
    assert masked >= MASK_S
    assert sampled > 0.0


def test_expensive_rows_of_one_tenant_do_not_join_every_step_of_anothers_decodes(
    tiny: LoadedModel,
) -> None:
    tuning = SchedulerTuning(max_step_ms=50.0, decode_stretch=2.0, max_num_batched_tokens=64)
    config = EngineConfig(warmup=False, tuning=tuning)
    core = make_core(tiny, config=config)
    rec = Recorder()
    victim = req("victim", prompt_ids(1, 24, V), tenant="victim", max_tokens=400,
                 ignore_eos=True)
    core.add(victim, rec.sink("victim"))
    for i in range(4):
        r = dataclasses.replace(
            req(f"g{i}", prompt_ids(10 + i, 24, V), tenant="attacker", max_tokens=400,
                ignore_eos=True),
            grammar=_SlowGrammar(),  # type: ignore[arg-type]
        )
        core.add(r, rec.sink(r.request_id))
    # A fixed step cost (5 ms a decode step, 1 ms a prefill token) instead of the fit, so
    # the rule is tested, not how loaded this machine is.
    core.scheduler.budget.cost = _FixedCost()
    for _ in range(4):  # prefills
        core.step()
    before_count = core.scheduler.counter["attacker"]
    victim_steps = shared_steps = attacker_tokens = 0
    for _ in range(40):
        v0 = len(rec.tokens("victim"))
        a0 = sum(len(rec.tokens(f"g{i}")) for i in range(4))
        core.step()
        v1 = len(rec.tokens("victim"))
        a1 = sum(len(rec.tokens(f"g{i}")) for i in range(4))
        attacker_tokens += a1 - a0
        if v1 > v0:
            victim_steps += 1
            shared_steps += a1 > a0
    assert victim_steps >= 30  # the victim decodes (nearly) every step
    assert attacker_tokens > 0  # the attacker still makes progress, on its share
    # Each 20 ms mask is charged (~1 ms a token before the fit; at the fit's rate after).
    assert core.scheduler.counter["attacker"] - before_count > attacker_tokens
    assert shared_steps <= victim_steps // 4, (shared_steps, victim_steps)
