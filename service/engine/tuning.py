"""Every scheduling constant, with its unit and why: the one source of their defaults.

``kvfence serve``'s flags (service/serve/commands.py), ``EngineSizing`` (service/serve/settings.py) and
``EngineConfig`` (service/engine/types.py) all take their defaults from
``SchedulerTuning()``; tests/service/test_tuning_defaults.py compares them. The scheduler
reads nothing else: no private constant decides a step. docs/scheduling.md explains each
knob for operators.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerTuning:
    """How the scheduler shares and sizes steps. Frozen; derived values are methods."""

    #: tokens. The most tokens (decode rows plus prefill chunks) one step computes: bounds the
    #: step's activation memory and, untimed, its length.
    max_num_batched_tokens: int = 512
    #: milliseconds. The most time other tenants' prefill chunks may add to a step while a
    #: tenant has work (0 = steps are sized in tokens alone); a tenant's own chunks count
    #: only against the others' bound while it is within a step's tokens of the least served.
    #: With ``decode_stretch`` it is the inter-token gap guarantee: no other tenant's work
    #: makes a tenant's gap longer than ``decode_stretch`` times what its own rows cost plus
    #: ``max_step_ms``.
    max_step_ms: float = 100.0
    #: multiple of a tenant's own decode rows' cost. A step the least-served decoding tenant's
    #: streams are in lasts at most this many times what their rows alone cost, counting the
    #: rows and chunks of tenants served more than it (0 = no such bound). 2 lets a second,
    #: equally busy tenant share every step on CPU, where one row costs about as much as many.
    decode_stretch: float = 2.0
    #: tokens. One request's prefill chunk while others have work (0 = ``request_share`` of
    #: the step), so one long prompt cannot take a whole step from the others.
    prefill_chunk: int = 0
    #: fraction of a step's tokens (and, timed, of its prefill time) one request's chunk may
    #: take while other requests have work, when ``prefill_chunk`` is 0.
    request_share: float = 0.5
    #: tokens (at least 1). A step always advances prefill by this many tokens, whatever the
    #: cost model says, so a long prompt under a tight ``max_step_ms`` still finishes. Beside another
    #: tenant's decodes only a tenant owed service gets all of it; any other chunk gets one
    #: token of it (a victim's short prompt must not crawl, an attacker's must not stretch
    #: the victim's gap by 16 tokens every step).
    min_prefill_tokens: int = 16
    #: seconds. A tenant whose last request ended this recently still counts as having work,
    #: so a stream's tenant between two requests (a client's round trip) is still guarded:
    #: others' chunks stay timed instead of filling one big untimed step it would wait for.
    idle_grace_s: float = 2.0
    #: seconds per token. What off-engine CPU work charged to a tenant (grammar compiles and
    #: masks, ``Engine.charge_cpu``) counts as before the cost model has seen a prefill
    #: chunk: a prefill token of the default model costs ~0.5-2 ms on a 2-core CPU, and 1 ms
    #: errs toward charging it.
    cpu_seconds_per_token: float = 1e-3
    #: weight (per observed step) of the cost model's past observations: 0.9 follows a
    #: machine whose load changes within a few dozen steps.
    cost_decay: float = 0.9
    #: rows. Decode batches up to this size are priced at their own observed time rather
    #: than the fitted line (a step's cost is not linear in its rows): the sizes a guarded
    #: tenant's own rows have. 0 = the line alone.
    observed_rows: int = 16

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if not 0.0 <= self.max_step_ms < float("inf"):
            raise ValueError("max_step_ms must be a finite number >= 0")
        if not 0.0 <= self.decode_stretch < float("inf"):
            raise ValueError("decode_stretch must be a finite number >= 0")
        if self.prefill_chunk < 0:
            raise ValueError("prefill_chunk must be >= 0")
        if self.min_prefill_tokens < 1:
            # With no floor, a cost model that prices every chunk over the bound would stall
            # prefill for good: steps without chunks never teach it otherwise.
            raise ValueError("min_prefill_tokens must be at least 1")
        if not 0.0 < self.request_share <= 1.0:
            raise ValueError("request_share must be in (0, 1]")
        if not 0.0 <= self.idle_grace_s < float("inf"):
            raise ValueError("idle_grace_s must be a finite number >= 0")
        if not 0.0 < self.cpu_seconds_per_token < float("inf"):
            raise ValueError("cpu_seconds_per_token must be a finite number > 0")
        if self.observed_rows < 0:
            raise ValueError("observed_rows must be >= 0")
        if not 0.0 < self.cost_decay < 1.0:
            raise ValueError("cost_decay must be in (0, 1)")

    @property
    def timed(self) -> bool:
        """Whether steps beside another tenant's decodes are sized to a time target."""
        return self.max_step_ms > 0

    def chunk_cap(self) -> int:
        """Tokens one request's chunk may take while other requests have work."""
        if self.prefill_chunk:
            return self.prefill_chunk
        return max(1, int(self.max_num_batched_tokens * self.request_share))
