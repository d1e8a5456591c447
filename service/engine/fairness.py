"""Who is owed service: one currency, weighted processed tokens (a virtual token counter).

Every prefill or decode token a step computes for a tenant adds ``1 / weight`` to its count
(``TokenCounter``, after Sheng et al., OSDI'24). Everything the scheduler decides about
tenants follows from the counts, with what the step being planned already gave
(``FairShare.served``):

- admission: the next request comes from the eligible tenant with the lowest count
  (``TenantQueues.peek``), each tenant's queue in order;
- prefill chunks: the running prefill or waiting request of the lowest count goes first;
- decode rows: the least-served decoding tenant's rows always run; other tenants' rows join
  least-served tenant first, each tenant's rows taking turns (``FairShare.decode_order``);
- a tenant is *owed* service in a step when no decoding tenant in it has a lower count.

Lag bound: a chunk goes to a tenant only while its count is no higher than that of every
tenant whose schedulable work gets nothing before it in the step, so while tenants a and b
both have prefill work the scheduler can run, a's count exceeds b's by at most what one
step gives one tenant: ``max_num_batched_tokens / weight_a`` (tests/engine/
test_scheduler_properties.py checks it over random arrivals). A tenant that comes back
after being idle starts level with the lowest active count (``TokenCounter.lift``), so idle
time earns no credit to burst with later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    @property
    def tenant(self) -> str: ...


T = TypeVar("T", bound=Queued)


class _Row(Protocol):
    @property
    def tenant(self) -> str: ...

    @property
    def admit_order(self) -> int: ...


RowT = TypeVar("RowT", bound=_Row)


class TokenCounter:
    """Weighted tokens each tenant has had processed."""

    def __init__(self, weight: Callable[[str], float]) -> None:
        self._weight = weight
        self._count: dict[str, float] = {}

    def __getitem__(self, tenant: str) -> float:
        return self._count.get(tenant, 0.0)

    def charge(self, tenant: str, tokens: int) -> None:
        self._count[tenant] = self[tenant] + tokens / self._weight(tenant)

    def lift(self, tenant: str, active: Iterable[str]) -> None:
        """Bring a returning tenant up to the lowest count among the ``active`` others, or,
        when none is active, to the highest count of any tenant.
        NOTE: lifting only to active tenants, a newcomer arriving while the one other tenant
        was between two requests kept a count of 0 against that tenant's hundreds, and was
        served ahead of its decodes until it caught up (victim gap p50 under the long-prefill
        flood, one full run each: 0.058 s lifting only to active tenants, 0.051 s as here)."""
        others = [self[t] for t in active if t != tenant]
        floor = min(others) if others else max(self._count.values(), default=0.0)
        if self[tenant] < floor:
            self._count[tenant] = floor

    def forget(self, keep: Iterable[str]) -> None:
        """Drop tenants with no work (bounded memory); the rest keep their counts."""
        keep_set = set(keep)
        for tenant in [t for t in self._count if t not in keep_set]:
            del self._count[tenant]


class FairShare:
    """The counts as the scheduler reads them while planning one step: the counter plus
    what the step already gave (``spend``; ``new_step`` clears it)."""

    def __init__(self, weight: Callable[[str], float]) -> None:
        self._policy_weight = weight
        self._weights: dict[str, float] = {}  # the step's weights, read once per tenant
        self.counter = TokenCounter(weight)
        self._spent: dict[str, int] = {}  # tokens given per tenant in the step being planned
        self._cursor: dict[str, int] = {}  # tenant -> admit order of its last row that ran

    def new_step(self) -> None:
        self._spent = {}
        self._weights = {}  # read anew each step: a policy changed between steps applies

    def _weight(self, tenant: str) -> float:
        w = self._weights.get(tenant)
        if w is None:
            w = self._weights[tenant] = self._policy_weight(tenant)
        return w

    def spend(self, tenant: str, tokens: int) -> None:
        self._spent[tenant] = self._spent.get(tenant, 0) + tokens

    def served(self, tenant: str) -> float:
        """The tenant's weighted processed tokens, with what this step already gave it."""
        return self.counter[tenant] + self._spent.get(tenant, 0) / self._weight(tenant)

    def order(self, tenant: str, admit_order: int) -> tuple[float, int]:
        """Sort key: lowest count first, then the earlier admission."""
        return self.served(tenant), admit_order

    def owed(self, tenant: str, decoding: Iterable[str]) -> bool:
        """Whether no other tenant decoding in the step has a lower count than ``tenant``:
        the step's decodes then belong to tenants that have had at least their share, and
        stretching their gap is their share being spent."""
        mine = self.served(tenant)
        return all(mine <= self.served(t) for t in decoding if t != tenant)

    def level(self, tenant: str, among: Iterable[str], tokens: int) -> bool:
        """Whether ``tenant``'s count is within ``tokens`` (one step's, counted at the
        lighter weight of the two) of the least-served tenant ``among``: a tenant further
        ahead has had more than a step's share beyond it."""
        least = min(among, key=self.served, default=tenant)
        lighter = min(self._weight(tenant), self._weight(least))
        return self.served(tenant) - self.served(least) <= tokens / lighter

    def decode_order(self, rows: Sequence[RowT]) -> tuple[list[RowT], list[RowT]]:
        """``rows`` split into the least-served tenants' (always run) and the others in the
        order they may join: least-served tenant first, each tenant's rows after the last
        one that ran first (round robin within the tenant)."""
        served = {t: self.served(t) for t in {r.tenant for r in rows}}
        least = min(served.values(), default=0.0)
        first = [r for r in rows if served[r.tenant] <= least]
        rest: list[RowT] = []
        for tenant in sorted({r.tenant for r in rows} - {r.tenant for r in first},
                             key=served.__getitem__):
            cursor = self._cursor.get(tenant, 0)
            rest += sorted((r for r in rows if r.tenant == tenant),
                           key=lambda r: (r.admit_order <= cursor, r.admit_order))
        return first, rest

    def ran(self, tenant: str, admit_order: int) -> None:
        """A row that had to wait its turn ran (``decode_order``'s round robin)."""
        self._cursor[tenant] = admit_order

    def idle(self, tenant: str) -> None:
        """The tenant has no running sequence left: its round robin starts over."""
        self._cursor.pop(tenant, None)


class Presence:
    """Which tenants have work: running or waiting now, or a request that ended within
    ``grace_s`` (``SchedulerTuning.idle_grace_s``)."""

    def __init__(self, clock: Callable[[], float], grace_s: float) -> None:
        self._clock = clock
        self._grace_s = grace_s
        self._seen: dict[str, float] = {}  # tenant -> when it last had work

    def update(self, with_work: Iterable[str]) -> None:
        """Record the tenants with work now (once per step) and forget the long gone."""
        now = self._clock()
        for tenant in with_work:
            self._seen[tenant] = now
        for tenant in [t for t, at in self._seen.items() if now - at > self._grace_s]:
            del self._seen[tenant]

    def tenants(self) -> frozenset[str]:
        """The tenants with work."""
        return frozenset(self._seen)

    def end(self, tenant: str) -> None:
        """``tenant``'s grace ends now: it has no work and will send none."""
        self._seen.pop(tenant, None)


class TenantQueues(Generic[T]):
    """Per-tenant FIFO queues; ``peek`` offers the head of the eligible tenant with the
    lowest ``rank`` (the fair share's count). Per-step cost is O(tenants)."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[T]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def tenants(self) -> tuple[str, ...]:
        """Tenants with waiting requests, in the order their queues started."""
        return tuple(self._queues)

    def num_waiting(self, tenant: str) -> int:
        q = self._queues.get(tenant)
        return len(q) if q else 0

    def push(self, item: T, front: bool = False) -> None:
        """Queue ``item``; ``front`` puts a preempted request back ahead of its tenant's others."""
        q = self._queues.setdefault(item.tenant, deque())
        if front:
            q.appendleft(item)
        else:
            q.append(item)
        self._len += 1

    def remove(self, item: T) -> bool:
        """Drop ``item`` (admitted, abort, deadline)."""
        q = self._queues.get(item.tenant)
        if not q or item not in q:
            return False
        if q[0] is item:
            q.popleft()
        else:
            q.remove(item)
        self._len -= 1
        if not q:
            del self._queues[item.tenant]
        return True

    def peek(self, eligible: Callable[[str], bool], rank: Callable[[str], float]) -> T | None:
        """The head request of the eligible tenant with the lowest ``rank`` (ties: the tenant
        whose queue started first), without removing it."""
        best: str | None = None
        for tenant in self._queues:
            if eligible(tenant) and (best is None or rank(tenant) < rank(best)):
                best = tenant
        return None if best is None else self._queues[best][0]
