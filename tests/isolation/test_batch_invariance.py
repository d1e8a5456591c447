"""A tenant's tokens do not depend on other tenants' load (``make verify``'s row).

Two tenants' greedy and seeded (temperature 0.8) requests on the default model as served
(``--batch-invariant on``): each alone, then all of them in batches of random
size and composition, one of them over a pool small enough to preempt and re-admit
(``tests/verify/invariance.py``). Any differing token fails the check: a tenant's answer
would otherwise carry information about what else ran beside it.
"""

from __future__ import annotations

import random
from typing import Any

from tests.verify.invariance import alone, mixed_requests, trial
from tests.verify.recorder import Recorder
from tests.verify.scale import size

N = size(12, 100)


def test_two_tenants_get_the_same_tokens_alone_and_batched(
    invariant_model: Any, record: Recorder
) -> None:
    requests = mixed_requests(N, invariant_model.model.config.vocab_size)
    want = alone(invariant_model, requests)
    rng = random.Random(7)
    trials = [trial(invariant_model, requests, want, rng, pages, whole=True) for pages in (512, 12)]
    record.info("batch-invariant model", invariant_model.batch_invariant)
    record.info("requests (two tenants, greedy and seeded)", N)
    record.info("tokens compared", sum(len(t) for t in want.values()))
    record.info("preemptions in the small pool", trials[1].preemptions)
    assert record("preemption exercised", trials[1].preemptions, "> 0", trials[1].preemptions > 0)
    bad = sum(t.differing for t in trials)
    assert record("tokens differing from each request alone", bad, "== 0", bad == 0)
