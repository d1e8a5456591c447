"""Scheduling on the tiny model: budget packing, chunked prefill, prefix hits, preemption."""

from __future__ import annotations

from kvcache import TenantCachePolicy
from service.engine.core import EngineCore
from service.engine.plan import SchedulerOutput
from service.engine.types import Admitted, Delta, EngineConfig, Finished, Request
from service.model import LoadedModel
from tests.engine.conftest import (
    Recorder,
    assert_at_baseline,
    make_core,
    near_tie_divergences,
    prompt_ids,
    req,
    run_all,
    run_one_at_a_time,
    untimed,
)

V = 384


def spy(core: EngineCore) -> list[SchedulerOutput]:
    outs: list[SchedulerOutput] = []
    schedule = core.scheduler.schedule

    def recorded() -> SchedulerOutput:
        out = schedule()
        outs.append(out)
        return out

    core.scheduler.schedule = recorded  # type: ignore[method-assign]
    return outs


def plan(outs: list[SchedulerOutput]) -> list[list[tuple[str, int]]]:
    return [[(e.seq.seq_id, e.num_new) for e in o.entries] for o in outs]


def mixed_requests(n: int = 12, max_prompt: int = 300) -> list[Request]:
    return [
        req(f"r{i}", prompt_ids(i, 1 + (i * 97) % max_prompt, V), max_tokens=1 + (i * 5) % 12)
        for i in range(n)
    ]


def test_decodes_first_then_prefill_chunks_under_the_budget(tiny: LoadedModel) -> None:
    config = EngineConfig(tuning=untimed(max_num_batched_tokens=64), max_num_seqs=4, warmup=False)
    core = make_core(tiny, config=config)
    outs = spy(core)
    rec = Recorder()
    short = [req(f"s{i}", prompt_ids(i, 3, V), max_tokens=6) for i in range(3)]
    long = req("long", prompt_ids(9, 150, V), max_tokens=2)
    extra = req("extra", prompt_ids(10, 5, V), max_tokens=1)
    run_all(core, rec, [*short, long, extra])
    steps = plan(outs)
    # Step 1: three 3-token prefills, then a 55-token chunk of the long prompt (budget 64).
    assert steps[0] == [("s0", 3), ("s1", 3), ("s2", 3), ("long", 55)]
    # Step 2: the three decodes go first, the long prompt continues with what is left.
    assert steps[1] == [("s0", 1), ("s1", 1), ("s2", 1), ("long", 61)]
    # Step 3: the prompt completes (34 tokens); max_num_seqs=4 keeps "extra" waiting.
    assert steps[2] == [("s0", 1), ("s1", 1), ("s2", 1), ("long", 34)]
    assert rec.admitted("extra").queue_s == 0.0
    assert all(o.num_tokens <= 64 and len(o.entries) <= 4 for o in outs)
    assert_at_baseline(core)


def test_long_prefill_threshold_chunks_one_prompt(tiny: LoadedModel) -> None:
    config = EngineConfig(tuning=untimed(prefill_chunk=32), warmup=False)
    core = make_core(tiny, config=config)
    outs = spy(core)
    run_all(core, Recorder(), [req("a", prompt_ids(1, 100, V), max_tokens=2)])
    assert plan(outs) == [[("a", 32)], [("a", 32)], [("a", 32)], [("a", 4)], [("a", 1)]]


def test_batched_equals_one_at_a_time_with_chunks_and_preemption(tiny: LoadedModel) -> None:
    requests = mixed_requests(16)
    alone, gaps = run_one_at_a_time(make_core(tiny, ttl=0.0), requests)
    for config, pages in [
        (EngineConfig(warmup=False), 512),
        (EngineConfig(tuning=untimed(max_num_batched_tokens=48, prefill_chunk=32), warmup=False), 512),
        (EngineConfig(warmup=False), 24),  # 20 pages hold the longest request alone
    ]:
        core = make_core(tiny, config=config, pages=pages, ttl=0.0)
        rec = Recorder()
        run_all(core, rec, requests)
        got = {r.request_id: rec.tokens(r.request_id) for r in requests}
        assert near_tie_divergences(got, alone, gaps) == []
        if pages == 24:
            assert core.counters().num_preemptions > 0
        assert_at_baseline(core)


def test_preempted_sequence_streams_each_token_once(tiny: LoadedModel) -> None:
    requests = [
        req(f"p{i}", prompt_ids(i, 40, V), max_tokens=30, ignore_eos=True) for i in range(6)
    ]
    alone, _ = run_one_at_a_time(make_core(tiny, ttl=0.0), requests)
    core = make_core(tiny, pages=12, ttl=0.0)  # 6 x 5 pages at the end: must preempt
    rec = Recorder()
    run_all(core, rec, requests)
    assert core.counters().num_preemptions >= 3
    for r in requests:
        events = rec.events[r.request_id]
        assert isinstance(events[0], Admitted)
        assert all(isinstance(e, Delta) and len(e.token_ids) == 1 for e in events[1:-1])
        assert rec.tokens(r.request_id) == alone[r.request_id]
        fin = rec.finished(r.request_id)
        assert fin is not None and fin.reason == "length" and fin.completion_tokens == 30
    assert_at_baseline(core)


def test_prefix_cache_hit_skips_cached_pages_within_tenant_only(tiny: LoadedModel) -> None:
    core = make_core(tiny)
    outs = spy(core)
    prompt = prompt_ids(3, 70, V)
    rec = Recorder()
    run_all(core, rec, [req("first", prompt)])
    run_all(core, rec, [req("again", prompt)])
    run_all(core, rec, [req("other", prompt, tenant="t2")])
    assert [rec.admitted(r).cached_tokens for r in ("first", "again", "other")] == [0, 64, 0]
    assert rec.tokens("again") == rec.tokens("first") == rec.tokens("other")
    firsts = [o.entries[0].num_new for o in outs if o.admitted]
    assert firsts == [70, 6, 70]  # the hit computes only the tail past 4 cached pages
    assert rec.finished("again").cached_tokens == 64
    assert_at_baseline(core)


def test_request_that_can_never_fit_fails_with_request_too_large(tiny: LoadedModel) -> None:
    core = make_core(tiny, pages=8)
    core.set_tenant_policy("small", cache=TenantCachePolicy(max_pages=2))
    rec = Recorder()
    run_all(
        core,
        rec,
        [
            req("huge", prompt_ids(1, 120, V), max_tokens=20),  # 9 pages > 8 in the pool
            req("quota", prompt_ids(2, 30, V), max_tokens=8, tenant="small"),  # 3 pages > quota 2
            req("fits", prompt_ids(3, 100, V), max_tokens=20),  # 8 pages
        ],
    )
    for rid, what in [("huge", "pool"), ("quota", "tenant page quota")]:
        events = rec.events[rid]
        assert len(events) == 1 and isinstance(events[0], Finished)
        assert (
            events[0].reason == "error"
            and events[0].error is not None
            and events[0].error.kind == "too_large"
        )
        assert events[0].error.what == what
    assert rec.finished("fits").reason == "length"
    assert_at_baseline(core)


def test_quota_lowered_under_a_running_request_fails_it_instead_of_looping(
    tiny: LoadedModel,
) -> None:
    core = make_core(tiny)
    rec = Recorder()
    core.add(req("q", prompt_ids(1, 14, V), max_tokens=20, ignore_eos=True), rec.sink("q"))
    core.add(req("other", prompt_ids(2, 14, V), max_tokens=20, ignore_eos=True), rec.sink("other"))
    core.step()  # both admitted with one page each
    core.set_tenant_policy("t1", cache=TenantCachePolicy(max_pages=1))
    while core.has_work():
        core.step()
    # Each needs a second page at token 17; the quota holds one page in all. The newer one is
    # preempted first; the older, then alone under the quota, can never grow: error.
    first = rec.finished("q")
    assert first is not None and first.reason == "error"
    assert (
        first.error is not None
        and first.error.kind == "too_large"
        and first.error.what == "tenant page quota"
    )
    assert first.completion_tokens == 3
    second = rec.finished("other")
    assert second is not None and second.reason == "error"
    assert_at_baseline(core)
