"""Tokenization is charged to the tenant that asks for it.

``Tokenize`` honours the tenant's ``models`` and its limits like ``Generate``; the input is
charged by its size before the tokenizer runs; the tokenizer releases the GIL and tenants take
turns at it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from protos.kvfence.v1 import inference_pb2
from service.admission.tokenizer_pool import TokenizerPool
from tests.serverutil import ServerHandle
from tests.service.rpc import details, request, stubs


def test_tokenize_honours_the_tenants_models(srv: ServerHandle) -> None:
    inference, _ = stubs(srv)
    with pytest.raises(grpc.RpcError) as info:
        inference.Tokenize(
            inference_pb2.TokenizeRequest(text="Hello"), metadata=srv.auth("other_model")
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert details(info.value)["ErrorInfo"].reason == "MODEL"
    ok = inference.Tokenize(inference_pb2.TokenizeRequest(text="Hello"), metadata=srv.auth("acme"))
    assert len(ok.token_ids) > 0


class _CountingTokenizer:
    """Wraps the server's tokenizer and counts encode calls."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        return list(self._inner.encode(text, add_special_tokens))


def _counting(srv: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> _CountingTokenizer:
    prompts = srv.server.prep.prompts
    spy = _CountingTokenizer(prompts._tok)
    monkeypatch.setattr(prompts, "_tok", spy)
    return spy


def test_input_is_charged_before_the_tokenizer_runs(
    srv: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # slow_rate: 60 tokens per minute. 400 bytes are charged 100 tokens: refused untokenized.
    spy = _counting(srv, monkeypatch)
    inference, _ = stubs(srv)
    text = "word " * 80
    with pytest.raises(grpc.RpcError) as gen:
        list(inference.Generate(request(text, max_tokens=1), metadata=srv.auth("slow_rate")))
    with pytest.raises(grpc.RpcError) as tok:
        inference.Tokenize(inference_pb2.TokenizeRequest(text=text), metadata=srv.auth("slow_rate"))
    for info in (gen, tok):
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details(info.value)["QuotaFailure"].violations[0].subject == "tokens_per_minute"
    assert spy.calls == 0
    inference.Tokenize(inference_pb2.TokenizeRequest(text="hi"), metadata=srv.auth("acme"))
    assert spy.calls == 1


def test_tokenize_takes_a_concurrency_slot(
    srv: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one_stream: one call at a time, Tokenize included.
    release = threading.Event()
    spy = _counting(srv, monkeypatch)
    inner = spy.encode

    def slow_encode(text: str, add_special_tokens: bool = False) -> list[int]:
        release.wait(10)
        return inner(text, add_special_tokens)

    monkeypatch.setattr(spy, "encode", slow_encode)
    inference, _ = stubs(srv)
    first = inference.Tokenize.future(
        inference_pb2.TokenizeRequest(text="one"), metadata=srv.auth("one_stream")
    )
    deadline = time.monotonic() + 10
    while srv.server.limiter.active("one_stream") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        with pytest.raises(grpc.RpcError) as info:
            inference.Tokenize(
                inference_pb2.TokenizeRequest(text="two"), metadata=srv.auth("one_stream")
            )
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details(info.value)["QuotaFailure"].violations[0].subject == (
            "max_concurrent_streams"
        )
    finally:
        release.set()
    assert len(first.result(10).token_ids) > 0
    assert srv.server.limiter.active("one_stream") == 0


def _run(pool: TokenizerPool, calls: list[tuple[str, float]], log: list[str]) -> None:
    def job(name: str, seconds: float) -> Callable[[], None]:
        def work() -> None:
            time.sleep(seconds)
            log.append(name)

        return work

    async def main() -> None:
        tasks = []
        for name, seconds in calls:
            tasks.append(asyncio.create_task(pool.run(name[0], job(name, seconds))))
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_pool_lets_tenants_take_turns() -> None:
    # Tenant a queues three jobs first; b's one job runs right after a's first, not last.
    log: list[str] = []
    _run(TokenizerPool(workers=1), [("a1", 0.1), ("a2", 0.1), ("a3", 0.1), ("b1", 0.01)], log)
    assert log == ["a1", "b1", "a2", "a3"]


def test_pool_holds_the_slot_until_a_cancelled_call_finishes() -> None:
    running: list[int] = []
    active = [0]

    def work() -> None:
        active[0] += 1
        running.append(active[0])
        time.sleep(0.1)
        active[0] -= 1

    async def main() -> None:
        pool = TokenizerPool(workers=1)
        first = asyncio.create_task(pool.run("a", work))
        await asyncio.sleep(0.02)
        first.cancel()
        await pool.run("b", work)  # must wait for a's thread although a's caller left

    asyncio.run(main())
    assert running == [1, 1]


def test_tokenizer_releases_the_gil(default_model: Any) -> None:
    """A long encode must let other Python threads (the event loop, the engine) run."""
    tok = default_model.tokenizer
    text = "".join(chr(97 + (i * 7919) % 26) + (" " if i % 7 == 0 else "") for i in range(200_000))
    wakeups = 0
    worker = threading.Thread(target=tok.encode, args=(text,))
    start = time.perf_counter()
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        wakeups += 1
    took = time.perf_counter() - start
    assert took > 0.05, "the text should take a while to encode"
    # Holding the GIL gives the loop one or two turns for the whole encode.
    assert wakeups >= max(5, int(took / 0.001 / 20)), (wakeups, took)


def test_text_over_the_byte_cap_is_refused_untokenized(
    srv: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.admission.request_fields import TEXT_BYTES_PER_TOKEN

    spy = _counting(srv, monkeypatch)
    inference, _ = stubs(srv)
    limit = srv.server.prep.model.max_model_len - 1
    assert TEXT_BYTES_PER_TOKEN <= 8  # about 2x what real text costs a token
    with pytest.raises(grpc.RpcError) as info:
        inference.Tokenize(
            inference_pb2.TokenizeRequest(text="a" * (limit * TEXT_BYTES_PER_TOKEN + 1)),
            metadata=srv.auth("acme"),
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert spy.calls == 0


def _burn(seconds: float) -> Callable[[], None]:
    def work() -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    return work


def test_a_tenants_tokenizer_time_is_held_to_its_share_and_charged() -> None:
    costs: list[tuple[str, float]] = []
    now = [100.0]  # the budget's clock stands still: only what was spent counts

    async def main() -> tuple[float, float]:
        pool = TokenizerPool(workers=1, cpu_share=0.25, burst_s=0.1,
                             on_cost=lambda t, s: costs.append((t, s)), clock=lambda: now[0])
        await pool.run("flood", _burn(0.02))  # within the burst: at once
        pool.spend("flood", 0.23)  # 0.25 s spent of a 0.1 s burst: 0.15 s in debt
        began = time.monotonic()
        await pool.run("flood", lambda: None)  # waits the debt out at a quarter core
        flood_s = time.monotonic() - began
        began = time.monotonic()
        await pool.run("other", lambda: None)  # another tenant's budget is its own
        return flood_s, time.monotonic() - began

    flood_s, other_s = asyncio.run(main())
    assert flood_s >= 0.15 / 0.25 * 0.95, flood_s
    assert other_s < flood_s / 2, (other_s, flood_s)
    assert [t for t, _ in costs] == ["flood", "flood", "flood", "other"]
    assert costs[0][1] >= 0.02 and costs[1][1] == 0.23  # measured thread time, then spent


def test_a_cancelled_callers_call_ends_only_when_its_thread_does() -> None:
    async def main() -> None:
        pool = TokenizerPool(workers=1)
        call = asyncio.create_task(pool.run("a", lambda: time.sleep(0.3)))
        await asyncio.sleep(0.05)
        call.cancel()
        await asyncio.sleep(0.1)
        assert not call.done()  # the caller (and the stream slot it holds) is still there
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())
