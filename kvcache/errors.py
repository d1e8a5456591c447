"""Typed errors raised by the KV cache.

Every error here is raised *before* any KV memory is read or handed out: a caller that
gets an exception never also gets data. Raised exceptions mean a bug in the caller; expected
outcomes (no room, a fenced sequence) are results (``kvcache.results``). ``FenceViolation``
is also the value ``begin_step`` reports a refused sequence with.
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


class UnknownSequence(KVCacheError):
    """A sequence id that is not open (never opened, or already freed)."""

    def __init__(self, seq_id: str) -> None:
        super().__init__(f"unknown sequence {seq_id!r}")
        self.seq_id = seq_id


class InvalidRequest(KVCacheError):
    """A call whose arguments are inconsistent with the sequence's state."""


class KernelRefused(KVCacheError, ValueError, IndexError):
    """A native kernel refused its input before it read or wrote KV memory: a dtype, shape,
    stride or device it does not take, or a step plan whose page indices, spans, lengths or
    KV rows fall outside the pool or outside the sequence they belong to. The engine fails
    that step's requests and keeps serving."""
