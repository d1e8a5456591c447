"""The threads grammars compile on: few, with large stacks, taken in turn by tenants.

A compile is tenant-controlled native work. Three rules bound it:

- **Stack.** The threads are started with ``stack_bytes`` of stack (256 MiB by default,
  reserved address space; only touched pages cost memory). ``grammar_depth`` refuses specs
  whose references chain deeper than a stated limit, and the large stack is the margin for
  whatever that bound misses: a chain of 2,800 Lark rules that overflowed an 8 MiB stack
  uses about 3% of this one.
- **Turns.** At most ``workers`` compiles run at once, at most one per tenant, and waiting
  tenants are served in turn (round robin), so a tenant flooding compiles waits behind its
  own and another tenant waits for at most one compile of each other tenant.
- **Cost.** Each job's thread CPU time is measured and handed to ``on_cost`` with the
  tenant, so the caller can charge it.

This is separate from the tokenizer pool and asyncio's default executor: compiles cannot
take the threads that tokenize prompts, nor the other way round.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_STACK_BYTES = 256 * 1024 * 1024
_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide: set it, start, restore


class CompileExecutor:
    """Runs blocking compile jobs on dedicated large-stack threads, one per tenant at a time."""

    def __init__(
        self,
        workers: int = 1,
        stack_bytes: int = DEFAULT_STACK_BYTES,
        on_cost: Callable[[str, float], None] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._on_cost = on_cost
        self._cond = threading.Condition()
        self._queues: dict[str, deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]]
        self._queues = {}
        self._ring: deque[str] = deque()  # tenants with a queued job and none running
        self._running: set[str] = set()
        self._closed = False
        self._threads: list[threading.Thread] = []
        with _STACK_LOCK:
            previous = threading.stack_size(stack_bytes)
            try:
                for i in range(workers):
                    thread = threading.Thread(
                        target=self._work, name=f"kvfence-compile-{i}", daemon=True
                    )
                    thread.start()
                    self._threads.append(thread)
            finally:
                threading.stack_size(previous)

    def submit(self, tenant: str, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``fn()`` for ``tenant``; it runs after the tenant's earlier jobs, in turn."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("compile executor is shut down")
            queue = self._queues.setdefault(tenant, deque())
            queue.append((fn, future))
            if tenant not in self._running and tenant not in self._ring:
                self._ring.append(tenant)
            self._cond.notify()
        return future

    def busy(self, tenant: str) -> int:
        """The tenant's jobs queued or running."""
        with self._cond:
            return len(self._queues.get(tenant, ())) + (tenant in self._running)

    def shutdown(self) -> None:
        """Stop taking jobs; queued ones are cancelled, running ones finish."""
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for _, future in queue:
                    future.cancel()
            self._queues.clear()
            self._ring.clear()
            self._cond.notify_all()

    def _next(self) -> tuple[str, Callable[[], Any], concurrent.futures.Future[Any]] | None:
        with self._cond:
            while not self._ring and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            tenant = self._ring.popleft()
            queue = self._queues[tenant]
            fn, future = queue.popleft()
            if not queue:
                del self._queues[tenant]
            self._running.add(tenant)
            return tenant, fn, future

    def _done(self, tenant: str) -> None:
        with self._cond:
            self._running.discard(tenant)
            if tenant in self._queues:
                self._ring.append(tenant)  # its next job waits for the others' turns
                self._cond.notify()

    def _charge(self, tenant: str, seconds: float) -> None:
        if self._on_cost is None:
            return
        try:
            self._on_cost(tenant, seconds)
        except Exception:
            return

    def _work(self) -> None:
        while (job := self._next()) is not None:
            tenant, fn, future = job
            try:
                if future.set_running_or_notify_cancel():
                    began = time.thread_time()
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # the caller gets it; this thread lives on
                        future.set_exception(exc)
                    finally:
                        self._charge(tenant, time.thread_time() - began)
            finally:
                self._done(tenant)
