"""Where tokenization runs: dedicated worker threads shared fairly between tenants, with
each tenant's tokenizer time charged and bounded.

The tokenizer releases the GIL (see ``service.model.tokenizer``), so a long text does not
stall the event loop, but it takes a core for as long as it runs, and on a machine whose
cores all run the engine's OpenMP regions that stalls every step: one serial caller sending
20 KB texts (49 calls a second) pushed another tenant's inter-token gap from 7 to 192 ms.
So the pool bounds it three ways:

- **Turns.** At most ``workers`` tokenizations run at once and at most one per tenant; since
  each tenant has at most one call waiting for a worker, tenants take turns (the semaphore
  wakes waiters in order).
- **Budget.** Each tenant's tokenizer time is a bucket of CPU seconds refilled at
  ``cpu_share`` seconds a second (up to ``burst_s``); a call waits until its tenant's bucket
  is not in debt, then its measured thread time is taken from it. A flooding tenant gets
  ``cpu_share`` of one core for tokenizing; an occasional long prompt runs at once.
- **Charge.** Each call's thread CPU time goes to ``on_cost`` with the tenant (the server
  charges it to the tenant's fair share of the engine).

The threads are the pool's own, not asyncio's default executor, and a call's caller is
held until its thread finishes even when cancelled (``outlive_cancel``), so the stream slot
it holds stays taken and cancelling calls cannot pile up work beyond ``workers``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from service.held_work import outlive_cancel

T = TypeVar("T")


@dataclass(slots=True)
class _Budget:
    seconds: float  # CPU seconds the tenant may still use; negative: in debt
    at: float


class TokenizerPool:
    """Runs blocking tokenizer calls off the event loop, one per tenant, ``workers`` in all."""

    def __init__(
        self,
        workers: int = 1,
        *,
        cpu_share: float = 0.25,
        burst_s: float = 0.5,
        on_cost: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if cpu_share <= 0 or burst_s <= 0:
            raise ValueError("cpu_share and burst_s must be > 0")
        self._slots = asyncio.Semaphore(workers)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="kvfence-tokenize"
        )
        self._tenants: dict[str, asyncio.Lock] = {}  # bounded by the tenants file
        self._budgets: dict[str, _Budget] = {}
        self._cpu_share = cpu_share
        self._burst_s = burst_s
        self._on_cost = on_cost
        self._clock = clock

    async def run(self, tenant: str, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread, after the tenant's earlier calls, its turn, and
        its tokenizer budget."""
        lock = self._tenants.setdefault(tenant, asyncio.Lock())
        async with lock:
            await asyncio.sleep(self._debt_wait(tenant))
            async with self._slots:
                spent: list[float] = []
                try:
                    return await outlive_cancel(self._executor.submit(_timed, fn, spent))
                finally:
                    if spent:  # the thread ran (it has finished: outlive_cancel waited)
                        self.spend(tenant, spent[0])

    def _debt_wait(self, tenant: str) -> float:
        """Seconds until the tenant's bucket is out of debt (0: now)."""
        budget = self._refill(tenant)
        return 0.0 if budget.seconds >= 0 else -budget.seconds / self._cpu_share

    def _refill(self, tenant: str) -> _Budget:
        now = self._clock()
        budget = self._budgets.get(tenant)
        if budget is None:
            budget = self._budgets[tenant] = _Budget(self._burst_s, now)
        budget.seconds = min(self._burst_s, budget.seconds + (now - budget.at) * self._cpu_share)
        budget.at = now
        return budget

    def spend(self, tenant: str, seconds: float) -> None:
        """Take ``seconds`` of tokenizer time from the tenant's budget and charge it."""
        self._refill(tenant).seconds -= seconds
        if self._on_cost is not None:
            self._on_cost(tenant, seconds)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _timed(fn: Callable[[], T], spent: list[float]) -> T:
    """``fn()``; its thread CPU time is appended to ``spent`` whatever the outcome."""
    began = time.thread_time()
    try:
        return fn()
    finally:
        spent.append(time.thread_time() - began)
