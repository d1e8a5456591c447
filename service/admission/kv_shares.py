"""Each tenant's share of the KV pool: the pages it may hold, running and cached together.

A tenant's ``max_kv_pages`` is its share when the tenants file sets one (> 0). The pages left
over are split between the other tenants in proportion to their weights. Shares are hard
caps (kvcache's per-tenant ``max_pages``): a tenant at its share evicts its own cached pages,
never another's. As long as the shares add up to no more than the pool, the pool itself never
runs out while every tenant is within its share, so no tenant's load can evict, preempt or
delay another's pages, and the eviction side channel of a global LRU is closed.

Shares that cannot all be honoured at once are refused (one readable line) unless overcommit
is asked for; then the shares may add up to more than the pool, and when it runs out the
scheduler preempts the tenant most over its share (see ``README.md`` for what that exposes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from service.admission.tenants import Tenant


class KVShareError(ValueError):
    """The tenants' KV quotas cannot all be honoured by the pool."""


def kv_shares(
    tenants: Mapping[str, Tenant], pool_pages: int, overcommit: bool = False
) -> dict[str, int]:
    """Pages per tenant. Raises ``KVShareError`` when they do not fit and not ``overcommit``."""
    explicit = {n: t.quotas.max_kv_pages for n, t in tenants.items() if t.quotas.max_kv_pages}
    derived = {n: t.weight for n, t in tenants.items() if n not in explicit}
    fixed = sum(explicit.values())
    if fixed > pool_pages and not overcommit:
        raise KVShareError(
            f"the tenants' max_kv_pages add up to {fixed} pages but the KV pool has "
            f"{pool_pages}; lower them, enlarge --kv-memory, or pass --kv-overcommit"
        )
    shares = dict(explicit)
    if not derived:
        return shares
    # Overcommitted: the others split the whole pool by weight, as if alone with each other.
    left = pool_pages if overcommit else pool_pages - fixed
    total_weight = sum(derived.values())
    for name, weight in derived.items():
        shares[name] = math.floor(left * weight / total_weight)
    starved = sorted(n for n in derived if shares[n] < 1)
    if starved and not overcommit:
        raise KVShareError(
            f"the tenants' max_kv_pages ({fixed} pages of the pool's {pool_pages}) leave no "
            f"KV pages for {', '.join(starved)}; lower them, enlarge --kv-memory, or pass "
            "--kv-overcommit"
        )
    return {n: max(1, s) for n, s in shares.items()}


def tier_shares(tenants: Mapping[str, Tenant], budget_bytes: int) -> dict[str, int]:
    """Each tenant's bytes of the KV tier: the budget split by weight. A tenant past its
    share evicts its own records from the tier, never another's (kvcache/tier.py)."""
    total_weight = sum(t.weight for t in tenants.values())
    return {n: math.floor(budget_bytes * t.weight / total_weight) for n, t in tenants.items()}
