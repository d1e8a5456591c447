"""Cache timing side channel: can tenant B tell, from its own time to first token, that
tenant A has a prefix cached?

Per trial, A caches a fresh 1,024-token prompt P (and repeats it: A's warm TTFT); then B sends
P (A has it cached) and a novel prompt Q of equal length, in alternating order. The judgement
is a two-sided equivalence test (TOST at 5%, paired by trial on log TTFT, with the
distribution-free signed-rank interval so one scheduling outlier cannot decide it): the 90%
confidence interval of B's TTFT ratio, P over Q, must lie inside [1/MARGIN, MARGIN]. So the
test passes only on evidence that B's TTFT on A's prefix is within 20% of novel (a factor
1.25), not merely on the absence of evidence. The interval is looked at after each of
LOOKS trials, at ALPHA / len(LOOKS) per look (Bonferroni), and the test stops at the first
look that decides (inside, or entirely outside): a quiet machine decides at the first look, a
loaded one gets more pairs. B is never reported cached tokens. A's warm repeat is a real hit (it
skips ~98% of the prefill); the same interval on A warm / B cold must lie entirely below
1/MARGIN: the power control, showing that a cache leak would fail the first check.

Runs on the medium random model: its 1,024-token prefill costs hundreds of milliseconds,
far above gRPC overhead, while the 16 uncached tokens of a warm prompt cost a few.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from protos.kvfence.v1 import inference_pb2_grpc
from service.serve.app import EngineSizing
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.calls import StreamResult, collect, gen_request
from tests.verify.recorder import Recorder
from tests.verify.scale import size
from tests.verify.stats import median, paired_log_ratio_ci

PROMPT = 1024
LOOKS = size((12, 24, 48), (40, 80))  # trials (pairs) at which the interval is judged
ALPHA = 0.05  # per one-sided test of the TOST pair, split over the looks
MARGIN = 1.25  # equivalence margin on the TTFT ratio; a real hit is a factor ~20
SIZING = EngineSizing(kv_memory="96MiB", max_model_len=2048, warmup=False, dtype="float32")


@pytest.fixture(scope="module")
def srv(medium: Any) -> Iterator[ServerHandle]:
    with running_server(medium, {"alice": TenantSpec(), "bob": TenantSpec()}, sizing=SIZING) as h:
        yield h


def _ttft(srv: ServerHandle, tenant: str, prompt: list[int]) -> StreamResult:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    result = collect(
        stub.Generate(gen_request(prompt, max_tokens=1), metadata=srv.auth(tenant), timeout=120)
    )
    assert result.ok and result.ttft is not None and result.started is not None, result.code
    return result


@dataclass
class Trials:
    """What ``equivalence_trials`` measured: per trial, tenant A's control request (TTFT and
    cached tokens) and B's TTFT on the cross prompt and on the cold one, B's reported cached
    tokens, and the interval of B's cross / cold ratio at the look that decided."""

    control: list[float] = field(default_factory=list)
    control_hits: list[int] = field(default_factory=list)
    cross: list[float] = field(default_factory=list)
    cold: list[float] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    ratio: float = math.nan
    lo: float = math.nan
    hi: float = math.nan
    alpha: float = ALPHA / len(LOOKS)


def equivalence_trials(
    trial: Callable[[], tuple[StreamResult, list[int], list[int]]],
    measure: Callable[[list[int]], StreamResult],
) -> Trials:
    """The sequential test of the module docstring: each ``trial()`` runs A's part and
    returns A's control result with the prompts B then sends (cross, cold), which
    ``measure`` sends in alternating order; the interval is judged at each of LOOKS and the
    trials stop at the first look that decides."""
    t = Trials()
    for n in range(LOOKS[-1]):
        if n in LOOKS:
            t.ratio, t.lo, t.hi = paired_log_ratio_ci(t.cross, t.cold, t.alpha)
            if (t.lo > 1 / MARGIN and t.hi < MARGIN) or t.hi < 1 / MARGIN or t.lo > MARGIN:
                return t
        control, cross, cold = trial()
        t.control.append(control.ttft or 0.0)
        t.control_hits.append(control.started.cached_prompt_tokens if control.started else 0)
        order = [("cross", cross), ("cold", cold)]
        for kind, prompt in order if n % 2 == 0 else reversed(order):
            result = measure(prompt)
            (t.cross if kind == "cross" else t.cold).append(result.ttft or 0.0)
            t.hits.append(result.started.cached_prompt_tokens if result.started else -1)
    t.ratio, t.lo, t.hi = paired_log_ratio_ci(t.cross, t.cold, t.alpha)
    return t


@pytest.mark.timeout(size(600, 1800))
@pytest.mark.slow
def test_cross_tenant_cached_prefix_is_invisible_in_ttft(srv: ServerHandle, record: Recorder) -> None:
    rng = random.Random(5)

    def novel() -> list[int]:
        return [rng.randrange(3, 384) for _ in range(PROMPT)]

    for tenant in ("alice", "bob"):  # first-call effects (allocations, lazy init) go here
        _ttft(srv, tenant, novel())
    def trial() -> tuple[StreamResult, list[int], list[int]]:
        shared, fresh = novel(), novel()
        _ttft(srv, "alice", shared)
        return _ttft(srv, "alice", shared), shared, fresh  # A's warm repeat

    t = equivalence_trials(trial, lambda prompt: _ttft(srv, "bob", prompt))
    a_warm, b_cross, b_cold, a_hits, b_hits = t.control, t.cross, t.cold, t.control_hits, t.hits
    ratio, lo, hi, alpha = t.ratio, t.lo, t.hi, t.alpha
    warm_ratio, _, warm_hi = paired_log_ratio_ci(a_warm, b_cold, alpha)
    record.info("trials (pairs) until the interval decided", len(b_cold))
    record.info("B TTFT median on A's cached prefix (s)", median(b_cross))
    record.info("B TTFT median on a novel prompt (s)", median(b_cold))
    record.info("B TTFT ratio, A's prefix / novel (Hodges-Lehmann)", round(ratio, 3))
    assert record(f"{1 - 2 * alpha:.1%} CI of B's TTFT ratio, A's prefix / novel (TOST)",
                  f"[{lo:.3f}, {hi:.3f}]", f"inside [{1 / MARGIN:.3f}, {MARGIN}]",
                  lo > 1 / MARGIN and hi < MARGIN), [round(a / b, 3) for a, b in zip(b_cross, b_cold, strict=True)]
    assert record("cached tokens reported to B", sum(b_hits), "== 0", sum(b_hits) == 0)
    assert record("A cached tokens on its repeat (control)", min(a_hits), f"== {PROMPT - 16}",
                  min(a_hits) == PROMPT - 16)
    record.info("A warm / B cold TTFT ratio (Hodges-Lehmann)", round(warm_ratio, 3))
    assert record("CI upper end, A warm / B cold (power: a real hit)", round(warm_hi, 3),
                  f"< {1 / MARGIN:.3f}", warm_hi < 1 / MARGIN)
