"""Iteration-level scheduler (vLLM-v1 semantics).

One rule, no prefill/decode phases: every step, each sequence's ``num_computed`` catches up
with its ``num_tokens`` under a shared token budget. Running sequences go first, in
admission order (decodes take one token, partial prefills take the next chunk); then waiting
sequences are admitted by weighted DRR over tenants while budget and slots last. A prefix
cache hit at admission starts ``num_computed`` at the cached token count.

When the pool runs out (``allocate_slots`` answers ``out_of_pages``) the most recently
admitted running sequence is preempted: its pages are freed and it re-queues at the front of
its tenant's queue, to be recomputed from prompt + output. A ``quota`` answer does the same
within the tenant.
A request that could never fit the pool or its tenant's quota is rejected with
``RequestTooLarge`` instead of waiting forever.

The scheduler is the engine's only caller of ``KVCacheManager``: schedule (allocate, fence),
update (commit, append) and finish (free) all go through it, so the engine core never holds
the cache.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from kvcache.attention import AttentionFn
from kvcache.config import TenantCachePolicy
from kvcache.errors import FenceViolation, KVCacheError
from kvcache.manager import KVCacheManager
from kvcache.metadata import StepEntry
from kvcache.stats import CacheStats, TenantUsage
from service.engine.fairness import FairQueue, TokenCounter
from service.engine.request import SeqState, SeqStatus
from service.engine.step_budget import StepCost, StepCostModel, StepRoom, StepShape
from service.engine.types import EngineConfig, RequestTooLarge, TenantSchedPolicy

log = structlog.get_logger(__name__)

# A step always advances prefills by at least this many tokens, however slow the model says
# steps are, so a long prompt under a tight ``max_step_ms`` still finishes. Beside other
# tenants' decodes only the least-served tenant's chunk gets it (``_fit_room``).
_MIN_PREFILL_TOKENS = 16
# With this many requests waiting for prefill, a timed step may leave the packed decode
# weights' batch for a big dense step (``Scheduler._within_packed``).
_DENSE_QUEUE = 4
# A tenant counts as active this long after it last had work, so a stream's tenant between
# two requests is still guarded by the step time target.
_ACTIVE_FOR_S = 2.0
# What one token is worth in CPU seconds before the cost model has seen a prefill chunk.
# NOTE: a token of prefill on the default model costs ~0.5-2 ms on a 2-core CPU; charging
# off-engine work at 1 ms a token errs toward charging it, until the fit says otherwise.
_CPU_SECONDS_PER_TOKEN = 1e-3


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

    def shape(self) -> StepShape:
        """What the step's cost depends on; read it before ``update`` advances the entries."""
        rows = keys = 0
        chunks: list[tuple[int, int]] = []
        for e in self.entries:
            if e.num_new == 1 and e.samples:  # a decode row (or a prompt's last token)
                rows += 1
                keys += e.seq.num_computed + 1
            else:
                chunks.append((e.seq.num_computed, e.num_new))
        return StepShape(rows, keys, tuple(chunks))


class Scheduler:
    """Owns the waiting queue and the running list; talks to the cache through ``cache``."""

    def __init__(
        self,
        config: EngineConfig,
        cache: KVCacheManager,
        policy: Callable[[str], TenantSchedPolicy],
        clock: Callable[[], float],
        drr_quantum: int = 128,
        packed_rows: int = 0,
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
        self.counter = TokenCounter(lambda t: policy(t).weight)
        self.cost = StepCostModel(packed_rows)  # packed_rows: the model's max_packed_rows
        self._spent: dict[str, int] = {}  # tokens given per tenant in the step being planned
        self._cpu_owed: dict[str, float] = {}  # tenant -> a fraction of a token charge_cpu owes
        self._last_active: dict[str, float] = {}  # tenant -> when it last had work (_room)
        # tenant -> admit_order of its last decode row that ran beside the guard
        self._decode_cursor: dict[str, int] = {}

    def num_running(self, tenant: str) -> int:
        return self._running_per_tenant.get(tenant, 0)

    def add(self, seq: SeqState) -> None:
        if not self.num_running(seq.tenant) and not self.waiting.num_waiting(seq.tenant):
            active = set(self._running_per_tenant) | set(self.waiting.tenants())
            self.counter.lift(seq.tenant, active)
        self.waiting.push(seq)

    def schedule(self) -> SchedulerOutput:
        """Decodes first, one token each, so no prefill stalls a running stream. Then prefill
        chunks in what is left of the step (``_room``), the tenant with the fewest weighted
        processed tokens first (``TokenCounter``): its running prefill, or its next request
        admitted by DRR. While others have work, one request's chunk is capped."""
        entries: list[ScheduledSeq] = []
        preempted: list[SeqState] = []
        rejected: list[tuple[SeqState, RequestTooLarge]] = []
        cost = self.cost.fit() if self._timed() else None
        decoding, guard_s = self._fair_decodes(
            [s for s in self.running if s.num_tokens - s.num_computed == 1], cost
        )
        hard = self._config.max_num_batched_tokens
        for seq in decoding:
            if len(entries) >= hard:
                break
            if seq.status is SeqStatus.RUNNING and self._allocate_running(
                seq, 1, entries, preempted, rejected
            ):
                entries.append(ScheduledSeq(seq, 1))
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        room = self._room(entries, cost, guard_s, len(self.waiting) + len(prefilling))
        self._spent = {}
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
                self._fit_room(room, ahead, decoding_tenants)
                num_new = room.chunk(ahead.num_computed, ahead.num_tokens - ahead.num_computed)
                if num_new > 0 and self._allocate_running(
                    ahead, num_new, entries, preempted, rejected
                ):
                    entries.append(ScheduledSeq(ahead, num_new))
                    room.take(ahead.num_computed, num_new)
                    self._spend(ahead.tenant, num_new)
                continue
            if waiting is None:
                break
            self._fit_room(room, waiting, decoding_tenants)
            used = self._admit(waiting, room, blocked, rejected)
            if used is None:
                continue
            entries.append(ScheduledSeq(waiting, used))
            admitted.append(waiting)
            room.take(waiting.num_computed, used)
            self._spend(waiting.tenant, used)
        if self._config.long_prefill_threshold <= 0:
            self._extend(entries, room, decoding_tenants)
        good, attn, refused = self._fence(entries)
        return SchedulerOutput(
            good, attn, tuple(admitted), tuple(preempted), tuple(rejected), refused
        )

    def _fair_order(self, seq: SeqState) -> tuple[float, int]:
        """Lowest weighted processed tokens first, counting what this step already gave."""
        return self._served(seq.tenant), seq.admit_order or 0

    def _served(self, tenant: str) -> float:
        """The tenant's weighted processed tokens, with what this step already gave it."""
        return self.counter[tenant] + self._spent.get(tenant, 0) / self._policy(tenant).weight

    def _fit_room(self, room: StepRoom, seq: SeqState, decoding: set[str]) -> None:
        """Set the room's rules for ``seq``'s chunk. A chunk whose tenant is owed service
        (``_owed``) is held only to ``max_step_ms``; any other is also held to the decode
        stretch. The owed chunk, or one that finishes its prompt within the floor, may take
        the step's whole prefill floor.
        NOTE: with a floor of one token for everyone beside decodes, a victim's short prompt
        advanced a token a step while an attacker's streams decoded (TTFT 0.09 -> 0.5 s);
        with the full floor for everyone, an attacker's long prompts added 16 tokens to every
        one of the victim's steps (inter-token gap 0.018 -> 0.10 s)."""
        owed = self._owed(seq, decoding)
        room.stretched = not owed
        room.full_floor = owed or seq.num_tokens - seq.num_computed <= _MIN_PREFILL_TOKENS

    def _owed(self, seq: SeqState, decoding: set[str]) -> bool:
        """Whether ``seq``'s tenant has had no more weighted tokens than any other tenant
        whose streams decode in this step: the step's decodes then belong to tenants that
        have had at least their share, and stretching their gap is their share being spent.
        NOTE: two tenants sharing 64 offline requests, every chunk held to the decode
        stretch: 70-93 output tok/s against 130 untimed (the batch grows a few rows a step)."""
        others = [self._served(t) for t in decoding if t != seq.tenant]
        return not others or self._served(seq.tenant) <= min(others)

    def _spend(self, tenant: str, tokens: int) -> None:
        self._spent[tenant] = self._spent.get(tenant, 0) + tokens

    def _extend(self, entries: list[ScheduledSeq], room: StepRoom, decoding: set[str]) -> None:
        """Room nobody else could use goes to the step's prefill chunks, fairest first, so
        the automatic chunk cap never leaves a step short (no preemption for it)."""
        order = sorted(range(len(entries)), key=lambda i: self._fair_order(entries[i].seq))
        for i in order:
            if not room.is_open():
                return
            e = entries[i]
            context = e.seq.num_computed + e.num_new
            self._fit_room(room, e.seq, decoding)
            extra = room.chunk(context, e.seq.num_tokens - context, capped=False)
            if extra <= 0:
                continue
            if self._cache.can_allocate(e.seq.seq_id, context + extra):
                self._cache.allocate_slots(e.seq.seq_id, context + extra)
                entries[i] = ScheduledSeq(e.seq, e.num_new + extra)
                room.take(context, extra)
                self._spend(e.seq.tenant, extra)

    def _timed(self) -> bool:
        """Whether steps are sized to the time target: ``max_step_ms`` set and two or more
        tenants with work.
        NOTE: the time target guards tenants from each other. With one tenant active there
        is nobody to guard, and on CPU a timed step is mostly fixed cost (the weights are
        read once per step however few tokens it carries): measured on 2 cores, 64 offline
        requests of one tenant ran at 37-56 output tok/s timed against 127 untimed."""
        return self._config.max_step_ms > 0 and self._several_tenants()

    def _fair_decodes(
        self, decoding: list[SeqState], cost: StepCost | None
    ) -> tuple[list[SeqState], float]:
        """The decode rows this step runs, and the step time they leave the guard.

        With the step timed and ``decode_stretch`` set, the least-served decoding tenant's
        streams (and those of any tenant tied with it) always decode, and the step is held
        to ``decode_stretch`` times what their rows alone cost (the guard): other tenants'
        rows join, least-served tenant first and each tenant's rows in turn,
        while the step stays within it, and the rest wait a step. A row's cost includes its
        measured sampling cost (a grammar's mask can cost far more than the forward: 170 ms
        a token for an ambiguous grammar), so an expensive row runs beside others' decodes
        only when its tenant is the least served, and what it costs is charged to it.
        Returns the rows and the guard (infinite when there is none).
        NOTE: with every row in every step, a tenant's eight streams at 1,000 keys made a
        victim's one stream decode at 80-90 ms a token against 30 ms alone (one thread)."""
        stretch = self._config.decode_stretch
        if cost is None or stretch <= 0 or not decoding:
            return decoding, math.inf
        served = {t: self._served(t) for t in {s.tenant for s in decoding}}
        least = min(served.values())
        first = [s for s in decoding if served[s.tenant] <= least]
        keys = sum(s.num_computed + 1 for s in first)
        # A row's sampling cost (its grammar mask, penalties, truncation, logprobs) is part
        # of what it adds to the step, measured per row (``SeqState.sample_s``).
        sampling = sum(s.sample_s for s in first)
        guard = max(1.0, stretch) * (cost.decode_seconds(len(first), keys) + sampling)
        if len(first) == len(decoding):
            return decoding, guard
        rows = list(first)
        for tenant in sorted(
            {s.tenant for s in decoding} - {s.tenant for s in first}, key=served.__getitem__
        ):
            # Round robin within the tenant: its rows after the last one that ran go first.
            cursor = self._decode_cursor.get(tenant, 0)
            own = sorted(
                (s for s in decoding if s.tenant == tenant),
                key=lambda s: (s.admit_order <= cursor, s.admit_order),
            )
            for seq in own:
                more = keys + seq.num_computed + 1
                if cost.decode_seconds(len(rows) + 1, more) + sampling + seq.sample_s <= guard:
                    rows.append(seq)
                    keys = more
                    sampling += seq.sample_s
                    self._decode_cursor[tenant] = seq.admit_order
        order = {id(s): i for i, s in enumerate(decoding)}
        rows.sort(key=lambda s: order[id(s)])  # admission order, as without the guard
        return rows, guard

    def _room(
        self, decodes: list[ScheduledSeq], cost: StepCost | None, guard_s: float, queued: int
    ) -> StepRoom:
        """What the step's prefill chunks may take once ``decodes`` are in, with ``queued``
        requests waiting for prefill (waiting or running a prefill).

        Within ``max_num_batched_tokens``; with the step timed (``_timed``: ``cost`` is the
        fitted model), also within a time the cost model converts to tokens: the chunks add
        at most ``max_step_ms`` to the step and, while decodes run, a chunk of a tenant
        served more than a decoding tenant fits within what the decode rows leave of the
        guard (``_fair_decodes``), so one tenant's prefill never makes another tenant's
        inter-token gap more than ``max_step_ms`` longer, nor more than ``decode_stretch``
        times what that tenant's own rows cost."""
        config = self._config
        hard = config.max_num_batched_tokens
        floor = _MIN_PREFILL_TOKENS
        alone = len(self.running) + len(self.waiting) <= 1
        cap_tokens = config.long_prefill_threshold or (1 << 30)
        timed = self._timed()
        if cost is None:
            # Untimed: the whole token budget. Unmeasured: start small; the first steps teach
            # the model. Either way one request's chunk is half of it while others have work.
            budget = hard if not timed else min(hard, _MIN_PREFILL_TOKENS)
            if not config.long_prefill_threshold and not alone:
                cap_tokens = max(1, budget // 2)
            least = min(budget, _MIN_PREFILL_TOKENS)
            tokens = min(hard - len(decodes), max(budget - len(decodes), least))
            return StepRoom(max(tokens, 0), cap_tokens=cap_tokens)
        seconds = config.max_step_ms / 1000.0
        stretch_s = math.inf
        if decodes and math.isfinite(guard_s):
            keys = sum(e.seq.num_computed + 1 for e in decodes)
            # NOTE: the bound is on what prefill adds, not on the whole step. Held to a
            # 100 ms step, a CPU batch of 8 decodes (~70 ms) left about one floor of 16
            # prefill tokens a step: two tenants' 64 offline requests ran at 70 output tok/s
            # against 130 untimed, the batch never grew past ~8 rows.
            stretch_s = max(0.0, guard_s - cost.decode_seconds(len(decodes), keys))
        cap_s = seconds / 2 if not alone and not config.long_prefill_threshold else math.inf
        tokens = self._within_packed(max(hard - len(decodes), 0), len(decodes), queued)
        return StepRoom(tokens, cost, seconds, cap_tokens, cap_s, floor, stretch_s)

    def _within_packed(self, tokens: int, decodes: int, queued: int) -> int:
        """``tokens`` of prefill, held so a step with ``decodes`` decode rows stays a batch
        the packed decode weights serve (``StepCostModel.packed_rows``), but never below
        ``_MIN_PREFILL_TOKENS``. A step past them runs every row on the dense weights, and
        its decode rows wait for the whole chunk.
        NOTE: measured on a 2-core Xeon (AMX), SmolLM2-135M, 15 decode rows at 150 keys
        (23 ms alone): a 32-token chunk added 10 ms (packed, 0.31 ms a token), a 128-token
        one 50-72 ms (dense, 0.4-0.56 ms a token; bigger chunks 0.37-0.42). Held to the
        packed batch, the in-process online run at 0.9x capacity went from ITL p50 45 ms,
        TPOT p50 80, TTFT p50 817 (past capacity: served 5.4 of 6.4 req/s offered) to
        29 ms, 30 and 232 (5.6 of 6.5). Only timed steps are held so (``_timed``): one
        tenant's 64 offline requests held to it ran at 420 against 490 output tok/s, the
        big dense steps carrying many decode rows at once. So a step is not held while
        ``_DENSE_QUEUE`` or more requests wait for prefill: their prompts fill a big dense
        step, where a decode row costs a fraction of what it costs in a small packed one.
        Held regardless, the offline suite's two tenants sharing 64 requests ran at 414
        against 459 output tok/s; with the queue rule 429-474 against 400-408 held
        (in process, interleaved), and the online run above unchanged (ITL p50 28.5-28.9).
        It trades gaps for first tokens under a standing queue: the verify soak (4 tenants x
        64 closed-loop streams, tiny model) went from ITL p50 17 ms, TTFT p50 0.93 s and
        2,937 tok/s held to 27-29 ms, 0.74-0.76 s and 3,150."""
        packed = self.cost.packed_rows
        if decodes <= 0 or packed <= decodes:
            return tokens
        if queued >= _DENSE_QUEUE:
            return tokens
        return min(tokens, max(packed - decodes, _MIN_PREFILL_TOKENS))

    def _several_tenants(self) -> bool:
        """Whether two or more tenants have work now or had it in the last ``_ACTIVE_FOR_S``."""
        now = self._clock()
        for tenant in itertools.chain(self._running_per_tenant, self.waiting.tenants()):
            self._last_active[tenant] = now
        for tenant in [t for t, at in self._last_active.items() if now - at > _ACTIVE_FOR_S]:
            del self._last_active[tenant]
        return len(self._last_active) > 1

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """The wall time of a step of that ``shape`` (feeds the cost model)."""
        self.cost.observe(shape.rows, shape.row_keys, shape.chunks, seconds)

    def _fence(
        self, entries: list[ScheduledSeq]
    ) -> tuple[
        tuple[ScheduledSeq, ...], AttentionFn | None, tuple[tuple[SeqState, FenceViolation], ...]
    ]:
        """``begin_step`` for the batch: the cache fences each sequence and answers which
        passed. Refused sequences leave the running list (their pages stay with kvcache)."""
        if not entries:
            return (), None, ()
        by_id = {e.seq.seq_id: e for e in entries}
        plan = self._cache.begin_step(_step_entries(entries))
        good = tuple(by_id[e.seq_id] for e in plan.entries)
        refused = tuple((by_id[e.seq_id].seq, violation) for e, violation in plan.refused)
        return good, plan.attn, refused

    def update(self, entries: tuple[ScheduledSeq, ...]) -> None:
        """After the forward: the entries' new tokens have KV (full pages enter the cache),
        and each tenant is charged the tokens it had processed."""
        for e in entries:
            e.seq.num_computed += e.num_new
            self.counter.charge(e.seq.tenant, e.num_new)
            self._cache.commit(e.seq.seq_id, e.seq.token_ids, e.seq.num_computed)

    def charge_cpu(self, tenant: str, seconds: float) -> int:
        """Charge ``tenant`` for CPU work done for it off the model's forward (a grammar
        compile, its masks and sampling stages, a tokenization) in the fairness currency:
        the prefill tokens a step could have computed in that time. Fractions of a token
        are carried to the next charge. Returns the whole tokens charged now."""
        cost = self.cost.fit()
        per_token = cost.per_token_s if cost is not None and cost.per_token_s > 0 else 0.0
        per_token = per_token or _CPU_SECONDS_PER_TOKEN
        owed = self._cpu_owed.get(tenant, 0.0) + max(0.0, seconds) / per_token
        tokens = int(owed + 1e-9)
        self._cpu_owed[tenant] = owed - tokens
        if tokens:
            self.counter.charge(tenant, tokens)
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
                rivals = self._running_of(self._most_over_share())
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
                limit = self._page_limit(seq.tenant)[0] if what != "pool" else self._cache.num_pages
                rejected.append((seq, RequestTooLarge(needed, limit, what)))
                return False
            self.preempt(victim)
            preempted.append(victim)
            entries[:] = [e for e in entries if e.seq is not victim]
            if victim is seq:
                return False

    def _running_of(self, tenant: str) -> list[SeqState]:
        return [s for s in self.running if s.tenant == tenant]

    def _most_over_share(self) -> str:
        """The running tenant holding the most pages beyond its share (ties: most pages)."""

        def over(tenant: str) -> tuple[int, int]:
            u = self._cache.usage(tenant)
            held = u.pages_in_use + u.pages_cached
            share = self._cache.num_pages if u.max_pages is None else u.max_pages
            return held - share, held

        return max({s.tenant for s in self.running}, key=over)

    def _next_waiting(self, blocked: set[str]) -> SeqState | None:
        """The request DRR would admit next, among tenants below their running cap."""
        if len(self.running) >= self._config.max_num_seqs:
            return None

        def eligible(tenant: str) -> bool:
            return (
                tenant not in blocked
                and self.num_running(tenant) < self._policy(tenant).max_running
            )

        return self.waiting.peek(eligible)

    def _admit(
        self,
        seq: SeqState,
        room: StepRoom,
        blocked: set[str],
        rejected: list[tuple[SeqState, RequestTooLarge]],
    ) -> int | None:
        """Admit the waiting ``seq`` with a first chunk that fits ``room``; return the chunk,
        or None when it could not be admitted (rejected, or its tenant is blocked for this
        step: a tenant whose request does not fit never holds up the others)."""
        too_large = self._check_fits(seq)
        if too_large is not None:
            self.waiting.pop(seq, charge=False)
            seq.status = SeqStatus.FINISHED  # the engine sends its Finished(error)
            rejected.append((seq, too_large))
            return None
        if room.chunk(0, 1, capped=False) == 0:
            blocked.add(seq.tenant)  # held to the decode stretch, with none of it left
            return None
        cached = self._cache.open(
            seq.seq_id,
            seq.tenant,
            seq.token_ids,
            use_prefix_cache=not seq.request.bypass_prefix_cache,
            salt=seq.request.cache_salt,
        )
        seq.in_cache = True
        seq.num_computed = cached
        # A prefix hit moves the chunk later in the sequence, where tokens cost more; the
        # room was open for one token at position 0, so the chunk gets at least that.
        num_new = max(1, room.chunk(cached, seq.num_tokens - cached))
        if not self._cache.allocate_slots(seq.seq_id, seq.num_computed + num_new).ok:
            self._close(seq)
            blocked.add(seq.tenant)
            return None
        self.waiting.pop(seq)
        if seq.admitted_at is None:
            seq.admitted_at = self._clock()
            seq.cached_tokens = cached
        seq.status = SeqStatus.RUNNING
        seq.admit_order = next(self._admit_counter)
        self.running.append(seq)
        self._running_per_tenant[seq.tenant] = self.num_running(seq.tenant) + 1
        return num_new

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
            self._decode_cursor.pop(seq.tenant, None)
        self._close(seq)


def _step_entries(entries: list[ScheduledSeq]) -> list[StepEntry]:
    return [StepEntry(e.seq.seq_id, e.seq.num_computed, e.num_new) for e in entries]
