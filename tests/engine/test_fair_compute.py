"""Fair compute and fair memory in the scheduler.

A tenant's long prefills must not hold up another tenant's admission or its decodes; step
tokens are shared by weighted processed-token counts; a tenant whose next request does not
fit is skipped rather than blocking every tenant; and when an overcommitted pool runs out, the
tenant most over its share is the one preempted.
"""

from __future__ import annotations

from kvcache import TenantCachePolicy
from service.engine.types import EngineConfig, TenantSchedPolicy
from service.model import LoadedModel
from tests.engine.conftest import FakeClock, Recorder, make_core, prompt_ids, req

V = 384


def _computed(core: object, request_id: str) -> int:
    sched = core.scheduler  # type: ignore[attr-defined]
    for seq in sched.running:
        if seq.seq_id == request_id:
            return int(seq.num_computed)
    return -1


def test_long_prefills_of_one_tenant_do_not_delay_anothers_first_token(
    tiny: LoadedModel,
) -> None:
    core = make_core(tiny, config=EngineConfig(warmup=False, max_num_batched_tokens=64))
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
    core = make_core(tiny, config=EngineConfig(warmup=False, max_num_batched_tokens=64))
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


def _teach_cost(core: object, decode_s: float, per_token_s: float) -> None:
    """Replace what the scheduler's cost model learned with a machine whose decode-only
    step takes ``decode_s`` and whose prefill chunk tokens cost ``per_token_s`` each."""
    model = core.scheduler.cost  # type: ignore[attr-defined]
    for _ in range(200):  # the real steps' weight decays to nothing
        for rows in (1, 2, 3):
            model.observe(rows, 10 * rows, [], decode_s)
        for tokens in (8, 32, 100):
            model.observe(0, 0, [(0, tokens)], decode_s + per_token_s * tokens)


def _chunk_beside_b_decode(
    tiny: LoadedModel,
    config: EngineConfig,
    *,
    prefiller: str = "a",
    prompt: int = 400,
    ahead_by: int = 0,
    other_done_ago: float | None = None,
    packed_rows: int = 0,
    queued: int = 0,
) -> int:
    """The chunk a ``prompt``-token request of ``prefiller`` gets in its first step while
    tenant b's stream decodes, on a machine taught to take 20 ms a decode and 1 ms a token.
    ``ahead_by``: tokens the prefiller has had beyond its lift; ``other_done_ago``: a request
    of tenant c finished that many seconds before b's arrived; ``packed_rows``: the largest
    batch the model's packed decode weights serve, as the scheduler is told it (0: none);
    ``queued``: more requests of the prefiller waiting behind a's."""
    clock = FakeClock()
    core = make_core(tiny, config=config, clock=clock)
    core.scheduler.cost.packed_rows = packed_rows  # type: ignore[attr-defined]
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
    for i in range(queued):
        q = req(f"q{i}", prompt_ids(20 + i, prompt, V), tenant=prefiller, max_tokens=2)
        core.add(q, rec.sink(f"q{i}"))
    core.scheduler.counter.charge(prefiller, ahead_by)  # type: ignore[attr-defined]
    _teach_cost(core, decode_s=0.020, per_token_s=0.001)
    core.step()
    assert len(rec.tokens("b")) == 2  # the decode ran in the same step as a's chunk
    return _computed(core, "a")


def _chunk_beside_a_decode(
    tiny: LoadedModel, stretch: float, ahead_by: int = 1000, max_step_ms: float = 1000.0
) -> int:
    config = EngineConfig(warmup=False, max_step_ms=max_step_ms, decode_stretch=stretch)
    return _chunk_beside_b_decode(tiny, config, ahead_by=ahead_by)


def test_a_prefill_chunk_beside_decodes_keeps_the_step_within_twice_a_decode_step(
    tiny: LoadedModel,
) -> None:
    # Prefill may add 1 s to the step, but b is decoding and a has had 1,000 more tokens:
    # a's chunk may add only one more decode step's time (20 ms at 1 ms a token), so b's
    # inter-token gap at most doubles.
    assert _chunk_beside_a_decode(tiny, stretch=2.0) == 20
    # Without the stretch the chunk takes what the 1 s and the token budget allow.
    assert _chunk_beside_a_decode(tiny, stretch=0.0) > 200


def test_a_tenant_owed_service_is_held_only_to_max_step_ms(tiny: LoadedModel) -> None:
    # a, lifted level with b on arrival, is owed service: b's decodes are b's share being
    # spent, so a's chunk may add the whole 100 ms (one request gets half of it while
    # others have work: 50 tokens), not just the stretch's 20 ms.
    assert _chunk_beside_a_decode(tiny, stretch=2.0, ahead_by=0, max_step_ms=100.0) == 50
    # Ahead of b by 1,000 tokens, the same chunk is held to the stretch.
    assert _chunk_beside_a_decode(tiny, stretch=2.0, ahead_by=1000, max_step_ms=100.0) == 20


def test_a_timed_step_with_decodes_stays_a_batch_the_packed_weights_serve(
    tiny: LoadedModel,
) -> None:
    config = EngineConfig(warmup=False, max_step_ms=100.0, decode_stretch=2.0)
    # a is owed service: the time target alone gives its chunk 50 tokens (as above).
    assert _chunk_beside_b_decode(tiny, config) == 50
    # Packed weights serve batches of up to 40 tokens: beside b's one decode row the chunk
    # is held to 39, so the step is not moved onto the dense weights with b's row waiting.
    assert _chunk_beside_b_decode(tiny, config, packed_rows=40) == 39
    # ... but never below the prefill floor.
    assert _chunk_beside_b_decode(tiny, config, packed_rows=8) == 16
    # With four requests waiting for prefill the queue fills a big dense step: not held.
    assert _chunk_beside_b_decode(tiny, config, packed_rows=40, queued=2) == 39
    assert _chunk_beside_b_decode(tiny, config, packed_rows=40, queued=3) == 50
    # Untimed (b's own tenant, nobody to guard) the step takes the whole prompt as before.
    assert _chunk_beside_b_decode(tiny, config, prefiller="b", packed_rows=40) == 400


def _chunk_beside_own_decode(
    tiny: LoadedModel, prefiller: str, other_done_ago: float | None = None
) -> int:
    """Prefill may add a tight 10 ms to a step (stretch 2) while b decodes."""
    config = EngineConfig(warmup=False, max_step_ms=10.0, decode_stretch=2.0)
    return _chunk_beside_b_decode(
        tiny, config, prefiller=prefiller, other_done_ago=other_done_ago
    )


def test_the_step_time_target_applies_only_while_two_tenants_have_work(
    tiny: LoadedModel,
) -> None:
    # Another tenant's stream is decoding: the chunk is held to the 10 ms, raised to the
    # 16-token floor (a, lifted level with b on arrival, is no more served).
    assert _chunk_beside_own_decode(tiny, prefiller="a") == 16
    # The same prompt from the decoding stream's own tenant has nobody to be guarded from:
    # the whole prompt goes in one step (511 tokens of budget are left beside the decode).
    assert _chunk_beside_own_decode(tiny, prefiller="b") == 400
    # A tenant between two requests is still guarded for 2 s after its last one ended.
    assert _chunk_beside_own_decode(tiny, prefiller="b", other_done_ago=1.0) == 16
    assert _chunk_beside_own_decode(tiny, prefiller="b", other_done_ago=3.0) == 400


def _floor_chunk(tiny: LoadedModel, a_ahead_by: int, prompt: int = 400) -> int:
    """No room left by the time targets at all (prefill may add 1 ms, stretch 1): only the
    prefill floor moves a."""
    config = EngineConfig(warmup=False, max_step_ms=1.0, decode_stretch=1.0)
    return _chunk_beside_b_decode(tiny, config, prompt=prompt, ahead_by=a_ahead_by)


def test_beside_anothers_decodes_only_the_least_served_tenant_gets_the_prefill_floor(
    tiny: LoadedModel,
) -> None:
    # Level with b (a victim whose short prompt must not crawl a token a step): 16 tokens.
    assert _floor_chunk(tiny, a_ahead_by=0) == 16
    # Ahead of b (an attacker's long prompts beside the victim's stream): one token a step.
    assert _floor_chunk(tiny, a_ahead_by=1000) == 1
    # ... unless the rest of the prompt fits in the floor: one small chunk finishes it (a
    # victim charged for its prompt's first chunk is briefly ahead of the hog it was lifted to).
    assert _floor_chunk(tiny, a_ahead_by=1000, prompt=12) == 12


def _decodes_beside_a_heavy_tenant(tiny: LoadedModel, stretch: float, steps: int = 8) -> dict:
    """Tokens each stream gets over ``steps`` steps: tenant a's four streams, 1,000 tokens
    ahead, beside tenant b's one, on a machine taught that a decode step costs 12 ms plus
    5 ms a row (b's row alone: 17 ms; the guard at stretch 2: 34 ms, so b's row and three
    of a's: 32 ms)."""
    config = EngineConfig(warmup=False, max_step_ms=1000.0, decode_stretch=stretch)
    core = make_core(tiny, config=config, clock=FakeClock())
    rec = Recorder()
    names = ["a0", "a1", "a2", "a3", "b0"]
    for i, name in enumerate(names):
        r = req(name, prompt_ids(i, 12, V), tenant=name[0], max_tokens=60, ignore_eos=True)
        core.add(r, rec.sink(name))
    while any(len(rec.tokens(n)) == 0 for n in names):
        core.step()
    core.scheduler.counter.charge("a", 1000)  # type: ignore[attr-defined]
    # The taught machine stays: the tiny model's real steps are not observed.
    core.scheduler.observe_step = lambda shape, seconds: None  # type: ignore[attr-defined]
    model = core.scheduler.cost  # type: ignore[attr-defined]
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
    tiny: LoadedModel,
) -> None:
    got = _decodes_beside_a_heavy_tenant(tiny, stretch=2.0)
    # b, the least served, decodes every step; a's rows fill what b's guard leaves (three
    # a step), and take turns: over 8 steps each of a's four streams decodes 6 times.
    assert got["b0"] == 8
    assert [got[f"a{i}"] for i in range(4)] == [6, 6, 6, 6]
    # Without the guard every row decodes every step.
    assert set(_decodes_beside_a_heavy_tenant(tiny, stretch=0.0).values()) == {8}



def test_cpu_time_charged_to_a_tenant_counts_as_tokens_it_had_processed(
    tiny: LoadedModel,
) -> None:
    core = make_core(tiny, config=EngineConfig(warmup=False, max_num_batched_tokens=64))
    core.set_tenant_policy("heavy", sched=TenantSchedPolicy(weight=2.0))
    counter = core.scheduler.counter
    assert core.charge_cpu("a", 0.25) == 250  # no prefill fitted yet: 1 ms a token
    assert core.charge_cpu("heavy", 0.25) == 250
    assert counter["a"] == 250 and counter["heavy"] == 125  # weighted, as processed tokens
    rec = Recorder()
    r = req("p", prompt_ids(1, 200, V), tenant="b", max_tokens=2)
    core.add(r, rec.sink("p"))
    for _ in range(3):
        core.step()
    fit = core.scheduler.cost.fit()
    assert fit is not None and fit.per_token_s > 0
    # Once prefill is measured, a second is what that many prefill tokens would take.
    assert core.charge_cpu("a", 0.25) == int(0.25 / fit.per_token_s + 1e-9)
    # A fraction of a token is carried: four charges of a quarter token make one.
    quarter = fit.per_token_s / 4
    assert [core.charge_cpu("c", quarter) for _ in range(4)] == [0, 0, 0, 1]
