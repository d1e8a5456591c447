"""Results of the cache's expected outcomes: an allocation that did not fit, a step in which
the fence refused some sequences, where an open's cached tokens came from, a shared prefix
that could not be published. These are answers, not errors; kvcache raises only on bugs
(a call that disagrees with the cache's state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvcache.errors import FenceViolation
from kvcache.metadata import StepEntry
from kvcache.step import StepAttention

AllocFailure = Literal["quota", "out_of_pages"]
SharedFailure = Literal["no_full_page", "shared_budget", "out_of_pages"]


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


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Where a sequence's cached tokens came from at ``open``: ``shared_tokens`` from the
    shared prefix ``shared_name`` (read-only, the operator's), ``pool_tokens`` from the
    tenant's own cached pages in the pool, ``tier_tokens`` from its own pages restored
    from the KV tier. Their sum is what ``open`` returned."""

    shared_tokens: int = 0
    pool_tokens: int = 0
    tier_tokens: int = 0
    shared_name: str = ""

    @property
    def own_tokens(self) -> int:
        """The tenant's own cached tokens (pool and tier)."""
        return self.pool_tokens + self.tier_tokens

    @property
    def total(self) -> int:
        return self.shared_tokens + self.pool_tokens + self.tier_tokens


@dataclass(frozen=True, slots=True)
class SharedPublish:
    """``publish_shared``'s answer.

    ``ok`` with a ``seq_id``: that internal sequence holds the prefix's pages; prefill
    ``token_ids`` in it through ``begin_step``/``commit`` like any sequence (the commit of
    the last token seals the pages and tenants start reading them), then ``free`` it.
    ``ok`` with ``seq_id == ""``: the name is already declared with these tokens; nothing to
    do. Not ``ok``: nothing changed. ``no_full_page``: the text is shorter than a page.
    ``shared_budget``: the declared prefixes would hold ``requested`` pages against the
    ``limit`` of ``CacheConfig.shared_pages``. ``out_of_pages``: ``requested`` new pages,
    ``limit`` free plus evictable in the pool.
    """

    ok: bool
    seq_id: str = ""
    token_ids: tuple[int, ...] = ()
    reason: SharedFailure | None = None
    requested: int = 0
    limit: int = 0
