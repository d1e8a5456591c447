"""Batch invariance on the served model: a request's tokens do not depend on the batch.

The default model, loaded as ``kvfence serve`` loads it with every flag at its default
(``--batch-invariant auto``: invariant on a CPU where kvfence's 4-bit GEMV builds), runs
greedy and seeded (temperature 0.8) requests of two tenants each alone, then inside batches
of random size and composition (``tests/verify/invariance.py``): random arrival steps
(prefill chunks beside other requests' decode rows), random token budgets and sequence
limits (chunks of different shapes), a shared prefix (prefix-cache hits), and a pool so
small that requests are preempted and re-admitted (their KV recomputed as prefill). Every
token must equal the request's own run alone: no near-tie allowance.
"""

from __future__ import annotations

import random

from service.model import LoadedModel
from service.model.native import kernels
from tests.verify.invariance import alone, mixed_requests, trial

N = 10


def test_a_request_gets_the_same_tokens_alone_and_in_any_batch(served_model: LoadedModel) -> None:
    assert served_model.batch_invariant == (kernels.kernel() is not None)
    requests = mixed_requests(N, served_model.model.config.vocab_size)
    want = alone(served_model, requests)
    assert all(len(want[r.request_id]) == r.stopping.max_tokens for r in requests)
    rng = random.Random(44)
    # The last pool holds a few requests at a time: preemption and re-admission.
    trials = [trial(served_model, requests, want, rng, pages) for pages in (256, 256, 9)]
    assert sum(t.preemptions for t in trials) > 0, "the small pool must force preemption"
    assert all(t.differing == 0 for t in trials), trials
