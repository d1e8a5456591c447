"""The engine's step loop without threads: ``add``, ``abort``, ``step``.

``step()`` reads as schedule -> fence -> forward -> sample -> postprocess. Every finish
(stop, length, abort, deadline, error) frees the sequence's pages in the step that decides
it. ``add`` and ``abort`` may be called from another thread: they and the parts of ``step``
that touch the waiting queue run under one lock; the forward and sampling run outside it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from kvcache.attention import AttentionFn
from service.engine.cache_api import CacheManager
from service.engine.detokenizer import IncrementalDetokenizer
from service.engine.grammar import GrammarMatcher
from service.engine.request import SeqStatus, Sequence
from service.engine.runner import ForwardModel, ModelRunner, build_inputs, fence
from service.engine.sampler import Sampler, SampleRow
from service.engine.scheduler import ScheduledSeq, Scheduler
from service.engine.stop import StopMatcher
from service.engine.tokens import TokenSource
from service.engine.types import (
    Admitted,
    Delta,
    EngineConfig,
    EngineEvent,
    Finished,
    FinishReason,
    InvalidRequest,
    QueueFull,
    Request,
    TenantSchedPolicy,
    TokenLogprob,
)
from service.engine.validate import validate_request

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class StepStats:
    num_tokens: int
    num_seqs: int
    num_sampled: int
    num_preempted: int


class EngineCore:
    """Owns every request's state; one thread drives ``step``."""

    def __init__(
        self,
        model: ForwardModel,
        tokens: TokenSource,
        cache: CacheManager,
        config: EngineConfig,
        clock: Callable[[], float],
        device: torch.device,
        sampler_seed: int | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.tokens = tokens
        self._clock = clock
        self._policies: dict[str, TenantSchedPolicy] = {}
        self.scheduler = Scheduler(config, cache, self.policy, clock, config.drr_quantum)
        self.runner = ModelRunner(model, device)
        self.sampler = Sampler(device, sampler_seed)
        self._seqs: dict[str, Sequence] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._tiebreak = itertools.count()
        self._abort_ids: set[str] = set()
        self._lock = threading.Lock()
        self._last_evict = clock()
        self.num_steps = 0

    # ---- called from any thread -------------------------------------------------------
    def set_tenant_policy(self, tenant: str, policy: TenantSchedPolicy) -> None:
        if policy.weight <= 0 or policy.max_running < 1 or policy.max_waiting < 0:
            raise ValueError("weight must be > 0, max_running >= 1, max_waiting >= 0")
        with self._lock:
            self._policies[tenant] = policy

    def policy(self, tenant: str) -> TenantSchedPolicy:
        return self._policies.get(tenant) or TenantSchedPolicy()

    def add(
        self, request: Request, sink: Callable[[EngineEvent], None], internal: bool = False
    ) -> None:
        """Queue a request. Raises QueueFull, InvalidRequest or RequestTooLarge at once."""
        max_tokens = validate_request(request, self.config, self.tokens.vocab_size, internal)
        stopping = request.stopping
        stop_ids = set(stopping.stop_token_ids)
        if not stopping.ignore_eos:
            stop_ids.update(self.tokens.eos_token_ids)
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(request.sampling.seed)
        seq = Sequence(
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
        with self._lock:
            if request.request_id in self._seqs:
                raise InvalidRequest(f"request id {request.request_id!r} is already in use")
            limit = self.policy(request.tenant).max_waiting
            if self.scheduler.waiting.num_waiting(request.tenant) >= limit:
                raise QueueFull(request.tenant, limit)
            self._seqs[request.request_id] = seq
            self.scheduler.add(seq)
            if request.deadline is not None:
                entry = (request.deadline, next(self._tiebreak), request.request_id)
                heapq.heappush(self._deadlines, entry)

    def abort(self, request_id: str) -> None:
        """Finish the request with reason "abort" at the start of the next step."""
        with self._lock:
            if request_id in self._seqs:
                self._abort_ids.add(request_id)

    def num_waiting(self) -> int:
        with self._lock:
            return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_requests(self) -> int:
        with self._lock:
            return len(self._seqs)

    def has_work(self) -> bool:
        return bool(self._seqs) or bool(self._abort_ids)

    def next_deadline(self) -> float | None:
        with self._lock:
            return self._deadlines[0][0] if self._deadlines else None

    # ---- engine thread only ----------------------------------------------------------------
    def step(self) -> StepStats:
        """Run one iteration: admit, run one forward over the batch, sample, stream."""
        self.num_steps += 1
        with self._lock:
            now = self._clock()
            self._housekeeping(now)
            out = self.scheduler.schedule()
            for seq, err in out.rejected:
                self._finish(seq, "error", err)
            for seq in out.admitted:
                if not seq.announced:
                    seq.announced = True
                    queue_s = (seq.admitted_at or now) - seq.arrival
                    seq.sink(Admitted(seq.seq_id, seq.num_prompt, seq.cached_tokens, queue_s))
        stats = StepStats(out.num_tokens, len(out.entries), 0, len(out.preempted))
        if not out.entries:
            return stats
        batch = fence(self.cache, out.entries)
        with self._lock:
            for e, violation in batch.violations:
                log.warning("fence_violation", request_id=e.seq.seq_id, page_id=violation.page_id)
                self._finish(e.seq, "error", violation)
        if batch.attn is None:
            return stats
        sampled = self._run(batch.entries, batch.attn)
        return StepStats(out.num_tokens, len(batch.entries), sampled, len(out.preempted))

    def _run(self, entries: tuple[ScheduledSeq, ...], attn: AttentionFn) -> int:
        inputs = build_inputs(entries, self.runner.device)
        logits = self.runner.forward(inputs, attn)
        samplers = [e for e in entries if e.samples]
        rows = [
            SampleRow(
                params=e.seq.request.sampling,
                generator=e.seq.generator,
                prompt_ids=e.seq.request.prompt_ids,
                output_ids=e.seq.output_ids,
                # A grammar that allows only EOS must win over min_tokens' ban on it.
                banned_ids=e.seq.banned_ids() if e.seq.grammar is None else (),
                num_logprobs=e.seq.request.logprobs,
                grammar=e.seq.grammar,
            )
            for e in samplers
        ]
        result = self.sampler.sample(logits, rows) if rows else None
        with self._lock:
            for e in entries:
                e.seq.num_computed += e.num_new
                self.cache.commit(e.seq.seq_id, e.seq.num_computed)
            if result is not None:
                for e, token, lp in zip(samplers, result.token_ids, result.logprobs, strict=True):
                    if e.seq.status is SeqStatus.RUNNING:
                        self._accept(e.seq, token, lp)
        return len(samplers)

    def _accept(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        seq.token_ids.append(token)
        self.cache.append_token(seq.seq_id, token)
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
            elif seq.grammar is not None and self._grammar_done(seq.grammar, token):
                reason = "stop"
                text += seq.detok.flush()
        lps = (logprob,) if logprob is not None else ()
        seq.sink(Delta((token,), text, lps))
        if reason is not None:
            self._finish(seq, reason)

    @staticmethod
    def _grammar_done(grammar: GrammarMatcher, token: int) -> bool:
        """Advance the grammar; True once it is complete (only EOS could follow)."""
        if not grammar.accept(token):  # the mask allows only accepted tokens: a bug
            log.error("grammar_refused_token", error=grammar.error)
            return True
        return grammar.finished

    def _expire(self, now: float) -> None:
        for request_id in self._abort_ids:
            seq = self._seqs.get(request_id)
            if seq is not None:
                self._finish(seq, "abort")
        self._abort_ids.clear()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request_id = heapq.heappop(self._deadlines)
            seq = self._seqs.get(request_id)
            # The id may belong to a newer request by now: check its own deadline.
            if seq is not None and seq.request.deadline is not None and seq.request.deadline <= now:
                self._finish(seq, "deadline")

    def _finish(self, seq: Sequence, reason: FinishReason, error: Exception | None = None) -> None:
        """Free the sequence's pages now and send its last event. Caller holds the lock."""
        if seq.status is SeqStatus.RUNNING:
            self.scheduler.remove_running(seq)
        elif seq.status is SeqStatus.WAITING:
            self.scheduler.remove_waiting(seq)  # waiting sequences hold no pages
        seq.status = SeqStatus.FINISHED
        del self._seqs[seq.seq_id]
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
        """Between steps when idle: expire deadlines and aborts, evict expired cache pages."""
        with self._lock:
            self._housekeeping(self._clock())

    def _housekeeping(self, now: float) -> None:
        """Expire deadlines and aborts; every ``evict_interval_s``, evict TTL-expired pages."""
        self._expire(now)
        if now - self._last_evict >= self.config.evict_interval_s:
            self._last_evict = now
            self.cache.evict_expired()

    def fail_running(self, error: Exception) -> None:
        """A step raised unexpectedly: finish the running sequences with that error."""
        with self._lock:
            for seq in list(self.scheduler.running):
                self._finish(seq, "error", error)

    def finish_all(self, reason: FinishReason) -> None:
        """Finish every request (shutdown). Engine thread stopped, or called from it."""
        with self._lock:
            for seq in list(self._seqs.values()):
                self._finish(seq, reason)
            self._abort_ids.clear()
            self._deadlines.clear()
