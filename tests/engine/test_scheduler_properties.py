"""The scheduler's two stated guarantees, checked over random arrivals (hypothesis), with a
fake clock and a fake machine the cost model was taught (tests/engine/scheduler_sim.py).

- Fair share: while two tenants both have at least two prompts to prefill, neither's
  weighted processed tokens run ahead of the other's by more than two steps' tokens of the
  lighter weight (``2 * max_num_batched_tokens / min(weight)``). (With one prompt left, a
  tenant's chunk is capped at ``request_share`` of the step while others have work.)
- Inter-token gap: in a step the least-served decoding tenant's streams are in, the other
  tenants' work makes the step last at most ``max(1, decode_stretch)`` times what those
  rows alone cost plus ``max_step_ms``; the rows and chunks of tenants served more than it
  stay within the first part alone; and for every tenant with work, the other tenants'
  chunks add at most ``max_step_ms``. The prefill floor may add its
  ``min_prefill_tokens``' cost.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from service.engine.cost_model import StepCost
from tests.engine.scheduler_sim import Arrival, Sim, chunk_line, machine, with_tuning

# No shrinking: a failure prints its example as drawn (shrinking a run takes minutes).
SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
TENANTS = ("a", "b", "c")


@st.composite
def prefill_work(draw: st.DrawFn) -> list[Arrival]:
    """Every tenant queues at once several long prompts (prefill only: one output token)."""
    out = []
    for tenant in TENANTS:
        for _ in range(draw(st.integers(3, 6))):
            out.append(Arrival(0.0, tenant, draw(st.integers(100, 600)), 1))
    return out


@SETTINGS
@given(
    work=prefill_work(),
    weights=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=3, max_size=3),
    budget=st.sampled_from([32, 64, 128]),
    timed=st.booleans(),
)
@example(
    work=[Arrival(0.0, t, 500, 1) for t in TENANTS for _ in range(5)],
    weights=[3.0, 1.0, 1.0], budget=64, timed=False,
)
def test_a_backlogged_tenant_never_lags_its_fair_share_by_more_than_two_steps(
    work: list[Arrival], weights: list[float], budget: int, timed: bool
) -> None:
    w = dict(zip(TENANTS, weights, strict=True))
    tuning = with_tuning(max_num_batched_tokens=budget, max_step_ms=20.0 if timed else 0.0)
    sim = Sim(machine(10, 1, 0.3, 0.002, 0, 0), tuning, w)
    sim.run(work)
    weighted = dict.fromkeys(TENANTS, 0.0)  # service counted here, not by the scheduler
    for step in sim.steps:
        for tenant, _context, tokens in step.chunks:
            weighted[tenant] += tokens / w[tenant]
        for tenant, rows in step.rows.items():
            weighted[tenant] += len(rows) / w[tenant]
        backlogged = [t for t in TENANTS if step.waiting.get(t, 0) >= 2]
        for a in backlogged:
            for b in backlogged:
                bound = 2 * budget / min(w[a], w[b])
                assert weighted[a] - weighted[b] <= bound + 1e-9, (a, b, weighted, bound)
    assert sum(sim.processed.values()) == sum(a.prompt for a in work)


@st.composite
def mixed_work(draw: st.DrawFn) -> list[Arrival]:
    """Streams and long prompts of three tenants arriving over the first two seconds."""
    out = []
    for tenant in TENANTS:
        for _ in range(draw(st.integers(1, 8))):
            out.append(Arrival(draw(st.floats(0.0, 2.0)), tenant, draw(st.integers(8, 700)),
                               draw(st.integers(1, 40))))
    return out


MACHINES = st.builds(
    machine,
    base_ms=st.floats(5, 20), row_ms=st.floats(0.1, 2), token_ms=st.floats(0.05, 0.5),
    key_us=st.floats(0, 0.01), packed=st.sampled_from([0, 32]), jump_ms=st.floats(0, 40),
)


@SETTINGS
@given(
    work=mixed_work(),
    fake=MACHINES,
    stretch=st.sampled_from([1.0, 1.5, 2.0, 3.0]),
    max_step_ms=st.sampled_from([5.0, 20.0, 100.0]),
    floor=st.sampled_from([1, 16]),
    weights=st.lists(st.sampled_from([1.0, 2.0]), min_size=3, max_size=3),
)
@example(  # a's twelve streams and long prompts beside b's one stream
    work=[Arrival(0.0, "a", 600, 40) for _ in range(12)] + [Arrival(0.5, "b", 20, 40)],
    fake=machine(10, 2, 0.3, 0.002, 32, 1), stretch=2.0, max_step_ms=100.0, floor=1,
    weights=[1.0, 1.0, 1.0],
)
def test_a_tenants_gap_stays_within_the_stated_bound_of_its_own_rows_cost(
    work: list[Arrival], fake: StepCost, stretch: float, max_step_ms: float, floor: int,
    weights: list[float],
) -> None:
    w = dict(zip(TENANTS, weights, strict=True))
    # A long grace: once a second tenant has come, every chunk is held to the bound.
    tuning = with_tuning(max_step_ms=max_step_ms, decode_stretch=stretch,
                         min_prefill_tokens=floor, idle_grace_s=1e6)
    sim = Sim(fake, tuning, w)
    sim.run(work)
    seen: set[str] = set()
    for step in sim.steps:
        seen |= set(step.rows) | set(step.waiting) | {t for t, _, _ in step.chunks}
        if not step.rows or len(seen) < 2:
            continue
        least = min(step.served[t] for t in step.rows)
        own = [k for t, keys in step.rows.items() if step.served[t] <= least for k in keys]
        own_s = fake.decode_seconds(len(own), sum(own))
        guard = max(1.0, stretch) * own_s
        contexts = [c + n for _, c, n in step.chunks] or [0]
        # The floor's tokens are granted whatever the clock says.
        slack = floor * fake.per_chunk_s + chunk_line(fake, max(contexts), floor)
        slack += fake.chunk_dense_s
        # The level tenants' own chunks are their own work, not the others'.
        level = {t for t in step.served if step.served[t] <= least}
        mine = sum(chunk_line(fake, c, n) for t, c, n in step.chunks if t in level)
        assert step.seconds - mine <= guard + max_step_ms / 1000 + slack + 1e-9, step
        # Every tenant with work in the step, decoding, prefilling or waiting: the other
        # tenants' chunks add at most max_step_ms.
        for tenant in set(step.rows) | set(step.waiting) | {t for t, _, _ in step.chunks}:
            others = sum(chunk_line(fake, c, n) for t, c, n in step.chunks if t != tenant)
            assert others <= max_step_ms / 1000 + slack + 1e-9, (tenant, step)
        # Tenants more than a step ahead of it keep within the guard alone.
        ahead = {t for t in step.served
                 if step.served[t] > least + tuning.max_num_batched_tokens / min(weights)}
        rows = sum(len(keys) for keys in step.rows.values())
        keys = sum(sum(k) for k in step.rows.values())
        theirs = fake.decode_seconds(rows, keys)
        theirs += sum(chunk_line(fake, c, n) for t, c, n in step.chunks if t in ahead)
        assert theirs <= guard + slack + 1e-9, step
