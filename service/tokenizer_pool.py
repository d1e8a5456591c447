"""Where tokenization runs: worker threads shared fairly between tenants.

The tokenizer releases the GIL (see ``service.model.tokenizer``), so a long text no longer
stalls the event loop, but it still takes a core for as long as it runs. The pool bounds that:
at most ``workers`` tokenizations run at once and at most one per tenant, and since each
tenant has at most one call waiting for a worker, tenants take turns (the semaphore wakes
waiters in order). A tenant that floods the tokenizer waits behind its own calls; another
tenant waits for at most one of them.

A worker slot is held until the thread finishes, even when the caller is cancelled, so
cancelling calls cannot pile up threads beyond ``workers``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class TokenizerPool:
    """Runs blocking tokenizer calls off the event loop, one per tenant, ``workers`` in all."""

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._slots = asyncio.Semaphore(workers)
        self._tenants: dict[str, asyncio.Lock] = {}  # bounded by the tenants file

    async def run(self, tenant: str, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread, after the tenant's earlier calls and its turn."""
        lock = self._tenants.setdefault(tenant, asyncio.Lock())
        await lock.acquire()
        try:
            await self._slots.acquire()
        except BaseException:
            lock.release()
            raise
        work = asyncio.get_running_loop().run_in_executor(None, fn)

        def done(_: asyncio.Future[T]) -> None:
            self._slots.release()
            lock.release()

        work.add_done_callback(done)
        # NOTE: shielded, so a cancelled caller leaves the slot taken until the thread ends.
        return await asyncio.shield(work)
