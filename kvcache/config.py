"""Frozen configuration for the KV cache: server-wide and per-tenant."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal

ScrubPolicy = Literal["reassign", "always", "off"]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Server-wide cache settings.

    ``scrub_policy``: ``reassign`` zeroes a page before it passes to a tenant other than
    the one whose data it holds; ``always`` zeroes every page as it returns to the free
    list; ``off`` never zeroes (benchmarks only). ``secret`` keys the prefix-cache HMAC;
    the random default means cache keys never survive a restart. ``shared_pages``: the
    most pages the operator's declared shared prefixes may hold at once, counting
    withdrawn ones still read (0: none may be declared).
    """

    page_size: int = 16
    scrub_policy: ScrubPolicy = "reassign"
    default_ttl_s: float = 600.0
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    shared_pages: int = 0

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.scrub_policy not in ("reassign", "always", "off"):
            raise ValueError(f"unknown scrub_policy {self.scrub_policy!r}")
        if self.default_ttl_s < 0:
            raise ValueError(f"default_ttl_s must be >= 0, got {self.default_ttl_s}")
        if not self.secret:
            raise ValueError("secret must not be empty")
        if self.shared_pages < 0:
            raise ValueError(f"shared_pages must be >= 0, got {self.shared_pages}")


@dataclass(frozen=True, slots=True)
class TenantCachePolicy:
    """Per-tenant limits. ``max_pages`` counts running and cached pages (None = unlimited);
    ``ttl_s`` None means the server default, 0 means no prefix caching for the tenant.
    ``tier_bytes``: the tenant's share of the KV tier (None = the tier's whole budget).
    ``shared_prefixes``: the declared shared prefixes the tenant's base-model, unsalted
    sequences may read."""

    max_pages: int | None = None
    ttl_s: float | None = None
    tier_bytes: int | None = None
    shared_prefixes: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.max_pages is not None and self.max_pages < 0:
            raise ValueError(f"max_pages must be >= 0, got {self.max_pages}")
        if self.ttl_s is not None and self.ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {self.ttl_s}")
        if self.tier_bytes is not None and self.tier_bytes < 0:
            raise ValueError(f"tier_bytes must be >= 0, got {self.tier_bytes}")
        if not isinstance(self.shared_prefixes, frozenset):
            raise ValueError("shared_prefixes must be a frozenset of names")
