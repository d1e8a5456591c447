"""Request lifecycle on the tiny model: abort, deadline, fence, stopping, seeds, queue bounds."""

from __future__ import annotations

import dataclasses

import pytest

from service.engine.core import EngineCore
from service.engine.types import (
    Delta,
    EngineConfig,
    InvalidRequest,
    QueueFull,
    RequestTooLarge,
    SamplingParams,
    TenantSchedPolicy,
)
from service.model import LoadedModel
from tests.engine.conftest import (
    FakeClock,
    Recorder,
    assert_at_baseline,
    make_core,
    prompt_ids,
    req,
    run_all,
    untimed,
)

V = 384


def pages_in_use(core: EngineCore, tenant: str = "t1") -> int:
    return core.usage(tenant).pages_in_use


def test_abort_mid_prefill_and_mid_decode_frees_pages_within_one_step(tiny: LoadedModel) -> None:
    core = make_core(tiny, config=EngineConfig(tuning=untimed(prefill_chunk=16), warmup=False))
    rec = Recorder()
    core.add(req("pre", prompt_ids(1, 100, V), max_tokens=5), rec.sink("pre"))
    core.add(req("dec", prompt_ids(2, 10, V), max_tokens=50, ignore_eos=True), rec.sink("dec"))
    for _ in range(3):
        core.step()
    pre = core.scheduler.running[0]
    assert pre.seq_id == "pre" and pre.num_computed == 48  # still mid-prefill
    assert len(rec.tokens("dec")) == 3  # mid-decode
    assert pages_in_use(core) == 3 + 1
    core.abort("pre")
    core.abort("dec")
    core.step()
    for rid, done in [("pre", 0), ("dec", 3)]:
        fin = rec.finished(rid)
        assert fin is not None and fin.reason == "abort" and fin.completion_tokens == done
    assert pages_in_use(core) == 0
    assert_at_baseline(core)


def test_deadline_running_and_waiting(tiny: LoadedModel) -> None:
    clock = FakeClock()
    core = make_core(tiny, clock=clock, config=EngineConfig(max_num_seqs=1, warmup=False))
    rec = Recorder()
    run = req("run", prompt_ids(1, 20, V), max_tokens=50, ignore_eos=True)
    wait = req("wait", prompt_ids(2, 20, V), max_tokens=5)
    core.add(dataclasses.replace(run, deadline=clock.now + 10), rec.sink("run"))
    core.add(dataclasses.replace(wait, deadline=clock.now + 5), rec.sink("wait"))
    core.step()
    core.step()
    clock.now += 6
    core.step()
    fin = rec.finished("wait")
    assert fin is not None and fin.reason == "deadline" and fin.completion_tokens == 0
    assert len(rec.events["wait"]) == 1  # never admitted
    clock.now += 5
    core.step()
    fin = rec.finished("run")
    assert fin is not None and fin.reason == "deadline" and fin.completion_tokens == 3
    assert pages_in_use(core) == 0
    assert_at_baseline(core)


def test_finished_requests_leave_the_deadline_heap(tiny: LoadedModel) -> None:
    """1,500 requests with a long timeout that finish normally must not pile up in the
    deadline heap until their (far) deadlines pass."""
    clock = FakeClock()
    core = make_core(tiny, clock=clock, config=EngineConfig(max_num_seqs=64, warmup=False))
    rec = Recorder()
    peak = 0
    for i in range(1500):
        r = req(f"d{i}", [3 + i % 300], max_tokens=1, ignore_eos=True)
        core.add(dataclasses.replace(r, deadline=clock.now + 3600.0), rec.sink(r.request_id))
        if i % 64 == 63:
            while core.has_work():
                core.step()
        peak = max(peak, core.counters().num_deadlines)
    while core.has_work():
        core.step()
    assert all(rec.finished(f"d{i}").reason == "length" for i in range(1500))
    assert peak <= 2 * 64 + 16  # bounded by the live requests, not by all ever added
    assert core.counters().num_deadlines <= 16


def test_fence_violation_fails_only_the_affected_request(tiny: LoadedModel) -> None:
    requests = [req(f"f{i}", prompt_ids(i, 30, V), max_tokens=6, ignore_eos=True) for i in range(3)]
    reference = Recorder()
    run_all(make_core(tiny), reference, requests)
    core = make_core(tiny)
    rec = Recorder()
    for r in requests:
        core.add(r, rec.sink(r.request_id))
    core.step()
    core.step()
    core.hooks.inject_stale_page("t1", "f1")  # a page that changed hands under f1
    emitted = len(rec.tokens("f1"))
    while core.has_work():
        core.step()
    fin = rec.finished("f1")
    assert (
        fin is not None
        and fin.reason == "error"
        and fin.error is not None
        and fin.error.kind == "kv_fence"
    )
    assert len(rec.tokens("f1")) == emitted == 2
    for rid in ("f0", "f2"):
        assert rec.tokens(rid) == reference.tokens(rid)
    assert core.stats().cache.fence_violations >= 1
    # The engine released everything but the page kvcache refuses to free through a stale ref.
    assert pages_in_use(core) == 1 and not core.has_work()
    again = Recorder()
    run_all(core, again, [req("after", prompt_ids(0, 30, V), max_tokens=6, ignore_eos=True)])
    assert again.tokens("after") == reference.tokens("f0")
    assert pages_in_use(core) == 1


def test_stop_token_min_tokens_and_ignore_eos(tiny: LoadedModel) -> None:
    prompt = prompt_ids(5, 12, V)
    base = Recorder()
    run_all(make_core(tiny), base, [req("b", prompt, max_tokens=12, ignore_eos=True)])
    toks = base.tokens("b")
    stop_at = next(i for i, t in enumerate(toks) if t not in toks[:i] and i >= 2)
    core = make_core(tiny)
    rec = Recorder()
    stop = toks[stop_at]
    run_all(core, rec, [req("s", prompt, max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))])
    assert rec.tokens("s") == toks[: stop_at + 1]
    assert rec.finished("s").reason == "stop"
    # min_tokens beyond the stop position bans the stop token until then.
    run_all(
        core,
        rec,
        [
            req(
                "m",
                prompt,
                max_tokens=12,
                ignore_eos=True,
                stop_token_ids=(stop,),
                min_tokens=stop_at + 2,
            )
        ],
    )
    got = rec.tokens("m")
    assert got[:stop_at] == toks[:stop_at] and got[stop_at] != stop
    assert stop not in got[: stop_at + 2]
    assert_at_baseline(core)


def test_stop_string_across_tokens_is_trimmed_and_text_matches_full_decode(
    tiny: LoadedModel,
) -> None:
    tok = tiny.tokenizer
    prompt = prompt_ids(7, 16, V)
    base = Recorder()
    run_all(make_core(tiny), base, [req("b", prompt, max_tokens=24, ignore_eos=True)])
    ids = base.tokens("b")
    full = tok.decode(ids, skip_special_tokens=True)
    assert base.text("b") == full
    # A stop string that straddles a token boundary: end of token k + start of token k+1.
    pieces = [tok.decode([t], skip_special_tokens=True) for t in ids]
    k = next(
        i
        for i in range(2, len(ids) - 1)
        if pieces[i]
        and pieces[i + 1]
        and "\ufffd" not in pieces[i] + pieces[i + 1]
        and ids[i] not in tok.special_ids()
        and ids[i + 1] not in tok.special_ids()
    )
    stop = pieces[k][-1] + pieces[k + 1][0]
    cut = full.index(stop)
    rec = Recorder()
    run_all(make_core(tiny), rec, [req("s", prompt, max_tokens=24, ignore_eos=True, stop=(stop,))])
    assert rec.text("s") == full[:cut]
    assert rec.finished("s").reason == "stop"
    assert rec.tokens("s") == ids[: len(rec.tokens("s"))]


def test_real_tokenizer_deltas_keep_emoji_and_cjk_whole(tiny: LoadedModel) -> None:
    from service.engine.detokenizer import IncrementalDetokenizer
    from service.engine.stop import StopMatcher

    tok = tiny.tokenizer
    text = "Größe 日本語のテキスト 🙂🚀 中文字符 한국어"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok.id_to_token_bytes, tok.special_ids(), StopMatcher(()))
    deltas = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len(text.encode("utf-8")) // 4  # tokens do split the multi-byte chars
    assert any(d == "" for d in deltas[:-1])


def test_seed_reproducible_across_batch_compositions(tiny: LoadedModel) -> None:
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    target = req("x", prompt_ids(1, 25, V), max_tokens=16, sampling=sampling, ignore_eos=True)
    alone = Recorder()
    run_all(make_core(tiny, sampler_seed=1), alone, [target])
    noise = SamplingParams(temperature=1.2)
    crowd = [
        req(f"n{i}", prompt_ids(10 + i, 5 + 30 * i, V), max_tokens=9, sampling=noise)
        for i in range(5)
    ]
    mixed = Recorder()
    core = make_core(
        tiny, sampler_seed=2, config=EngineConfig(tuning=untimed(max_num_batched_tokens=40), warmup=False)
    )
    run_all(core, mixed, [*crowd[:3], target, *crowd[3:]])
    assert mixed.tokens("x") == alone.tokens("x")
    other = Recorder()
    reseeded = req(
        "x", target.prompt_ids, max_tokens=16, sampling=SamplingParams(seed=99), ignore_eos=True
    )
    run_all(make_core(tiny), other, [reseeded])
    assert other.tokens("x") != alone.tokens("x")


def test_queue_full_and_invalid_requests_raise_at_once(tiny: LoadedModel) -> None:
    core = make_core(tiny)
    core.set_tenant_policy("t1", TenantSchedPolicy(max_waiting=2))
    rec = Recorder()
    core.add(req("a", [5]), rec.sink("a"))
    core.add(req("b", [5]), rec.sink("b"))
    with pytest.raises(QueueFull):
        core.add(req("c", [5]), rec.sink("c"))
    core.add(req("c", [5], tenant="t2"), rec.sink("c"))  # other tenants are unaffected
    with pytest.raises(InvalidRequest):
        core.add(req("a", [5], tenant="t3"), rec.sink("a"))  # duplicate id
    # The service prepares every request; a broken one is a bug, caught by an assertion.
    with pytest.raises(AssertionError):
        core.add(req("e", []), rec.sink("e"))
    with pytest.raises(AssertionError):
        core.add(req("v", [V]), rec.sink("v"))
    with pytest.raises(InvalidRequest):
        core.add(req("w", [5], tenant="__kvfence_warmup__"), rec.sink("w"))
    with pytest.raises(RequestTooLarge):
        core.add(req("l", [5] * 2048), rec.sink("l"))
    core.finish_all("abort")
    assert [rec.finished(r).reason for r in "abc"] == ["abort"] * 3
    assert_at_baseline(core)


def test_logprobs_in_deltas(tiny: LoadedModel) -> None:
    core = make_core(tiny)
    rec = Recorder()
    r = req("lp", prompt_ids(3, 9, V), max_tokens=4, ignore_eos=True)
    core.add(dataclasses.replace(r, logprobs=3), rec.sink("lp"))
    while core.has_work():
        core.step()
    deltas = [e for e in rec.events["lp"] if isinstance(e, Delta)]
    assert len(deltas) == 4
    for d in deltas:
        (lp,) = d.logprobs
        assert lp.token_id == d.token_ids[0] == lp.top[0][0]  # greedy picks the top-1
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob == pytest.approx(lp.top[0][1])
