"""Typed errors raised by the KV cache.

Every error here is raised *before* any KV memory is read or handed out: a caller that
gets an exception never also gets data.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class for every kvcache error."""


class FenceViolation(KVCacheError):
    """A page was used by someone who does not own it (stale generation, wrong tenant,
    double free). Raised instead of returning data; the manager counts every one."""

    def __init__(self, page_id: int, reason: str) -> None:
        super().__init__(f"fence violation on page {page_id}: {reason}")
        self.page_id = page_id
        self.reason = reason


class QuotaExceeded(KVCacheError):
    """The tenant would hold more than ``limit_pages`` even after evicting its own cache.
    ``requested`` is the number of pages the tenant would then hold (running + cached)."""

    def __init__(self, tenant: str, limit_pages: int, requested: int) -> None:
        super().__init__(
            f"tenant {tenant!r} page quota exceeded: requested {requested}, limit {limit_pages}"
        )
        self.tenant = tenant
        self.limit_pages = limit_pages
        self.requested = requested


class OutOfPages(KVCacheError):
    """The pool is exhausted even after evicting every unreferenced cached page."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"out of KV pages: requested {requested}, available {available}")
        self.requested = requested
        self.available = available


class UnknownSequence(KVCacheError):
    """A sequence id that is not open (never opened, or already freed)."""

    def __init__(self, seq_id: str) -> None:
        super().__init__(f"unknown sequence {seq_id!r}")
        self.seq_id = seq_id


class InvalidRequest(KVCacheError):
    """A call whose arguments are inconsistent with the sequence's state."""
