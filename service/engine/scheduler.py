"""Iteration-level scheduler (vLLM-v1 semantics).

One rule, no prefill/decode phases: every step, each sequence's ``num_computed`` catches up
with its ``num_tokens`` under a shared token budget. Running sequences go first, in
admission order (decodes take one token, partial prefills take the next chunk); then waiting
sequences are admitted by weighted DRR over tenants while budget and slots last. A prefix
cache hit at admission starts ``num_computed`` at the cached token count.

When the pool runs out (``OutOfPages``) the most recently admitted running sequence is
preempted: its pages are freed and it re-queues at the front of its tenant's queue, to be
recomputed from prompt + output. ``QuotaExceeded`` does the same within the tenant.
A request that could never fit the pool or its tenant's quota is rejected with
``RequestTooLarge`` instead of waiting forever.

The scheduler is the engine's only caller of ``KVCacheManager``: schedule (allocate, fence),
update (commit, append) and finish (free) all go through it, so the engine core never holds
the cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from kvcache.attention import AttentionFn
from kvcache.config import TenantCachePolicy
from kvcache.errors import FenceViolation, KVCacheError, OutOfPages, QuotaExceeded
from kvcache.manager import KVCacheManager
from kvcache.metadata import StepEntry
from kvcache.stats import CacheStats, TenantUsage
from service.engine.fairness import FairQueue
from service.engine.request import SeqState, SeqStatus
from service.engine.types import EngineConfig, RequestTooLarge, TenantSchedPolicy

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: SeqState
    num_new: int  # tokens computed this step, from seq.num_computed

    @property
    def samples(self) -> bool:
        """The step brings the sequence level with its tokens, so it samples the next one."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan: the fenced batch and its attention, plus what left the batch."""

    entries: tuple[ScheduledSeq, ...]  # passed the fence; run this step
    attn: AttentionFn | None  # None when no entry runs
    admitted: tuple[SeqState, ...]  # first admissions and re-admissions after preemption
    preempted: tuple[SeqState, ...]
    rejected: tuple[tuple[SeqState, RequestTooLarge], ...]
    refused: tuple[tuple[SeqState, FenceViolation], ...]  # the fence refused their pages

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new for e in self.entries)


class Scheduler:
    """Owns the waiting queue and the running list; talks to the cache through ``cache``."""

    def __init__(
        self,
        config: EngineConfig,
        cache: KVCacheManager,
        policy: Callable[[str], TenantSchedPolicy],
        clock: Callable[[], float],
        drr_quantum: int = 128,
    ) -> None:
        self._config = config
        self._cache = cache
        self._policy = policy
        self._clock = clock
        self.waiting: FairQueue[SeqState] = FairQueue(drr_quantum, lambda t: policy(t).weight)
        self.running: list[SeqState] = []
        self._running_per_tenant: dict[str, int] = {}
        self._admit_counter = itertools.count(1)
        self.num_preemptions = 0

    def num_running(self, tenant: str) -> int:
        return self._running_per_tenant.get(tenant, 0)

    def add(self, seq: SeqState) -> None:
        self.waiting.push(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self._config.max_num_batched_tokens
        entries: list[ScheduledSeq] = []
        preempted: list[SeqState] = []
        rejected: list[tuple[SeqState, RequestTooLarge]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk(seq, budget)
            if self._allocate_running(seq, num_new, preempted, rejected):
                entries.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
            # else: seq itself left the running list; index i now names the next one.

        admitted: list[SeqState] = []
        if not preempted:
            self._admit(budget, entries, admitted, rejected)
        good, attn, refused = self._fence(entries)
        return SchedulerOutput(
            good, attn, tuple(admitted), tuple(preempted), tuple(rejected), refused
        )

    def _fence(
        self, entries: list[ScheduledSeq]
    ) -> tuple[
        tuple[ScheduledSeq, ...], AttentionFn | None, tuple[tuple[SeqState, FenceViolation], ...]
    ]:
        """``begin_step`` for the batch. A FenceViolation names a page, not a sequence, so on
        one the entries are fenced one by one to find the culprits; the rest run without
        them. Refused sequences leave the running list (their pages stay with kvcache)."""
        if not entries:
            return (), None, ()
        try:
            return tuple(entries), self._cache.begin_step(_step_entries(entries)), ()
        except FenceViolation:
            pass
        good: list[ScheduledSeq] = []
        refused: list[tuple[SeqState, FenceViolation]] = []
        for e in entries:
            try:
                self._cache.begin_step(_step_entries([e]))
                good.append(e)
            except FenceViolation as err:
                refused.append((e.seq, err))
        attn = self._cache.begin_step(_step_entries(good)) if good else None
        return tuple(good), attn, tuple(refused)

    def update(self, entries: tuple[ScheduledSeq, ...]) -> None:
        """After the forward: the entries' new tokens have KV (full pages enter the cache)."""
        for e in entries:
            e.seq.num_computed += e.num_new
            self._cache.commit(e.seq.seq_id, e.seq.num_computed)

    def append(self, seq: SeqState, token: int) -> None:
        """Record a sampled token; its KV is written by a later step."""
        seq.token_ids.append(token)
        self._cache.append_token(seq.seq_id, token)

    def finish(self, seq: SeqState) -> None:
        """Take ``seq`` out of the queues and free its pages (waiting ones hold none)."""
        if seq.status is SeqStatus.RUNNING:
            self.remove_running(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    # ---- cache facts and housekeeping, for the engine core ------------------------------
    @property
    def page_size(self) -> int:
        return self._cache.page_size

    def num_free_pages(self) -> int:
        return self._cache.num_free_pages()

    def evict_expired(self) -> int:
        return self._cache.evict_expired()

    def set_cache_policy(self, tenant: str, policy: TenantCachePolicy) -> None:
        self._cache.set_tenant_policy(tenant, policy)

    def usage(self, tenant: str) -> TenantUsage:
        return self._cache.usage(tenant)

    def purge(self, tenant: str) -> int:
        return self._cache.purge_tenant(tenant)

    def cache_stats(self) -> CacheStats:
        return self._cache.stats()

    def observe_frees(self, observer: Callable[[str], None] | None) -> None:
        """Test hook: ``observer(seq_id)`` after every free of a sequence's pages."""
        self._cache.on_free = observer

    def inject_stale_page(self, seq: SeqState) -> None:
        """Test hook (fence tests): the sequence's first page is recycled under it."""
        self._cache.inject_stale_page(seq.seq_id)

    def _chunk(self, seq: SeqState, budget: int) -> int:
        num_new = min(seq.num_tokens - seq.num_computed, budget)
        threshold = self._config.long_prefill_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return num_new

    def _allocate_running(
        self,
        seq: SeqState,
        num_new: int,
        preempted: list[SeqState],
        rejected: list[tuple[SeqState, RequestTooLarge]],
    ) -> bool:
        """Grow ``seq``'s slots, preempting newer sequences as needed. False if ``seq`` left."""
        while True:
            try:
                self._cache.allocate_slots(seq.seq_id, num_new)
                return True
            except OutOfPages:
                rivals = self.running
                what = "pool"
            except QuotaExceeded:
                rivals = [s for s in self.running if s.tenant == seq.tenant]
                what = "tenant page quota"
            victim = rivals[-1]
            if victim is seq and len(rivals) == 1:
                # Nothing else holds pages it could get: it can never fit.
                needed = -(-(seq.num_computed + num_new) // self._cache.page_size)
                self.remove_running(seq)
                seq.status = SeqStatus.FINISHED  # the engine sends its Finished(error)
                rejected.append(
                    (seq, RequestTooLarge(needed, self._page_limit(seq.tenant)[0], what))
                )
                return False
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False

    def _admit(
        self,
        budget: int,
        entries: list[ScheduledSeq],
        admitted: list[SeqState],
        rejected: list[tuple[SeqState, RequestTooLarge]],
    ) -> None:
        blocked: set[str] = set()  # tenants at their quota this step

        def eligible(tenant: str) -> bool:
            return (
                tenant not in blocked
                and self.num_running(tenant) < self._policy(tenant).max_running
            )

        while budget > 0 and len(self.running) < self._config.max_num_seqs:
            seq = self.waiting.peek(eligible)
            if seq is None:
                return
            too_large = self._check_fits(seq)
            if too_large is not None:
                self.waiting.pop(seq, charge=False)
                seq.status = SeqStatus.FINISHED  # the engine sends its Finished(error)
                rejected.append((seq, too_large))
                continue
            cached = self._cache.open(
                seq.seq_id,
                seq.tenant,
                seq.token_ids,
                use_prefix_cache=not seq.request.bypass_prefix_cache,
            )
            seq.in_cache = True
            seq.num_computed = cached
            num_new = self._chunk(seq, budget)
            try:
                self._cache.allocate_slots(seq.seq_id, num_new)
            except OutOfPages:
                self._close(seq)
                return
            except QuotaExceeded:
                self._close(seq)
                blocked.add(seq.tenant)
                continue
            self.waiting.pop(seq)
            if seq.admitted_at is None:
                seq.admitted_at = self._clock()
                seq.cached_tokens = cached
            seq.status = SeqStatus.RUNNING
            seq.admit_order = next(self._admit_counter)
            self.running.append(seq)
            self._running_per_tenant[seq.tenant] = self.num_running(seq.tenant) + 1
            entries.append(ScheduledSeq(seq, num_new))
            admitted.append(seq)
            budget -= num_new

    def _page_limit(self, tenant: str) -> tuple[int, str]:
        limit, what = self._cache.num_pages, "pool"
        quota = self._cache.usage(tenant).max_pages
        if quota is not None and quota < limit:
            limit, what = quota, "tenant page quota"
        return limit, what

    def _check_fits(self, seq: SeqState) -> RequestTooLarge | None:
        """Reject a request whose prompt plus full output budget can never fit."""
        needed = -(-seq.max_total_tokens // self._cache.page_size)
        limit, what = self._page_limit(seq.tenant)
        return RequestTooLarge(needed, limit, what) if needed > limit else None

    def _close(self, seq: SeqState) -> None:
        try:
            self._cache.free(seq.seq_id)
        except KVCacheError as err:  # e.g. a fenced page; the pages stay with kvcache
            log.warning("free_failed", request_id=seq.seq_id, error=type(err).__name__)
        seq.in_cache = False
        seq.num_computed = 0

    def preempt(self, seq: SeqState) -> None:
        """Free ``seq``'s pages and queue it for recomputation ahead of its tenant's others."""
        self.remove_running(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq, front=True)

    def remove_running(self, seq: SeqState) -> None:
        """Take ``seq`` out of the running list and free its pages."""
        self.running.remove(seq)
        self._running_per_tenant[seq.tenant] -= 1
        if self._running_per_tenant[seq.tenant] == 0:
            del self._running_per_tenant[seq.tenant]
        self._close(seq)


def _step_entries(entries: list[ScheduledSeq]) -> list[StepEntry]:
    return [StepEntry(e.seq.seq_id, e.seq.num_computed, e.num_new) for e in entries]
