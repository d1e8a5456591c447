"""Batch invariance on the served model: a request's tokens do not depend on the batch.

The default model, loaded as ``kvfence serve`` loads it (``--dtype auto``, ``--weights
auto``, ``--batch-invariant`` at its default), runs greedy and seeded (temperature 0.8)
requests of two tenants, each alone, and then all of them inside batches of random size and
composition: random arrival steps (prefill chunks beside other requests' decode rows),
random token budgets and sequence limits (chunked prefill of different shapes), a shared
prefix (prefix-cache hits), and a KV pool so small that requests are preempted and
re-admitted (their KV recomputed as prefill). Every token must equal the request's own
run alone: no near-tie allowance.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from service.engine.core import EngineCore
from service.engine.types import EngineConfig, Request, SamplingParams, StoppingParams
from service.model import LoadedModel
from tests.engine.conftest import FakeClock, Recorder, make_core, prompt_ids

N = 10


@pytest.fixture(scope="module")
def served(default_model_path: Path) -> LoadedModel:
    from service.model import load_model

    return load_model(default_model_path, progress=False)


def build_requests(vocab: int) -> list[Request]:
    shared = prompt_ids(99, 20, vocab)  # more than a page: a prefix-cache hit per tenant
    out = []
    for i in range(N):
        own = prompt_ids(i, 3 + (i * 7) % 24, vocab)
        sampling = SamplingParams(temperature=0.0)
        if i % 2:
            sampling = SamplingParams(temperature=0.8, top_p=0.95 if i % 4 == 1 else 1.0, seed=i)
        out.append(
            Request(
                request_id=f"r{i}",
                tenant=f"t{i % 2}",
                prompt_ids=tuple((shared if i % 3 == 0 else []) + own),
                sampling=sampling,
                stopping=StoppingParams(max_tokens=4 + (i * 5) % 9, ignore_eos=True),
            )
        )
    return out


def alone(loaded: LoadedModel, requests: list[Request]) -> dict[str, list[int]]:
    core = make_core(loaded, pages=64, ttl=0.0)
    tokens = {}
    for r in requests:
        rec = Recorder()
        core.add(r, rec.sink(r.request_id))
        while core.has_work():
            core.step()
        tokens[r.request_id] = rec.tokens(r.request_id)
    return tokens


def batched(core: EngineCore, requests: list[Request], rng: random.Random) -> dict[str, list[int]]:
    """Each request added at a random step, so it lands in steps of every composition."""
    rec = Recorder()
    pending = list(requests)
    rng.shuffle(pending)
    arrivals = sorted(rng.randrange(0, 12) for _ in pending)
    step = 0
    while pending or core.has_work():
        while pending and arrivals[len(requests) - len(pending)] <= step:
            r = pending.pop()
            core.add(r, rec.sink(r.request_id))
        core.step()
        step += 1
        assert step < 5000, "engine did not finish"
    return {r.request_id: rec.tokens(r.request_id) for r in requests}


def differing(got: dict[str, list[int]], want: dict[str, list[int]]) -> int:
    """Tokens that differ from the request's run alone (a missing or extra one counts)."""
    total = 0
    for rid, expected in want.items():
        actual = got[rid]
        total += sum(a != b for a, b in zip(actual, expected, strict=False))
        total += abs(len(actual) - len(expected))
    return total


def test_a_request_gets_the_same_tokens_alone_and_in_any_batch(served: LoadedModel) -> None:
    vocab = served.model.config.vocab_size
    requests = build_requests(vocab)
    want = alone(served, requests)
    assert all(len(want[r.request_id]) == r.stopping.max_tokens for r in requests)
    rng = random.Random(44)
    results = []
    preempted = 0
    for trial in range(3):
        budget = rng.choice((8, 24, 64, 512))
        seqs = rng.randint(3, N)
        # The last trial's pool holds a few requests at a time: preemption and re-admission.
        pages = 9 if trial == 2 else 256
        config = EngineConfig(warmup=False, max_num_batched_tokens=budget, max_num_seqs=seqs)
        core = make_core(served, pages=pages, config=config, clock=FakeClock())
        subset = rng.sample(requests, rng.randint(N // 2, N)) if trial == 1 else requests
        got = batched(core, subset, rng)
        preempted += core.counters().num_preemptions
        own = {r.request_id: want[r.request_id] for r in subset}
        results.append((trial, budget, seqs, differing(got, own)))
    assert preempted > 0, "the small pool must force preemption"
    assert all(bad == 0 for *_, bad in results), f"(trial, budget, seqs, differing): {results}"
