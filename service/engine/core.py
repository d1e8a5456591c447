"""The engine's state machine without threads: commands, and ``step``.

Everything here runs on one thread (the engine thread, or a test driving the core by hand):
there is no lock. ``Engine`` hands commands from other threads in through its inbox.

``step()`` reads schedule -> execute -> update. Every finish (stop, length, abort, deadline,
error) frees the sequence's pages in the call that decides it. The scheduler is the only
caller of the KV cache; the core owns the requests, their sinks and deadlines.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import structlog
import torch

from kvcache.attention import AttentionFn
from kvcache.config import TenantCachePolicy
from kvcache.manager import KVCacheManager
from kvcache.results import SharedPublish
from kvcache.stats import TenantUsage
from service.engine.cache_queries import CacheQueries
from service.engine.cost_model import Regime
from service.engine.detokenizer import IncrementalDetokenizer
from service.engine.invariants import validate_request
from service.engine.plan import ScheduledSeq, SchedulerOutput
from service.engine.request import SeqState, SeqStatus
from service.engine.runner import ForwardModel, GraphReplay, ModelRunner, build_inputs
from service.engine.sampler import Sampler, SampleResult, SampleRow
from service.engine.scheduler import Scheduler
from service.engine.shared_prefill import prefill_shared
from service.engine.stop import StopMatcher
from service.engine.tokens import TokenizerLike, TokenSource
from service.engine.types import (
    Admitted,
    Delta,
    EngineConfig,
    EngineCounters,
    EngineEvent,
    EngineStats,
    Finished,
    FinishError,
    FinishReason,
    InvalidRequest,
    QueueFull,
    Request,
    TenantSchedPolicy,
    TokenLogprob,
)
from service.model.decoder import DecoderModel
from service.structured.grammar import GrammarMatcher

log = structlog.get_logger(__name__)


if TYPE_CHECKING:
    from service.engine.hooks import CoreHooks


@dataclass(frozen=True, slots=True)
class StepStats:
    num_tokens: int
    num_seqs: int
    num_sampled: int
    num_preempted: int
    forward_s: float = 0.0  # the model forward alone (for the step-overhead profile)


class EngineCore:
    """Owns every request's state. Single-threaded: call it from one thread only.
    ``hooks``: its debug and test hooks, set by the factory that built it
    (``service.engine.factory.build_core``)."""

    hooks: CoreHooks

    def __init__(
        self,
        model: ForwardModel,
        tokens: TokenSource,
        cache: KVCacheManager,
        config: EngineConfig,
        clock: Callable[[], float],
        device: torch.device,
        sampler_seed: int | None = None,
    ) -> None:
        self.config = config
        self.tokens = tokens
        self._clock = clock
        self._policies: dict[str, TenantSchedPolicy] = {}
        # What the model reports about its step costs (packed decode weights on CPU).
        self._regime = Regime(packed_rows=int(getattr(model, "max_packed_rows", 0)))
        # The scheduler alone schedules against the cache; the core asks it only queries
        # and housekeeping (cache_queries.py).
        self._scheduler = Scheduler(config, cache, self.policy, clock, self._regime)
        self._queries: CacheQueries = cache
        self.pool = cache.pool
        self._runner = ModelRunner(model, device)
        self._sampler = Sampler(device, sampler_seed)
        self._seqs: dict[str, SeqState] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._num_deadlined = 0  # live requests with a deadline (the heap may hold stale ones)
        self._tiebreak = itertools.count()
        self._last_evict = clock()
        self.num_steps = 0

    @classmethod
    def for_model(
        cls,
        model: DecoderModel,
        tokenizer: TokenizerLike,
        cache: KVCacheManager,
        config: EngineConfig,
        clock: Callable[[], float],
        sampler_seed: int | None = None,
    ) -> EngineCore:
        """A core for a Llama model. Positions past the model's RoPE table do not exist, so
        the context length is capped here (the one place it is)."""
        mc = model.config
        config = dataclasses.replace(
            config, max_model_len=min(config.max_model_len, mc.max_position_embeddings)
        )
        tokens = TokenSource(tokenizer, mc.vocab_size, mc.eos_token_ids)
        return cls(model, tokens, cache, config, clock, model.device, sampler_seed)

    def use_graphs(self, graphs: GraphReplay) -> None:
        """Serve decode-only steps through ``graphs`` (``DecodeGraphs``: compiled or
        captured forwards, built while no page is in use); other steps stay eager."""
        self._runner = ModelRunner(self._runner.model, self._runner.device, graphs)
        # The regime now includes the graphs' padded batch sizes (what a decode step costs).
        self._scheduler.use_regime(replace(self._regime, graph_sizes=tuple(graphs.buckets)))

    # ---- commands ------------------------------------------------------------------------
    def set_tenant_policy(
        self,
        tenant: str,
        sched: TenantSchedPolicy | None = None,
        cache: TenantCachePolicy | None = None,
    ) -> None:
        if sched is not None:
            check_policy(sched)
            self._policies[tenant] = sched
        if cache is not None:
            self._queries.set_tenant_policy(tenant, cache)

    def policy(self, tenant: str) -> TenantSchedPolicy:
        return self._policies.get(tenant) or TenantSchedPolicy()

    def add(
        self, request: Request, sink: Callable[[EngineEvent], None], internal: bool = False
    ) -> None:
        """Queue a request. Raises QueueFull, InvalidRequest or RequestTooLarge at once."""
        max_tokens = validate_request(request, self.config, self.tokens.vocab_size, internal)
        if request.request_id in self._seqs:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use")
        limit = self.policy(request.tenant).max_waiting
        if self._scheduler.waiting.num_waiting(request.tenant) >= limit:
            raise QueueFull(request.tenant, limit)
        stopping = request.stopping
        stop_ids = set(stopping.stop_token_ids)
        if not stopping.ignore_eos:
            stop_ids.update(self.tokens.eos_token_ids)
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator(device=self._runner.device)
            generator.manual_seed(request.sampling.seed)
        seq = SeqState(
            request=request,
            sink=sink,
            detok=IncrementalDetokenizer(
                self.tokens.token_bytes, self.tokens.special_ids, StopMatcher(stopping.stop)
            ),
            generator=generator,
            stop_ids=frozenset(stop_ids),
            max_tokens=max_tokens,
            arrival=self._clock(),
            grammar=request.grammar.matcher() if request.grammar is not None else None,
        )
        self._seqs[request.request_id] = seq
        self._scheduler.add(seq)
        if request.deadline is not None:
            entry = (request.deadline, next(self._tiebreak), request.request_id)
            heapq.heappush(self._deadlines, entry)
            self._num_deadlined += 1

    def charge_cpu(self, tenant: str, seconds: float) -> int:
        """Charge ``tenant`` for CPU seconds spent for it outside the forward."""
        return self._scheduler.charge_cpu(tenant, seconds)

    def abort(self, request_id: str) -> None:
        """Finish the request with reason "abort" now. Unknown ids are ignored."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")

    def usage(self, tenant: str) -> TenantUsage:
        return self._queries.usage(tenant)

    def purge(self, tenant: str) -> int:
        """Drop the tenant's cached prefix pages; returns how many entries went."""
        return self._queries.purge_tenant(tenant)

    def publish_shared(self, name: str, token_ids: Sequence[int]) -> SharedPublish:
        """Declare (or replace) the operator's shared prefix ``name`` and prefill its pages
        now, between steps (``shared_prefill``). The answer is kvcache's; a forward that
        raises leaves nothing published and raises here."""
        pub = self._scheduler.publish_shared(name, token_ids)
        if pub.seq_id:
            chunk = self.config.tuning.max_num_batched_tokens
            prefill_shared(self._scheduler, self._runner, pub, chunk)
        return pub

    def withdraw_shared(self, name: str) -> bool:
        """Stop hits on ``name`` now (its pages go when their last reader ends)."""
        return self._queries.withdraw_shared(name)

    def retire(self, tenant: str) -> None:
        """``tenant`` has nothing running or waiting and will send no more work (the
        warm-up's): it stops counting as a tenant with work at once."""
        self._scheduler.retire(tenant)

    def counters(self) -> EngineCounters:
        return EngineCounters(
            num_waiting=len(self._scheduler.waiting),
            num_running=len(self._scheduler.running),
            num_requests=len(self._seqs),
            num_preemptions=self._scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_deadlines=len(self._deadlines),
        )

    def stats(self) -> EngineStats:
        return EngineStats(self.counters(), self._queries.stats())

    @property
    def page_size(self) -> int:
        return self._queries.page_size

    def num_free_pages(self) -> int:
        return self._queries.num_free_pages()

    def has_work(self) -> bool:
        return bool(self._seqs)

    @property
    def scheduler(self) -> Scheduler:
        """Read-only view for engine tests and tools; mutate only through the commands."""
        return self._scheduler

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> StepStats:
        """One iteration: schedule a batch, run it through the model, update the sequences."""
        self.num_steps += 1
        self._housekeeping(self._clock())
        plan = self._schedule()
        if plan.attn is None:
            return StepStats(0, 0, 0, len(plan.preempted))
        shape = plan.shape()  # before update advances the sequences
        start = time.perf_counter()
        ran = self._execute(plan)
        if ran.failed:
            failed = {id(seq) for seq, _ in ran.failed}
            self._scheduler.charge([e for e in plan.entries if id(e.seq) in failed])
        for seq, failure in ran.failed:
            self._finish(seq, "error", failure)
        sampled = self._update(ran.entries, ran.result)
        if not ran.failed:
            # The rows' own sampling costs are counted per row (``SeqState.sample_s``); the
            # step model learns the rest, or one expensive row would inflate every row's cost.
            extra_s = sum(ran.result.row_s) if ran.result is not None else 0.0
            self._scheduler.observe_step(shape, time.perf_counter() - start - extra_s)
        return StepStats(
            plan.num_tokens, len(plan.entries), sampled, len(plan.preempted), ran.forward_s
        )

    def _schedule(self) -> SchedulerOutput:
        plan = self._scheduler.schedule()
        now = self._clock()
        for seq, err in plan.rejected:
            self._finish(seq, "error", FinishError.too_large(err))
        for seq, violation in plan.refused:
            log.warning("fence_violation", request_id=seq.seq_id, page_id=violation.page_id)
            self._finish(seq, "error", FinishError("kv_fence", str(violation)))
        for seq in plan.admitted:
            if not seq.announced and seq.status is SeqStatus.RUNNING:
                seq.announced = True
                queue_s = (seq.admitted_at or now) - seq.arrival
                seq.sink(Admitted(seq.seq_id, seq.num_prompt, seq.cached_tokens, queue_s))
        return plan

    def _execute(self, plan: SchedulerOutput) -> _Ran:
        """The forward over the fenced batch, then sampling of the rows that reached the end.

        One row's failure is its own (the blast radius of a request is that request): a
        forward that raises is run again on parts of the batch, adapter by adapter and then
        halves, until the rows that fail alone are found; a row whose logits are not finite
        fails with that reason; a sampling that raises is run again row by row. The other
        rows keep exactly the tokens they would have had (each row's arithmetic does not
        depend on its batch), and the failed rows finish with an internal error."""
        assert plan.attn is not None
        start = time.perf_counter()
        entries, logits, failed = self._forward_isolated(plan.entries, plan.attn)
        forward_s = time.perf_counter() - start
        samplers = [e for e in entries if e.samples]
        if logits is not None and samplers:
            # NOTE: one reduction over the rows (12-85 us for 1-64 rows of a 49k vocab on 2
            # cores): NaN or an infinity anywhere in a row makes its sum non-finite.
            finite = torch.isfinite(logits.sum(dim=-1)).tolist()
            if not all(finite):
                bad = {id(e) for e, ok in zip(samplers, finite, strict=True) if not ok}
                failed.extend((e.seq, _NOT_FINITE) for e in samplers if id(e) in bad)
                log.warning("row_not_finite", request_ids=[e.seq.seq_id for e in samplers if id(e) in bad])
                keep = [i for i, ok in enumerate(finite) if ok]
                logits = logits[keep]
                entries = tuple(e for e in entries if id(e) not in bad)
                samplers = [e for e in samplers if id(e) not in bad]
        result = None
        if samplers:
            assert logits is not None
            result, sample_failed = self._sample_isolated(logits, samplers)
            if sample_failed:
                failed.extend(sample_failed)
                gone = {id(seq) for seq, _ in sample_failed}
                entries = tuple(e for e in entries if id(e.seq) not in gone)
        return _Ran(entries, result, forward_s, failed)

    def _forward(self, entries: tuple[ScheduledSeq, ...], attn: AttentionFn) -> torch.Tensor:
        inputs = build_inputs(entries, self._runner.device, self._runner.lora_stacks)
        return self._runner.forward(inputs, attn)

    def _forward_isolated(
        self, entries: tuple[ScheduledSeq, ...], attn: AttentionFn
    ) -> tuple[tuple[ScheduledSeq, ...], torch.Tensor | None, list[tuple[SeqState, FinishError]]]:
        """``entries`` that ran, their sampling rows' logits, and the rows that failed."""
        try:
            return entries, self._forward(entries, attn), []
        except Exception as err:  # found below: which rows it belongs to
            if len(entries) == 1:
                seq = entries[0].seq
                log.warning("row_failed", request_id=seq.seq_id, error=type(err).__name__)
                return (), None, [(seq, _failure("the forward", err))]
            log.warning("step_failed_isolating", rows=len(entries), error=type(err).__name__)
        kept: list[ScheduledSeq] = []
        parts: list[torch.Tensor] = []
        failed: list[tuple[SeqState, FinishError]] = []
        for group in _split(entries):
            good, group_attn, refused = self._scheduler.fence(group)
            failed.extend((seq, FinishError("kv_fence", str(v))) for seq, v in refused)
            if group_attn is None:
                continue
            ran, logits, lost = self._forward_isolated(good, group_attn)
            kept.extend(ran)
            failed.extend(lost)
            if logits is not None and logits.shape[0]:
                parts.append(logits)
        logits = torch.cat(parts) if parts else None
        return tuple(kept), logits, failed

    def _sample_isolated(
        self, logits: torch.Tensor, samplers: list[ScheduledSeq]
    ) -> tuple[SampleResult | None, list[tuple[SeqState, FinishError]]]:
        rows = [_sample_row(e.seq) for e in samplers]
        states = [e.seq.generator.get_state() if e.seq.generator is not None else None
                  for e in samplers]  # fmt: skip
        try:
            return self._sampler.sample(logits, rows), []
        except Exception as err:
            if len(rows) == 1:
                seq = samplers[0].seq
                log.warning("row_failed", request_id=seq.seq_id, error=type(err).__name__)
                return None, [(seq, _failure("sampling", err))]
            log.warning("sampling_failed_isolating", rows=len(rows), error=type(err).__name__)
        failed: list[tuple[SeqState, FinishError]] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        row_s: list[float] = []
        for i, (e, row, state) in enumerate(zip(samplers, rows, states, strict=True)):
            if state is not None:
                assert e.seq.generator is not None
                e.seq.generator.set_state(state)  # as before the batch's draw
            try:
                one = self._sampler.sample(logits[i : i + 1], [row])
            except Exception as err:
                log.warning("row_failed", request_id=e.seq.seq_id, error=type(err).__name__)
                failed.append((e.seq, _failure("sampling", err)))
                continue
            tokens.extend(one.token_ids)
            logprobs.extend(one.logprobs)
            row_s.extend(one.row_s or [0.0])
        return (SampleResult(tokens, logprobs, row_s) if tokens else None), failed

    def _update(self, entries: tuple[ScheduledSeq, ...], result: SampleResult | None) -> int:
        """Commit the step's KV, then append, stream and stop-check each sampled token."""
        samplers: list[ScheduledSeq] = [e for e in entries if e.samples]  # before commit
        self._scheduler.update(entries)
        if result is None:
            return 0
        for e, token, lp in zip(samplers, result.token_ids, result.logprobs, strict=True):
            if e.seq.status is SeqStatus.RUNNING:
                self._accept(e.seq, token, lp)
        self._charge_sampling(samplers, result.row_s)
        return len(samplers)

    def _charge_sampling(self, samplers: list[ScheduledSeq], row_s: list[float]) -> None:
        """Each row's measured sampling cost: remembered on the sequence (the scheduler
        counts it in the next steps' cost) and charged to its tenant."""
        owed: dict[str, float] = {}
        for e, seconds in zip(samplers, row_s, strict=False):
            e.seq.sample_s = seconds if not e.seq.sample_s else (e.seq.sample_s + seconds) / 2
            owed[e.seq.tenant] = owed.get(e.seq.tenant, 0.0) + seconds
        for tenant, seconds in owed.items():
            if seconds > 0:  # greedy rows without masks or penalties cost nothing here
                self._scheduler.charge_cpu(tenant, seconds)

    def _accept(self, seq: SeqState, token: int, logprob: TokenLogprob | None) -> None:
        self._scheduler.append(seq, token)
        if seq.first_token_at is None:
            seq.first_token_at = self._clock()
        reason: FinishReason | None = None
        if token in seq.stop_ids:
            reason = "stop"  # the stop token's id is reported, its text is not
            text = seq.detok.flush()
        else:
            match = seq.num_output > seq.request.stopping.min_tokens
            text = seq.detok.push(token, match_stops=match)
            if seq.detok.stopped:
                reason = "stop"
            elif seq.num_output >= seq.max_tokens:
                reason = "length"
                text += seq.detok.flush()
            elif seq.grammar is not None and _grammar_done(seq.grammar, token):
                reason = "stop"
                text += seq.detok.flush()
        lps = (logprob,) if logprob is not None else ()
        seq.sink(Delta((token,), text, lps))
        if reason is not None:
            self._finish(seq, reason)

    # ---- finishing and housekeeping --------------------------------------------------------
    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request_id = heapq.heappop(self._deadlines)
            seq = self._seqs.get(request_id)
            # The id may belong to a newer request by now: check its own deadline.
            if seq is not None and seq.request.deadline is not None and seq.request.deadline <= now:
                self._finish(seq, "deadline")

    def _forget_deadline(self) -> None:
        """A request with a deadline finished: rebuild the heap once stale entries dominate,
        so finished long-timeout requests do not pile up in it."""
        self._num_deadlined -= 1
        if len(self._deadlines) > 2 * self._num_deadlined + 16:
            live = {rid for rid, s in self._seqs.items() if s.request.deadline is not None}
            self._deadlines = [e for e in self._deadlines if e[2] in live]
            heapq.heapify(self._deadlines)

    def _finish(
        self, seq: SeqState, reason: FinishReason, error: FinishError | None = None
    ) -> None:
        """Free the sequence's pages now and send its last event."""
        self._scheduler.finish(seq)
        del self._seqs[seq.seq_id]
        if seq.request.deadline is not None:
            self._forget_deadline()
        now = self._clock()
        admitted = seq.admitted_at if seq.admitted_at is not None else now
        ttft = None if seq.first_token_at is None else seq.first_token_at - seq.arrival
        seq.sink(
            Finished(
                reason=reason,
                prompt_tokens=seq.num_prompt,
                completion_tokens=seq.num_output,
                cached_tokens=seq.cached_tokens,
                queue_s=admitted - seq.arrival,
                ttft_s=ttft,
                total_s=now - seq.arrival,
                error=error,
            )
        )

    def idle_tick(self) -> None:
        """Between steps when idle: expire deadlines, evict expired cache pages."""
        self._housekeeping(self._clock())

    def _housekeeping(self, now: float) -> None:
        """Expire deadlines; every ``evict_interval_s``, evict TTL-expired pages."""
        self._expire(now)
        if now - self._last_evict >= self.config.evict_interval_s:
            self._last_evict = now
            self._queries.evict_expired()

    def fail_running(self, error: Exception) -> None:
        """A step raised unexpectedly: finish the running sequences with that error."""
        failure = FinishError("internal", type(error).__name__)
        for seq in list(self._scheduler.running):
            self._finish(seq, "error", failure)

    def finish_all(self, reason: FinishReason) -> int:
        """Finish every request (drain, shutdown); returns how many."""
        seqs = list(self._seqs.values())
        for seq in seqs:
            self._finish(seq, reason)
        self._deadlines.clear()
        self._num_deadlined = 0
        return len(seqs)


@dataclass(frozen=True, slots=True)
class _Ran:
    """What a step's execution gave: the entries that ran (in the order of ``result``'s
    sampling rows), their samples, the forward's seconds, and the rows that failed."""

    entries: tuple[ScheduledSeq, ...]
    result: SampleResult | None
    forward_s: float
    failed: list[tuple[SeqState, FinishError]]


def _sample_row(seq: SeqState) -> SampleRow:
    return SampleRow(
        params=seq.request.sampling,
        generator=seq.generator,
        prompt_ids=seq.request.prompt_ids,
        output_ids=seq.output_ids,
        # A grammar that allows only EOS must win over min_tokens' ban on it.
        banned_ids=seq.banned_ids() if seq.grammar is None else (),
        num_logprobs=seq.request.logprobs,
        grammar=seq.grammar,
    )


def _split(entries: tuple[ScheduledSeq, ...]) -> list[tuple[ScheduledSeq, ...]]:
    """A failed batch's parts to run again: its rows by adapter (the base's together), or,
    where all share one, its two halves."""
    by_adapter: dict[str, list[ScheduledSeq]] = {}
    for e in entries:
        adapter = e.seq.request.adapter
        by_adapter.setdefault("" if adapter is None else adapter.identity, []).append(e)
    if len(by_adapter) > 1:
        return [tuple(group) for group in by_adapter.values()]
    half = len(entries) // 2
    return [entries[:half], entries[half:]]


_NOT_FINITE_WORDS = "the model's logits for this request are not finite"
_NOT_FINITE = FinishError("internal", _NOT_FINITE_WORDS, cause=_NOT_FINITE_WORDS)


def _failure(stage: str, err: Exception) -> FinishError:
    """One request's failure in ``stage``: the exception's text stays in ``message`` (the
    engine's own, for logs); the client is told the stage and the exception's type."""
    name = type(err).__name__
    detail = f"{name}: {str(err)[:200]}" if str(err) else name
    return FinishError("internal", detail, cause=f"{stage} failed on this request ({name})")


def _grammar_done(grammar: GrammarMatcher, token: int) -> bool:
    """Advance the grammar; True once it is complete (only EOS could follow)."""
    if not grammar.accept(token):  # the mask allows only accepted tokens: a bug
        log.error("grammar_refused_token", error=grammar.error)
        return True
    return grammar.finished


def check_policy(policy: TenantSchedPolicy) -> None:
    if policy.weight <= 0 or policy.max_running < 1 or policy.max_waiting < 0:
        raise ValueError("weight must be > 0, max_running >= 1, max_waiting >= 0")
