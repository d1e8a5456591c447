"""How much a step may carry: the token budget and the time bound, from the cost model.

The guarantee, for operators: while a tenant's streams decode, no other tenant's work makes
the step they are in longer than ``decode_stretch`` times what the tenant's own rows cost
plus ``max_step_ms`` (``SchedulerTuning``), give or take the cost model's error and the
prefill floor. It is kept by three bounds, each from the cost model:

- decode rows: the least-served decoding tenant's rows always run; other tenants' rows join
  while the decode part stays within ``decode_stretch`` times what those rows alone cost
  (the guard, ``decode_rows``);
- a prefill chunk of a tenant served more than some decoding tenant fits in what the decode
  rows leave of the guard (``ChunkTerms.stretched``); such a tenant with a prompt running
  keeps its prompt's prefill floor out of its own rows' room, its rows joining within the
  rest (``decode_rows``);
- the chunks of other tenants add at most ``max_step_ms`` to a step that a tenant with
  work is in (``ChunkTerms.timed``): a level tenant's own chunks are its own work and count
  only against the others' bound, while a tenant more than a step's tokens ahead of the
  least served has every chunk in the step count against its own (``ChunkTerms.level``); a
  tenant alone is held to the token budget only, since a timed step on CPU is mostly fixed
  cost (docs/scheduling.md has the measurement).

The step's first ``min_prefill_tokens`` prefill tokens are granted whatever the clock says,
so a long prompt still advances under a tight bound; beside another tenant's decodes only a
chunk owed service (or one that finishes its prompt within the floor) gets all of it.
Hardware is not special-cased here: the regime (packed weights, CUDA-graph sizes) reaches
the budget only through ``StepCost``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from service.engine.cost_model import Regime, StepCost, StepCostModel, StepShape
from service.engine.fairness import FairShare
from service.engine.tuning import SchedulerTuning


class DecodeRow(Protocol):
    @property
    def tenant(self) -> str: ...

    @property
    def admit_order(self) -> int: ...

    @property
    def num_computed(self) -> int: ...

    @property
    def sample_s(self) -> float:
        """The row's measured sampling cost (grammar mask, penalties, logprobs)."""
        ...


R = TypeVar("R", bound=DecodeRow)


@dataclass(frozen=True, slots=True)
class ChunkTerms:
    """What one prefill chunk of ``tenant`` is held to, decided per chunk from the fair share.

    ``timed``: another tenant has work, so the chunk is held to ``max_step_ms``;
    ``level``: its tenant is within a step's tokens of the least-served tenant with work, so
    only the others' chunks count against the bound that guards it (else every chunk in
    the step does); ``stretched``: its tenant is served more than a tenant decoding in the
    step, so it is also held to the guard; ``full_floor``: it may take all of the step's
    prefill floor (else one token of it, which spends the rest)."""

    tenant: str
    timed: bool
    stretched: bool
    full_floor: bool
    level: bool = False


@dataclass(slots=True)
class StepRoom:
    """What is left of one step while prefill chunks fill it. ``bound_s`` is
    ``max_step_ms``: what the chunks of tenants other than one of ``present`` (the tenants
    with work) may add to the step; ``stretch_s`` is what is left of the guard for
    stretched chunks; ``cap_tokens``/``cap_s`` bound one request's chunk while others have
    work."""

    tokens: int
    step_tokens: int  # tokens the step carries so far (its regime depends on them)
    cost: StepCost | None = None
    bound_s: float = math.inf
    stretch_s: float = math.inf
    floor: int = 0
    cap_tokens: int = 1 << 30
    cap_s: float = math.inf
    present: frozenset[str] = frozenset()
    chunks_s: float = 0.0  # the step's chunks so far, every tenant's
    own_s: dict[str, float] = field(default_factory=dict)  # ... per tenant

    def others_s(self, terms: ChunkTerms) -> float:
        """What the step's chunks already add against the bound ``terms``' chunk is held
        to: for a level tenant, the most that chunks not of one other present tenant add
        (a present tenant with no chunk in the step sees every chunk as another's); for any
        other, every chunk in the step."""
        if not terms.level:
            return self.chunks_s
        return max(
            (self.chunks_s - self.own_s.get(t, 0.0) for t in self.present if t != terms.tenant),
            default=self.chunks_s,
        )

    def chunk(self, context: int, want: int, terms: ChunkTerms, capped: bool = True) -> int:
        """Tokens (at most ``want``) for one chunk after ``context`` computed tokens."""
        n = min(want, self.tokens, self.cap_tokens) if capped else min(want, self.tokens)
        if terms.timed:
            floor = self.floor if terms.full_floor else min(self.floor, 1)
            if self.cost is None:  # unmeasured: the floor alone; the first steps teach it
                n = min(n, floor)
            else:
                left = self.bound_s - self.others_s(terms)
                if capped:
                    left = min(left, self.cap_s)
                if terms.stretched:
                    left = min(left, self.stretch_s)
                fits = self.cost.chunk_tokens(left, context, self.step_tokens)
                n = min(n, max(fits, floor))
        return max(n, 0)

    def take(self, context: int, tokens: int, terms: ChunkTerms) -> None:
        """Spend a chunk's tokens and time. Every chunk, timed or not, counts toward the
        others' bound of each other present tenant and spends the guard, so a later chunk
        is held to what is really left of the step."""
        self.tokens -= tokens
        if terms.timed:
            # A chunk held to one token of the floor spends all of it.
            self.floor = max(0, self.floor - tokens) if terms.full_floor else 0
        if self.cost is not None:
            spent = self.cost.chunk_seconds(context, tokens, self.step_tokens)
            self.chunks_s += spent
            self.own_s[terms.tenant] = self.own_s.get(terms.tenant, 0.0) + spent
            self.stretch_s -= spent
        self.step_tokens += tokens

    def is_open(self) -> bool:
        return self.tokens > 0


class StepBudget:
    """Sizes steps for the scheduler: ``decode_rows`` then ``room``, with ``terms`` per
    chunk; ``observe`` feeds each step's wall time back into the cost model."""

    def __init__(self, tuning: SchedulerTuning, regime: Regime) -> None:
        self.tuning = tuning
        self.cost = StepCostModel(regime, tuning.cost_decay, tuning.observed_rows)

    def fit(self) -> StepCost | None:
        """The cost model for this step; None while steps are sized in tokens alone."""
        return self.cost.fit() if self.tuning.timed else None

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.cost.observe(shape.rows, shape.row_keys, shape.chunks, seconds)

    def cpu_tokens(self, seconds: float) -> float:
        """The prefill tokens (a fraction too) a step computes in ``seconds`` of CPU time,
        by the fitted per-token cost (``cpu_seconds_per_token`` before a chunk was seen)."""
        cost = self.cost.fit()
        per_token = cost.per_token_s if cost is not None and cost.per_token_s > 0 else 0.0
        return max(0.0, seconds) / (per_token or self.tuning.cpu_seconds_per_token)

    def decode_rows(
        self,
        fair: FairShare,
        decoding: Sequence[R],
        cost: StepCost | None,
        prompting: Mapping[str, tuple[int, int]],
    ) -> tuple[list[R], float]:
        """The decode rows this step runs, in ``decoding``'s order, and the guard: the step
        time they leave (infinite when no guard applies).
        A tenant served more than the least served, with a prompt running (``prompting``:
        its ``(context, tokens left)``), keeps the time of that prompt's prefill floor
        (``min_prefill_tokens``) out of the room the guard leaves it: its own rows join
        within the rest.
        NOTE: with every row in every step, a tenant's eight streams at 1,000 keys made a
        victim's one stream decode at 80-90 ms a token against 30 ms alone (one thread).
        NOTE: with such a tenant's rows always first, its prompt got what its rows left of
        the guard, which the cost model's error decides: 64 offline requests of two
        tenants ran the second tenant's last prompt at 1 token a step for 2 s in 2 of 14
        runs (240-250 steps against 160-170, 0.89x one tenant's throughput). With half
        the room kept for the prompt, its streams waited more (docs/scheduling.md has the
        measurements)."""
        stretch = self.tuning.decode_stretch
        if cost is None or stretch <= 0 or not decoding:
            return list(decoding), math.inf
        first, rest = fair.decode_order(decoding)
        keys = sum(s.num_computed + 1 for s in first)
        # A row's sampling cost (its grammar mask, penalties, truncation, logprobs) is part
        # of what it adds to the step, measured per row: a grammar's mask can cost far more
        # than the forward (170 ms a token for an ambiguous grammar), so an expensive row
        # runs beside others' decodes only when its tenant is the least served.
        sampling = sum(s.sample_s for s in first)
        own_s = cost.decode_seconds(len(first), keys) + sampling
        guard = max(1.0, stretch) * own_s
        floor = self.tuning.min_prefill_tokens
        kept = {t: min(guard - own_s, cost.chunk_seconds(context, min(floor, left)))
                for t, (context, left) in prompting.items()}
        rows = list(first)
        for seq in rest:
            more = keys + seq.num_computed + 1
            limit = guard - kept.get(seq.tenant, 0.0)
            if cost.decode_seconds(len(rows) + 1, more) + sampling + seq.sample_s <= limit:
                rows.append(seq)
                keys = more
                sampling += seq.sample_s
                fair.ran(seq.tenant, seq.admit_order)
        chosen = {id(s) for s in rows}
        return [s for s in decoding if id(s) in chosen], guard

    def room(
        self,
        decodes: Sequence[DecodeRow],
        cost: StepCost | None,
        guard_s: float,
        alone: bool,
        present: frozenset[str] = frozenset(),
    ) -> StepRoom:
        """What the step's prefill chunks may take once ``decodes`` are in; ``alone``: one
        request has work, so no per-request cap applies; ``present``: the tenants with work,
        each guarded against the others' chunks."""
        t = self.tuning
        tokens = max(t.max_num_batched_tokens - len(decodes), 0)
        cap_tokens = t.prefill_chunk or (1 << 30 if alone else t.chunk_cap())
        if not t.timed:
            return StepRoom(tokens, len(decodes), cap_tokens=cap_tokens, present=present)
        seconds = t.max_step_ms / 1000.0
        stretch_s = math.inf
        if cost is not None and decodes and math.isfinite(guard_s):
            keys = sum(s.num_computed + 1 for s in decodes)
            # NOTE: the bound is on what prefill adds, not on the whole step. Held to a
            # 100 ms step, a CPU batch of 8 decodes (~70 ms) left about one floor of 16
            # prefill tokens a step, and two tenants' offline work ran at half speed.
            stretch_s = max(0.0, guard_s - cost.decode_seconds(len(decodes), keys))
        cap_s = seconds * t.request_share if not alone and not t.prefill_chunk else math.inf
        return StepRoom(
            tokens, len(decodes), cost, seconds, stretch_s, t.min_prefill_tokens,
            cap_tokens, cap_s, present,
        )

    def terms(
        self,
        fair: FairShare,
        tenant: str,
        remaining: int,
        decoding: set[str],
        present: frozenset[str],
    ) -> ChunkTerms:
        """The terms of a chunk of ``tenant`` with ``remaining`` prompt tokens to go, in a
        step whose decode rows belong to ``decoding``; ``present``: the tenants with work.
        NOTE: with a floor of one token for everyone beside decodes, a victim's short prompt
        advanced a token a step while an attacker's streams decoded (TTFT 0.09 -> 0.5 s);
        with the full floor for everyone, an attacker's long prompts added 16 tokens to
        every one of the victim's steps (inter-token gap 0.018 -> 0.10 s)."""
        if not self.tuning.timed or not any(t != tenant for t in present):
            return ChunkTerms(tenant, timed=False, stretched=False, full_floor=True)
        owed = fair.owed(tenant, decoding)
        full = owed or remaining <= self.tuning.min_prefill_tokens
        level = fair.level(tenant, present, self.tuning.max_num_batched_tokens)
        return ChunkTerms(tenant, timed=True, stretched=not owed, full_floor=full, level=level)
