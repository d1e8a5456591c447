"""Results of the cache's expected outcomes: an allocation that did not fit, a step in which
the fence refused some sequences. These are answers, not errors; kvcache raises only on bugs
(a call that disagrees with the cache's state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvcache.errors import FenceViolation
from kvcache.metadata import StepEntry
from kvcache.step import StepAttention

AllocFailure = Literal["quota", "out_of_pages"]


@dataclass(frozen=True, slots=True)
class Allocation:
    """Whether ``allocate_slots`` fit. On ``ok=False`` nothing was allocated.

    ``quota``: the tenant would hold ``requested`` pages (running + cached) against its
    ``limit`` even after evicting its own cache. ``out_of_pages``: ``requested`` new pages,
    ``limit`` free plus evictable in the pool.
    """

    ok: bool
    reason: AllocFailure | None = None
    requested: int = 0
    limit: int = 0


FITS = Allocation(ok=True)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """``begin_step``'s answer: the entries that passed the fence, in order, with their
    attention (None when none passed), and each refused entry with its violation."""

    entries: tuple[StepEntry, ...]
    attn: StepAttention | None
    refused: tuple[tuple[StepEntry, FenceViolation], ...]
