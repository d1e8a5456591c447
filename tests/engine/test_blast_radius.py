"""One request's failure is its own: a row whose forward raises, whose logits are not finite,
or whose sampling raises fails with an internal error, and the other rows of its steps get
exactly the tokens they get alone (tiny model, thread-free core, faults placed by the test on
one request's rows)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service.engine.fairness import TokenCounter
from service.engine.runner import BatchInputs, ModelRunner
from service.engine.sampler import Sampler, SampleResult, SampleRow
from service.engine.types import SamplingParams
from service.model import LoadedModel
from tests.engine.conftest import Recorder, assert_at_baseline, make_core, prompt_ids, req, run_all

VOCAB = 384
SENTINEL = 2  # a token id no other prompt holds (prompt_ids draws from 3 up)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)


def _good() -> list[Any]:
    return [
        req("g1", prompt_ids(1, 21, VOCAB), max_tokens=10, tenant="victim"),
        req("g2", prompt_ids(2, 7, VOCAB), max_tokens=10, tenant="victim", sampling=SEEDED),
        req("g3", prompt_ids(3, 40, VOCAB), max_tokens=6, tenant="other"),
    ]


def _bad() -> Any:
    return req("bad", [*prompt_ids(4, 12, VOCAB), SENTINEL], max_tokens=10, tenant="attacker")


@pytest.fixture(scope="module")
def alone(tiny: LoadedModel) -> dict[str, list[int]]:
    """Each good request's tokens, run alone."""
    out: dict[str, list[int]] = {}
    for r in _good():
        rec = Recorder()
        run_all(make_core(tiny), rec, [r])
        out[r.request_id] = rec.tokens(r.request_id)
    return out


def _run_beside_the_bad_one(core: Any) -> Recorder:
    rec = Recorder()
    run_all(core, rec, [*_good(), _bad()])
    return rec


def _check(rec: Recorder, alone: dict[str, list[int]], reason: str, cause: str) -> None:
    for rid, tokens in alone.items():
        assert rec.finished(rid).reason != "error", rid
        assert rec.tokens(rid) == tokens, rid
    failed = rec.finished("bad")
    assert failed.reason == "error" and failed.error is not None
    assert failed.error.kind == "internal" and reason in failed.error.message
    assert failed.error.cause == cause  # what the client is told: no exception text


def test_a_row_whose_forward_raises_fails_alone(
    tiny: LoadedModel, alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_core(tiny)
    original = ModelRunner.forward
    calls = {"batched": 0}

    def forward(self: ModelRunner, inputs: BatchInputs, attn: Any) -> torch.Tensor:
        if bool((inputs.input_ids == SENTINEL).any()):
            calls["batched"] += int(inputs.input_ids.numel() > 13)
            raise ValueError("a shape the kernel refuses")
        return original(self, inputs, attn)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    rec = _run_beside_the_bad_one(core)
    assert calls["batched"] >= 1, "the failing row was never in a batch with others"
    _check(rec, alone, "ValueError: a shape the kernel refuses",
           "the forward failed on this request (ValueError)")
    assert_at_baseline(core)


def test_a_row_whose_logits_are_not_finite_fails_alone(
    tiny: LoadedModel, alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_core(tiny)
    original = ModelRunner.forward
    shared = {"steps": 0}

    def forward(self: ModelRunner, inputs: BatchInputs, attn: Any) -> torch.Tensor:
        logits = original(self, inputs, attn).clone()  # the forward's is an inference tensor
        poisoned = inputs.input_ids[inputs.logits_indices] == SENTINEL
        if bool(poisoned.any()):
            shared["steps"] += int(poisoned.numel() > 1)
            logits[poisoned] = float("nan")
        return logits

    charged: dict[str, int] = {}
    charge = TokenCounter.charge

    def counted(self: TokenCounter, tenant: str, tokens: int) -> None:
        charged[tenant] = charged.get(tenant, 0) + tokens
        charge(self, tenant, tokens)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    monkeypatch.setattr(TokenCounter, "charge", counted)
    rec = _run_beside_the_bad_one(core)
    assert shared["steps"] >= 1, "the poisoned row never shared a step"
    _check(rec, alone, "not finite", "the model's logits for this request are not finite")
    # The failed prompt's tokens were processed: its tenant is charged for them, or a tenant
    # whose requests always fail would always be owed the next step.
    assert charged.get("attacker", 0) == len(_bad().prompt_ids)
    assert_at_baseline(core)


def test_a_row_whose_sampling_raises_fails_alone(
    tiny: LoadedModel, alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_core(tiny)
    original = Sampler.sample
    shared = {"batched": 0}

    def sample(self: Sampler, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        result = original(self, logits, rows)  # draws first: the replay must undo them
        if any(SENTINEL in r.prompt_ids for r in rows):
            shared["batched"] += int(len(rows) > 1)
            raise RuntimeError("a grammar state the sampler cannot take")
        return result

    monkeypatch.setattr(Sampler, "sample", sample)
    rec = _run_beside_the_bad_one(core)
    assert shared["batched"] >= 1, "the failing row was never sampled beside others"
    _check(rec, alone, "RuntimeError: a grammar state the sampler cannot take",
           "sampling failed on this request (RuntimeError)")
    assert_at_baseline(core)
