"""The compile executor: large-stack threads, one compile per tenant at a time, tenants in
turn, each job's CPU time reported for charging; and ``outlive_cancel``, which keeps a
cancelled caller (and the stream slot it holds) until a started compile ends."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from service.held_work import outlive_cancel
from service.structured.compile_executor import CompileExecutor
from tests.serverutil import ROOT

_CHILD = """
from service.structured.compile_executor import CompileExecutor
from service.structured.grammar import GrammarLimits, GrammarSpec
from tests.engine.test_grammar import _compiler
from tests.engine.test_grammar_depth import lark_chain
gc = _compiler(GrammarLimits(max_depth=10**9, max_source_bytes=1 << 20))
ex = CompileExecutor()
ex.submit("t", lambda: gc.compile("t", GrammarSpec("lark", lark_chain(6000)))).result()
print("compiled")
"""


def test_a_chain_past_the_depth_limit_compiles_on_the_large_stack_without_crashing() -> None:
    # With the depth limit lifted, a 6,000-rule chain (2,800 killed an 8 MiB thread) must
    # still only cost stack: the process lives. A child, so a crash fails only this test.
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "compiled"


def test_one_job_per_tenant_at_a_time_and_tenants_take_turns() -> None:
    ex = CompileExecutor(workers=1)
    order: list[str] = []
    gate = threading.Event()
    try:
        first = ex.submit("a", gate.wait)  # holds the one worker
        futures = [ex.submit("a", lambda i=i: order.append(f"a{i}")) for i in range(3)]
        futures.append(ex.submit("b", lambda: order.append("b0")))
        assert ex.busy("a") == 4 and ex.busy("b") == 1
        gate.set()
        for f in [first, *futures]:
            f.result(10)
        # b waited behind one of a's jobs, not all of them.
        assert order == ["b0", "a0", "a1", "a2"]
    finally:
        ex.shutdown()


def test_two_workers_never_run_one_tenants_jobs_together() -> None:
    ex = CompileExecutor(workers=2)
    running = {"a": 0}
    most = [0]
    lock = threading.Lock()

    def job() -> None:
        with lock:
            running["a"] += 1
            most[0] = max(most[0], running["a"])
        time.sleep(0.02)
        with lock:
            running["a"] -= 1

    try:
        for f in [ex.submit("a", job) for _ in range(6)]:
            f.result(10)
        assert most[0] == 1
    finally:
        ex.shutdown()


def test_each_jobs_cpu_time_is_reported_with_its_tenant() -> None:
    costs: list[tuple[str, float]] = []
    ex = CompileExecutor(on_cost=lambda t, s: costs.append((t, s)))

    def burn() -> int:
        end = time.thread_time() + 0.05
        n = 0
        while time.thread_time() < end:
            n += 1
        return n

    try:
        ex.submit("acme", burn).result(10)
        with pytest.raises(ZeroDivisionError):
            ex.submit("globex", lambda: 1 // 0).result(10)
        ex.submit("acme", lambda: 1).result(10)  # the thread survived the error
    finally:
        ex.shutdown()
    assert [t for t, _ in costs] == ["acme", "globex", "acme"]
    assert costs[0][1] >= 0.05


def test_a_cancelled_caller_stays_until_started_work_ends_and_queued_work_never_runs() -> None:
    async def main() -> None:
        ex = CompileExecutor(workers=1)
        gate = threading.Event()
        ran: list[str] = []
        try:
            started = ex.submit("a", lambda: (gate.wait(10), ran.append("started")))
            queued = ex.submit("a", lambda: ran.append("queued"))
            held = asyncio.ensure_future(outlive_cancel(started))
            dropped = asyncio.ensure_future(outlive_cancel(queued))
            await asyncio.sleep(0.05)
            held.cancel()
            dropped.cancel()
            await asyncio.sleep(0.1)
            assert dropped.done() and dropped.cancelled()  # never started: gone at once
            assert not held.done()  # started: the caller waits for the thread
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await held
            assert started.done() and ran == ["started"]
        finally:
            ex.shutdown()

    asyncio.run(main())
