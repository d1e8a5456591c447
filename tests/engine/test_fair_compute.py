"""Fair compute and fair memory in the scheduler.

A tenant's long prefills must not hold up another tenant's admission or its decodes; step
tokens are shared by weighted processed-token counts; a tenant whose next request does not
fit is skipped rather than blocking every tenant; and when an overcommitted pool runs out, the
tenant most over its share is the one preempted.
"""

from __future__ import annotations

import pytest

from kvcache import TenantCachePolicy
from service.engine.core import EngineCore
from service.engine.cost_model import StepCost
from service.engine.tuning import SchedulerTuning
from service.engine.types import EngineConfig, TenantSchedPolicy
from service.model import LoadedModel
from tests.engine.conftest import FakeClock, Recorder, make_core, prompt_ids, req, untimed

V = 384


def _computed(core: EngineCore, request_id: str) -> int:
    sched = core.scheduler
    for seq in sched.running:
        if seq.seq_id == request_id:
            return int(seq.num_computed)
    return -1


def test_long_prefills_of_one_tenant_do_not_delay_anothers_first_token(
    tiny: LoadedModel,
) -> None:
    config = EngineConfig(warmup=False, tuning=untimed(max_num_batched_tokens=64))
    core = make_core(tiny, config=config)
    rec = Recorder()
    for i in range(3):
        r = req(f"a{i}", prompt_ids(i, 300, V), tenant="a", max_tokens=2)
        core.add(r, rec.sink(r.request_id))
    core.step()
    core.step()
    b = req("b", prompt_ids(9, 10, V), tenant="b", max_tokens=3, ignore_eos=True)
    core.add(b, rec.sink("b"))
    core.step()
    assert len(rec.tokens("b")) == 1  # admitted, prefilled and sampled in one step
    core.step()
    assert len(rec.tokens("b")) == 2  # and it decodes every step after
    assert all(len(rec.tokens(f"a{i}")) == 0 for i in range(3))  # still prefilling


def test_prefill_tokens_are_shared_by_weight(tiny: LoadedModel) -> None:
    config = EngineConfig(warmup=False, tuning=untimed(max_num_batched_tokens=64))
    core = make_core(tiny, config=config)
    core.set_tenant_policy("heavy", sched=TenantSchedPolicy(weight=3.0))
    rec = Recorder()
    for tenant in ("heavy", "light"):
        for i in range(3):
            r = req(f"{tenant}{i}", prompt_ids(i, 1000, V), tenant=tenant, max_tokens=1)
            core.add(r, rec.sink(r.request_id))
    for _ in range(16):
        core.step()
    heavy = sum(_computed(core, f"heavy{i}") for i in range(3))
    light = sum(_computed(core, f"light{i}") for i in range(3))
    assert heavy + light == 16 * 64
    # 3:1 by weight (two 32-token chunks per step, the lower weighted count first).
    assert 2.2 <= heavy / light <= 4.0, (heavy, light)


def test_a_tenant_whose_request_does_not_fit_does_not_block_others(tiny: LoadedModel) -> None:
    core = make_core(tiny, pages=10)
    rec = Recorder()
    hold = req("hold", prompt_ids(1, 90, V), tenant="a", max_tokens=40, ignore_eos=True)
    core.add(hold, rec.sink("hold"))
    core.step()  # 'hold' takes 6 of the 10 pages
    big = req("big", prompt_ids(2, 100, V), tenant="a", max_tokens=4)  # 7 pages: must wait
    small = req("small", prompt_ids(3, 20, V), tenant="b", max_tokens=4, ignore_eos=True)
    core.add(big, rec.sink("big"))
    core.add(small, rec.sink("small"))
    core.step()
    assert len(rec.tokens("small")) == 1  # admitted past a's head, which does not fit yet
    assert rec.events["big"] == []


def test_out_of_pages_preempts_the_tenant_most_over_its_share(tiny: LoadedModel) -> None:
    # Overcommitted shares: a 10 pages, b 10 pages, pool 12.
    core = make_core(tiny, pages=12)
    core.set_tenant_policy("a", cache=TenantCachePolicy(max_pages=10))
    core.set_tenant_policy("b", cache=TenantCachePolicy(max_pages=10))
    rec = Recorder()
    for rid, tenant, seed in (("a0", "a", 1), ("a1", "a", 2), ("a2", "a", 4), ("b0", "b", 3)):
        r = req(rid, prompt_ids(seed, 40, V), tenant=tenant, max_tokens=60, ignore_eos=True)
        core.add(r, rec.sink(rid))  # 3 pages each now; 12 in all once they grow past 48
        if rid == "a2":
            core.step()  # a's three run first: b0 is the newest sequence of all
    steps = 0
    while core.scheduler.num_preemptions == 0:
        core.step()
        steps += 1
        assert steps < 200
    running = {s.seq_id for s in core.scheduler.running}
    # b0 is the newest sequence, but b holds the fewest pages over its share: a goes.
    assert "b0" in running
    assert len(running & {"a0", "a1", "a2"}) == 2


def _teach_cost(core: EngineCore, decode_s: float, per_token_s: float) -> StepCost:
    """Replace what the scheduler's cost model learned with a machine whose decode-only
    step takes ``decode_s`` and whose prefill chunk tokens cost ``per_token_s`` each."""
    model = core.scheduler.budget.cost
    for _ in range(200):  # the real steps' weight decays to nothing
        for rows in (1, 2, 3):
            model.observe(rows, 10 * rows, [], decode_s)
        for tokens in (8, 32, 100):
            model.observe(0, 0, [(0, tokens)], decode_s + per_token_s * tokens)
    fitted = model.fit()
    assert fitted is not None
    return fitted


def _chunk_beside_b_decode(
    tiny: LoadedModel,
    tuning: SchedulerTuning,
    *,
    prefiller: str = "a",
    prompt: int = 400,
    ahead_by: int = 0,
    other_done_ago: float | None = None,
) -> tuple[int, StepCost]:
    """The chunk a ``prompt``-token request of ``prefiller`` gets in its first step while
    tenant b's stream decodes, on a machine taught to take 20 ms a decode and 1 ms a token,
    and the cost model as taught. ``ahead_by``: tokens the prefiller has had beyond its
    lift; ``other_done_ago``: a request of tenant c finished that many seconds before b's
    arrived."""
    clock = FakeClock()
    core = make_core(tiny, config=EngineConfig(warmup=False, tuning=tuning), clock=clock)
    rec = Recorder()
    if other_done_ago is not None:
        core.add(req("c", prompt_ids(5, 10, V), tenant="c", max_tokens=1), rec.sink("c"))
        while core.has_work():
            core.step()
        clock.now += other_done_ago
    b = req("b", prompt_ids(9, 10, V), tenant="b", max_tokens=20, ignore_eos=True)
    core.add(b, rec.sink("b"))
    core.step()  # b is prefilled; it decodes from now on
    core.add(req("a", prompt_ids(1, prompt, V), tenant=prefiller, max_tokens=2), rec.sink("a"))
    core.scheduler.counter.charge(prefiller, ahead_by)
    cost = _teach_cost(core, decode_s=0.020, per_token_s=0.001)
    core.step()
    assert len(rec.tokens("b")) == 2  # the decode ran in the same step as a's chunk
    return _computed(core, "a"), cost


def _tuning(stretch: float, max_step_ms: float, floor: int = 16) -> SchedulerTuning:
    return SchedulerTuning(
        max_step_ms=max_step_ms, decode_stretch=stretch, min_prefill_tokens=floor
    )


def test_a_prefill_chunk_beside_decodes_keeps_the_step_within_twice_a_decode_step(
    tiny: LoadedModel,
) -> None:
    # Prefill may add 1 s to the step, but b is decoding and a has had 1,000 more tokens:
    # a's chunk may add only what the stretch leaves of b's decode-only step, so b's
    # inter-token gap at most doubles.
    got, cost = _chunk_beside_b_decode(tiny, _tuning(2.0, 1000.0), ahead_by=1000)
    decode_s = cost.decode_seconds(1, 11)
    assert got == cost.chunk_tokens((2.0 - 1) * decode_s, 0, step_tokens=1)
    assert cost.decode_seconds(1, 11) + cost.chunk_seconds(0, got, 1) <= 2.0 * decode_s + 1e-9
    # Without the stretch the chunk takes what the 1 s and the token budget allow.
    free, _ = _chunk_beside_b_decode(tiny, _tuning(0.0, 1000.0), ahead_by=1000)
    assert free > 10 * got


def test_a_tenant_owed_service_is_held_only_to_max_step_ms(tiny: LoadedModel) -> None:
    # a, lifted level with b on arrival, is owed service: b's decodes are b's share being
    # spent, so a's chunk may add the whole max_step_ms (one request gets request_share of
    # it while others have work), not just the stretch.
    tuning = _tuning(2.0, 100.0)
    got, cost = _chunk_beside_b_decode(tiny, tuning)
    share_s = tuning.max_step_ms / 1000 * tuning.request_share
    assert got == cost.chunk_tokens(share_s, 0, step_tokens=1)
    # Ahead of b by 1,000 tokens, the same chunk is held to the stretch.
    held, _ = _chunk_beside_b_decode(tiny, tuning, ahead_by=1000)
    assert held == cost.chunk_tokens(cost.decode_seconds(1, 11), 0, step_tokens=1) < got


def test_the_step_time_bound_applies_while_another_tenant_has_work(
    tiny: LoadedModel,
) -> None:
    tuning = _tuning(2.0, 10.0)  # prefill may add a tight 10 ms to a step
    # Another tenant's stream is decoding: the chunk is held to the 10 ms, raised to the
    # prefill floor (a, lifted level with b on arrival, is owed service).
    held, cost = _chunk_beside_b_decode(tiny, tuning)
    bound = cost.chunk_tokens(0.010 * tuning.request_share, 0, step_tokens=1)
    assert held == max(bound, tuning.min_prefill_tokens)
    # The same prompt from the decoding stream's own tenant has nobody to be guarded from:
    # the whole prompt goes in one step (511 tokens of budget are left beside the decode).
    assert _chunk_beside_b_decode(tiny, tuning, prefiller="b")[0] == 400
    # A tenant between two requests is still guarded for idle_grace_s after its last one.
    grace = tuning.idle_grace_s
    assert _chunk_beside_b_decode(tiny, tuning, prefiller="b", other_done_ago=grace / 2)[0] == held
    assert _chunk_beside_b_decode(tiny, tuning, prefiller="b", other_done_ago=grace * 1.5)[0] == 400


def test_beside_anothers_decodes_only_the_least_served_tenant_gets_the_prefill_floor(
    tiny: LoadedModel,
) -> None:
    # No room left by the time bounds at all (prefill may add 1 us, stretch 1): only the
    # prefill floor moves a.
    tuning = _tuning(1.0, 0.001, floor=16)
    # Level with b (a victim whose short prompt must not crawl a token a step): the floor.
    assert _chunk_beside_b_decode(tiny, tuning)[0] == tuning.min_prefill_tokens
    # Ahead of b (an attacker's long prompts beside the victim's stream): one token a step.
    assert _chunk_beside_b_decode(tiny, tuning, ahead_by=1000)[0] == 1
    # ... unless the rest of the prompt fits in the floor: one small chunk finishes it (a
    # victim charged for its prompt's first chunk is briefly ahead of the hog it was lifted to).
    assert _chunk_beside_b_decode(tiny, tuning, prompt=12, ahead_by=1000)[0] == 12


def _decodes_beside_a_heavy_tenant(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, stretch: float, steps: int = 8
) -> dict[str, int]:
    """Tokens each stream gets over ``steps`` steps: tenant a's four streams, 1,000 tokens
    ahead, beside tenant b's one, on a machine taught that a decode step costs 12 ms plus
    5 ms a row (b's row alone: 17 ms; the guard at stretch 2: 34 ms, so b's row and three
    of a's: 32 ms)."""
    tuning = SchedulerTuning(max_step_ms=1000.0, decode_stretch=stretch)
    core = make_core(tiny, config=EngineConfig(warmup=False, tuning=tuning), clock=FakeClock())
    rec = Recorder()
    names = ["a0", "a1", "a2", "a3", "b0"]
    for i, name in enumerate(names):
        r = req(name, prompt_ids(i, 12, V), tenant=name[0], max_tokens=60, ignore_eos=True)
        core.add(r, rec.sink(name))
    while any(len(rec.tokens(n)) == 0 for n in names):
        core.step()
    core.scheduler.counter.charge("a", 1000)
    # The taught machine stays: the tiny model's real steps are not observed.
    monkeypatch.setattr(core.scheduler, "observe_step", lambda shape, seconds: None)
    model = core.scheduler.budget.cost
    for _ in range(200):
        for rows in range(1, 7):
            model.observe(rows, 0, [], 0.012 + 0.005 * rows)
        for tokens in (8, 32, 100):
            model.observe(0, 0, [(0, tokens)], 0.010 + 0.001 * tokens)
    before = {n: len(rec.tokens(n)) for n in names}
    for _ in range(steps):
        core.step()
    return {n: len(rec.tokens(n)) - before[n] for n in names}


def test_a_heavy_tenants_streams_take_turns_beside_a_light_tenants_stream(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = _decodes_beside_a_heavy_tenant(tiny, monkeypatch, stretch=2.0)
    # b, the least served, decodes every step; a's rows fill what b's guard leaves (three
    # a step), and take turns: over 8 steps each of a's four streams decodes 6 times.
    assert got["b0"] == 8
    assert [got[f"a{i}"] for i in range(4)] == [6, 6, 6, 6]
    # Without the guard every row decodes every step.
    assert set(_decodes_beside_a_heavy_tenant(tiny, monkeypatch, stretch=0.0).values()) == {8}


def test_cpu_time_charged_to_a_tenant_counts_as_tokens_it_had_processed(
    tiny: LoadedModel,
) -> None:
    tuning = untimed(max_num_batched_tokens=64)
    core = make_core(tiny, config=EngineConfig(warmup=False, tuning=tuning))
    core.set_tenant_policy("heavy", sched=TenantSchedPolicy(weight=2.0))
    counter = core.scheduler.counter
    # No prefill fitted yet: cpu_seconds_per_token a token.
    unfitted = int(0.25 / tuning.cpu_seconds_per_token + 1e-9)
    assert core.charge_cpu("a", 0.25) == unfitted
    assert core.charge_cpu("heavy", 0.25) == unfitted
    # weighted, as processed tokens
    assert counter["a"] == unfitted and counter["heavy"] == unfitted / 2
    rec = Recorder()
    r = req("p", prompt_ids(1, 200, V), tenant="b", max_tokens=2)
    core.add(r, rec.sink("p"))
    for _ in range(3):
        core.step()
    fit = core.scheduler.budget.cost.fit()
    assert fit is not None and fit.per_token_s > 0
    # Once prefill is measured, a second is what that many prefill tokens would take.
    assert core.charge_cpu("a", 0.25) == int(0.25 / fit.per_token_s + 1e-9)
    # A fraction of a token is carried: four charges of a quarter token make one.
    quarter = fit.per_token_s / 4
    assert [core.charge_cpu("c", quarter) for _ in range(4)] == [0, 0, 0, 1]


def _two_prefills_in_one_step(
    tiny: LoadedModel, with_decoder: bool, a_ahead_by: int = 0
) -> tuple[int, int]:
    """The prompt tokens tenants a and b (400-token prompts each, 100 ms of prefill a step
    beside another tenant's work, no stretch) get in one step on a machine taught to take
    20 ms a decode and 1 ms a token; ``with_decoder``: tenant c's stream decodes in it;
    ``a_ahead_by``: tokens a has had beyond its lift."""
    tuning = _tuning(0.0, 100.0)
    core = make_core(tiny, config=EngineConfig(warmup=False, tuning=tuning), clock=FakeClock())
    rec = Recorder()
    if with_decoder:
        core.add(req("c", prompt_ids(9, 10, V), tenant="c", max_tokens=20, ignore_eos=True),
                 rec.sink("c"))
        core.step()  # c is prefilled; it decodes from now on
    for tenant in ("a", "b"):
        core.add(req(tenant, prompt_ids(ord(tenant), 400, V), tenant=tenant, max_tokens=2),
                 rec.sink(tenant))
    core.scheduler.counter.charge("a", a_ahead_by)
    _teach_cost(core, decode_s=0.020, per_token_s=0.001)
    core.step()
    return _computed(core, "a"), _computed(core, "b")


def test_a_tenants_own_chunks_count_only_against_the_others_bound(tiny: LoadedModel) -> None:
    # Each tenant is guarded against the other's chunks, not its own: a's chunks add
    # max_step_ms to b's step and b's add max_step_ms to a's, so the step carries both
    # (one request gets request_share of it first, the rest goes to the step's chunks).
    a, b = _two_prefills_in_one_step(tiny, with_decoder=False)
    assert a == b == 100
    # A tenant whose streams only decode in the step has no chunk of its own: every chunk is
    # another's, and together they add max_step_ms.
    a, b = _two_prefills_in_one_step(tiny, with_decoder=True)
    assert a + b == 100
    # A tenant more than a step's tokens ahead of another with work has had more than its
    # share: every chunk in the step counts against its chunks. b, the least served, goes
    # first (50 ms, its request's share); a gets what is left of the 100 ms; b's own chunks
    # still count only against a's bound, so b takes the rest of its own.
    a, b = _two_prefills_in_one_step(tiny, with_decoder=False, a_ahead_by=1000)
    assert (a, b) == (50, 100)
