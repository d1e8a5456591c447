"""The memory rules the scheduler applies through the cache: what a request can never fit,
and whose sequence is preempted when an overcommitted pool runs out.

KV pages are memory, not compute, so these rules count pages against each tenant's share,
not the fair share's tokens: a tenant's pages within its share are taken only by its own
demand. The fair share only breaks ties.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.manager import KVCacheManager
from service.engine.fairness import FairShare
from service.engine.request import SeqState
from service.engine.types import RequestTooLarge


def page_limit(cache: KVCacheManager, tenant: str) -> tuple[int, str]:
    """The most pages ``tenant`` may hold, and what sets it (the pool or its quota)."""
    limit, what = cache.num_pages, "pool"
    quota = cache.usage(tenant).max_pages
    if quota is not None and quota < limit:
        limit, what = quota, "tenant page quota"
    return limit, what


def never_fits(cache: KVCacheManager, seq: SeqState) -> RequestTooLarge | None:
    """The error for a request whose prompt plus full output budget can never fit."""
    needed = -(-seq.max_total_tokens // cache.page_size)
    limit, what = page_limit(cache, seq.tenant)
    return RequestTooLarge(needed, limit, what) if needed > limit else None


def most_over_share(cache: KVCacheManager, running: Sequence[SeqState], fair: FairShare) -> str:
    """The running tenant holding the most pages beyond its share (ties: the most pages,
    then the most weighted processed tokens)."""

    def over(tenant: str) -> tuple[int, int, float]:
        u = cache.usage(tenant)
        held = u.pages_in_use + u.pages_cached
        share = cache.num_pages if u.max_pages is None else u.max_pages
        return held - share, held, fair.served(tenant)

    return max({s.tenant for s in running}, key=over)
