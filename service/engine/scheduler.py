"""The scheduling loop (vLLM-v1 semantics): who runs this step, and the cache calls for it.

One rule, no prefill/decode phases: every step, each sequence's ``num_computed`` catches up
with its ``num_tokens`` under the step's budget. Decode rows go first (one token each);
then prefill chunks, the running prefill or waiting request of the least-served tenant
first. The loop decides nothing about tenants or time itself: who is owed service comes from
the fair share (fairness.py), how much a step may carry from the step budget
(step_budget.py), which reads the hardware only through its cost model (cost_model.py);
every constant is in ``SchedulerTuning``. docs/scheduling.md describes the whole.

A prefix cache hit at admission starts ``num_computed`` at the cached token count. When the
pool runs out (``allocate_slots`` answers ``out_of_pages``) a running sequence is preempted:
its pages are freed and it re-queues at the front of its tenant's queue, to be recomputed
from prompt + output. A ``quota`` answer does the same within the tenant. A request that
could never fit the pool or its tenant's quota is rejected with ``RequestTooLarge`` instead
of waiting forever.

The scheduler is the engine's only caller of ``KVCacheManager``'s scheduling API: schedule
(open, allocate, fence), update (commit, append), finish (free) and the prefill of a shared
prefix all go through it. The core asks the cache's queries and housekeeping (usage, purge,
policy, stats, TTL) through ``CacheQueries`` instead, so the scheduler forwards nothing it
does not decide.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import structlog

from kvcache.attention import AttentionFn
from kvcache.errors import FenceViolation, KVCacheError
from kvcache.manager import KVCacheManager
from kvcache.metadata import StepEntry
from kvcache.results import SharedPublish
from service.engine.cost_model import Regime, StepShape
from service.engine.fairness import FairShare, Presence, TenantQueues, TokenCounter
from service.engine.kv_quota import most_over_share, never_fits, page_limit
from service.engine.plan import ScheduledSeq, SchedulerOutput
from service.engine.request import SeqState, SeqStatus
from service.engine.step_budget import ChunkTerms, StepBudget, StepRoom
from service.engine.types import EngineConfig, RequestTooLarge, TenantSchedPolicy

log = structlog.get_logger(__name__)


class Scheduler:
    """Owns the waiting queue and the running list; talks to the cache through ``cache``.
    ``regime`` is what the model reports about its step costs (``cost_model.Regime``)."""

    def __init__(
        self,
        config: EngineConfig,
        cache: KVCacheManager,
        policy: Callable[[str], TenantSchedPolicy],
        clock: Callable[[], float],
        regime: Regime | None = None,
    ) -> None:
        self._config = config
        self._cache = cache
        self._policy = policy
        self._clock = clock
        self.waiting: TenantQueues[SeqState] = TenantQueues()
        self.running: list[SeqState] = []
        self._running_per_tenant: dict[str, int] = {}
        self._admit_counter = itertools.count(1)
        self.num_preemptions = 0
        self.fair = FairShare(lambda t: policy(t).weight)
        self.budget = StepBudget(config.tuning, regime or Regime())
        self._presence = Presence(clock, config.tuning.idle_grace_s)
        self._cpu_owed: dict[str, float] = {}  # tenant -> a fraction of a token charge_cpu owes

    def use_regime(self, regime: Regime) -> None:
        """The model now runs with ``regime`` (e.g. CUDA graphs were captured at start): the
        cost model starts over on it."""
        self.budget = StepBudget(self._config.tuning, regime)

    @property
    def counter(self) -> TokenCounter:
        """Weighted processed tokens per tenant (the fair share's currency)."""
        return self.fair.counter

    def num_running(self, tenant: str) -> int:
        return self._running_per_tenant.get(tenant, 0)

    def add(self, seq: SeqState) -> None:
        if not self.num_running(seq.tenant) and not self.waiting.num_waiting(seq.tenant):
            active = set(self._running_per_tenant) | set(self.waiting.tenants())
            self.fair.counter.lift(seq.tenant, active)
        self.waiting.push(seq)

    def schedule(self) -> SchedulerOutput:
        """Decode rows first (``StepBudget.decode_rows``), then prefill chunks in the room
        they leave, the least-served tenant first: its running prefill, or its next waiting
        request."""
        entries: list[ScheduledSeq] = []
        preempted: list[SeqState] = []
        rejected: list[tuple[SeqState, RequestTooLarge]] = []
        self.fair.new_step()
        self._presence.update(itertools.chain(self._running_per_tenant, self.waiting.tenants()))
        cost = self.budget.fit()
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        prompts: dict[str, tuple[int, int]] = {}  # tenant -> its first running prompt
        for seq in sorted(prefilling, key=lambda s: s.admit_order or 0):
            prompts.setdefault(seq.tenant, (seq.num_computed, seq.num_tokens - seq.num_computed))
        decoding, guard_s = self.budget.decode_rows(
            self.fair,
            [s for s in self.running if s.num_tokens - s.num_computed == 1],
            cost,
            prompts,
        )
        for seq in decoding[: self._config.tuning.max_num_batched_tokens]:
            if seq.status is SeqStatus.RUNNING and self._allocate_running(
                seq, 1, entries, preempted, rejected
            ):
                entries.append(ScheduledSeq(seq, 1))
        alone = len(self.running) + len(self.waiting) <= 1
        room = self.budget.room(
            [e.seq for e in entries], cost, guard_s, alone, self._presence.tenants()
        )
        decoding_tenants = {e.seq.tenant for e in entries}
        admitted: list[SeqState] = []
        blocked: set[str] = set()  # tenants whose next request does not fit this step
        while room.is_open():
            prefilling = [s for s in prefilling if s.status is SeqStatus.RUNNING]
            ahead = min(prefilling, key=self._fair_order, default=None)
            waiting = None if preempted else self._next_waiting(blocked)
            if ahead is not None and (
                waiting is None or self._fair_order(ahead) <= self._fair_order(waiting)
            ):
                prefilling.remove(ahead)
                self._prefill(ahead, room, decoding_tenants, entries, preempted, rejected)
                continue
            if waiting is None:
                break
            used = self._admit(waiting, room, decoding_tenants, blocked, rejected)
            if used is not None:
                entries.append(ScheduledSeq(waiting, used))
                admitted.append(waiting)
        if not self._config.tuning.prefill_chunk:
            self._extend(entries, room, decoding_tenants)
        good, attn, refused = self.fence(entries)
        return SchedulerOutput(
            good, attn, tuple(admitted), tuple(preempted), tuple(rejected), refused
        )

    def _fair_order(self, seq: SeqState) -> tuple[float, int]:
        return self.fair.order(seq.tenant, seq.admit_order or 0)

    def _prefill(
        self,
        seq: SeqState,
        room: StepRoom,
        decoding: set[str],
        entries: list[ScheduledSeq],
        preempted: list[SeqState],
        rejected: list[tuple[SeqState, RequestTooLarge]],
    ) -> None:
        """The running prefill ``seq``'s next chunk, as its terms allow."""
        left = seq.num_tokens - seq.num_computed
        terms = self._terms(seq, left, decoding, room)
        num_new = room.chunk(seq.num_computed, left, terms)
        if num_new > 0 and self._allocate_running(seq, num_new, entries, preempted, rejected):
            entries.append(ScheduledSeq(seq, num_new))
            room.take(seq.num_computed, num_new, terms)
            self.fair.spend(seq.tenant, num_new)

    def _terms(
        self, seq: SeqState, left: int, decoding: set[str], room: StepRoom
    ) -> ChunkTerms:
        return self.budget.terms(self.fair, seq.tenant, left, decoding, room.present)

    def _extend(self, entries: list[ScheduledSeq], room: StepRoom, decoding: set[str]) -> None:
        """Room nobody else could use goes to the step's prefill chunks, fairest first, so
        the automatic chunk cap never leaves a step short (no preemption for it)."""
        # Only prefill chunks can grow: a decode row (or a prompt's last token) has nothing left.
        growing = [i for i, e in enumerate(entries)
                   if e.seq.num_tokens > e.seq.num_computed + e.num_new]
        for i in sorted(growing, key=lambda i: self._fair_order(entries[i].seq)):
            if not room.is_open():
                return
            e = entries[i]
            context = e.seq.num_computed + e.num_new
            terms = self._terms(e.seq, e.seq.num_tokens - context, decoding, room)
            extra = room.chunk(context, e.seq.num_tokens - context, terms, capped=False)
            if extra <= 0:
                continue
            if self._cache.can_allocate(e.seq.seq_id, context + extra):
                self._cache.allocate_slots(e.seq.seq_id, context + extra)
                entries[i] = ScheduledSeq(e.seq, e.num_new + extra)
                room.take(context, extra, terms)
                self.fair.spend(e.seq.tenant, extra)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """The wall time of a step of that ``shape`` (feeds the cost model)."""
        self.budget.observe(shape, seconds)

    def fence(
        self, entries: Sequence[ScheduledSeq]
    ) -> tuple[
        tuple[ScheduledSeq, ...], AttentionFn | None, tuple[tuple[SeqState, FenceViolation], ...]
    ]:
        """``begin_step`` for the batch: the cache fences each sequence and answers which
        passed. Refused sequences leave the running list (their pages stay with kvcache).
        Also the attention of a part of a planned step, to run it again on its own (the
        cache builds a step's attention from the sequences' state, changing nothing)."""
        if not entries:
            return (), None, ()
        by_id = {e.seq.seq_id: e for e in entries}
        plan = self._cache.begin_step(_step_entries(entries))
        good = tuple(by_id[e.seq_id] for e in plan.entries)
        refused = tuple((by_id[e.seq_id].seq, violation) for e, violation in plan.refused)
        return good, plan.attn, refused

    def charge(self, entries: Sequence[ScheduledSeq]) -> None:
        """Entries whose rows ran and failed: their tenants are charged the tokens processed,
        as ``update`` charges them (a tenant whose requests fail gets no free steps)."""
        for e in entries:
            self.fair.counter.charge(e.seq.tenant, e.num_new)

    def update(self, entries: tuple[ScheduledSeq, ...]) -> None:
        """After the forward: the entries' new tokens have KV (full pages enter the cache),
        and each tenant is charged the tokens it had processed."""
        for e in entries:
            e.seq.num_computed += e.num_new
            self.fair.counter.charge(e.seq.tenant, e.num_new)
            self._cache.commit(e.seq.seq_id, e.seq.token_ids, e.seq.num_computed)
        self.fair.new_step()  # what the plan gave is in the counter now

    def charge_cpu(self, tenant: str, seconds: float) -> int:
        """Charge ``tenant`` for CPU work done for it off the model's forward (a grammar
        compile, its masks, a tokenization) in the fairness currency: the prefill tokens a
        step could have computed in that time (``StepBudget.cpu_tokens``). Fractions of a
        token are carried to the next charge. Returns the whole tokens charged now."""
        owed = self._cpu_owed.get(tenant, 0.0) + self.budget.cpu_tokens(seconds)
        tokens = int(owed + 1e-9)
        self._cpu_owed[tenant] = owed - tokens
        if tokens:
            self.fair.counter.charge(tenant, tokens)
        return tokens

    def append(self, seq: SeqState, token: int) -> None:
        """Record a sampled token (the sequence owns its tokens; the cache reads them at
        commit); its KV is written by a later step."""
        seq.token_ids.append(token)

    def finish(self, seq: SeqState) -> None:
        """Take ``seq`` out of the queues and free its pages (waiting ones hold none)."""
        if seq.status is SeqStatus.RUNNING:
            self.remove_running(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    # ---- who has work, for the step budget -----------------------------------------------
    def present(self) -> frozenset[str]:
        """The tenants with work, as the step budget sees them (``Presence``)."""
        return self._presence.tenants()

    def retire(self, tenant: str) -> None:
        """``tenant`` (with nothing running or waiting) will send no more work: it stops
        counting as present at once, so no grace keeps others' steps timed for it."""
        assert not self.num_running(tenant) and not self.waiting.num_waiting(tenant)
        self._presence.end(tenant)

    # ---- the operator's shared prefixes (prefilled by the core between steps) -----------
    def publish_shared(self, name: str, token_ids: Sequence[int]) -> SharedPublish:
        return self._cache.publish_shared(name, token_ids)

    def shared_step(self, pub: SharedPublish, start: int, num_new: int) -> AttentionFn:
        """The fenced attention for tokens ``[start, start + num_new)`` of a publication."""
        plan = self._cache.begin_step([StepEntry(pub.seq_id, start, num_new)])
        if plan.attn is None:
            raise plan.refused[0][1]
        return plan.attn

    def shared_commit(self, pub: SharedPublish, num_computed: int) -> None:
        self._cache.commit(pub.seq_id, pub.token_ids, num_computed)

    def shared_done(self, pub: SharedPublish) -> None:
        """Free the publication's internal sequence (its sealed pages stay declared)."""
        self._cache.free(pub.seq_id)

    def _allocate_running(
        self,
        seq: SeqState,
        num_new: int,
        entries: list[ScheduledSeq],
        preempted: list[SeqState],
        rejected: list[tuple[SeqState, RequestTooLarge]],
    ) -> bool:
        """Grow ``seq``'s slots, preempting as needed. False if ``seq`` left the batch.

        Out of pool pages (possible only with overcommitted shares), the victim is the
        newest sequence of the tenant most over its share; over its own quota, a tenant
        preempts only its own newest."""
        while True:
            fit = self._cache.allocate_slots(seq.seq_id, seq.num_computed + num_new)
            if fit.ok:
                return True
            if fit.reason == "out_of_pages":
                what = "pool"
                alone = len(self.running) == 1
                rivals = self._running_of(most_over_share(self._cache, self.running, self.fair))
            else:
                what = "tenant page quota"
                rivals = self._running_of(seq.tenant)
                alone = len(rivals) == 1
            victim = rivals[-1]
            if victim is seq and alone:
                # Nothing else holds pages it could get: it can never fit.
                needed = -(-(seq.num_computed + num_new) // self._cache.page_size)
                self.remove_running(seq)
                seq.status = SeqStatus.FINISHED  # the engine sends its Finished(error)
                limit = page_limit(self._cache, seq.tenant)[0] if what != "pool" else self._cache.num_pages
                rejected.append((seq, RequestTooLarge(needed, limit, what)))
                return False
            self.preempt(victim)
            preempted.append(victim)
            entries[:] = [e for e in entries if e.seq is not victim]
            if victim is seq:
                return False

    def _running_of(self, tenant: str) -> list[SeqState]:
        return [s for s in self.running if s.tenant == tenant]

    def _next_waiting(self, blocked: set[str]) -> SeqState | None:
        """The least-served tenant's next request, among tenants below their running cap."""
        if len(self.running) >= self._config.max_num_seqs:
            return None

        def eligible(tenant: str) -> bool:
            return (
                tenant not in blocked
                and self.num_running(tenant) < self._policy(tenant).max_running
            )

        return self.waiting.peek(eligible, self.fair.served)

    def _admit(
        self,
        seq: SeqState,
        room: StepRoom,
        decoding: set[str],
        blocked: set[str],
        rejected: list[tuple[SeqState, RequestTooLarge]],
    ) -> int | None:
        """Admit the waiting ``seq`` with a first chunk that fits ``room``; return the chunk,
        or None when it could not be admitted (rejected, or its tenant is blocked for this
        step: a tenant whose request does not fit never holds up the others)."""
        too_large = never_fits(self._cache, seq)
        if too_large is not None:
            self.waiting.remove(seq)
            seq.status = SeqStatus.FINISHED  # the engine sends its Finished(error)
            rejected.append((seq, too_large))
            return None
        terms = self._terms(seq, seq.num_tokens, decoding, room)
        if room.chunk(0, 1, terms, capped=False) == 0:
            blocked.add(seq.tenant)  # held to its terms, with none of them left
            return None
        cached = self._cache.open(
            seq.seq_id,
            seq.tenant,
            seq.token_ids,
            use_prefix_cache=not seq.request.bypass_prefix_cache,
            salt=seq.request.cache_salt,
            adapter=seq.request.adapter_identity,
        )
        seq.in_cache = True
        seq.num_computed = cached
        # A prefix hit moves the chunk later in the sequence, where tokens cost more; the
        # room was open for one token at position 0, so the chunk gets at least that.
        num_new = max(1, room.chunk(cached, seq.num_tokens - cached, terms))
        if not self._cache.allocate_slots(seq.seq_id, seq.num_computed + num_new).ok:
            self._close(seq)
            blocked.add(seq.tenant)
            return None
        self.waiting.remove(seq)
        if seq.admitted_at is None:
            seq.admitted_at = self._clock()
            seq.cached_tokens = cached
        seq.status = SeqStatus.RUNNING
        seq.admit_order = next(self._admit_counter)
        self.running.append(seq)
        self._running_per_tenant[seq.tenant] = self.num_running(seq.tenant) + 1
        room.take(cached, num_new, terms)
        self.fair.spend(seq.tenant, num_new)
        return num_new

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
            self.fair.idle(seq.tenant)
        self._close(seq)


def _step_entries(entries: Sequence[ScheduledSeq]) -> list[StepEntry]:
    return [StepEntry(e.seq.seq_id, e.seq.num_computed, e.num_new) for e in entries]
