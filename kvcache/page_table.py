"""One sequence's page table: its page refs and how far the prefix cache holds them.

The sequence's token ids and how many of them have KV belong to the engine (its SeqState);
the manager takes them as arguments where it needs them (prefix hashing, commit)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.allocator import PageRef
from kvcache.errors import InvalidRequest
from kvcache.metadata import SeqSpan
from kvcache.prefix_cache import ChainPos, Namespace


@dataclass(slots=True)
class PageTable:
    """Token ``i`` of the sequence lives in ``pages[i // page_size]`` at ``i % page_size``."""

    seq_id: str
    tenant: str
    page_size: int
    use_prefix_cache: bool
    salt: str = ""  # the caller's cache salt: a sub-namespace of the tenant's prefix cache
    adapter: str = ""  # the adapter's identity (name and content digest); "" = the base
    pages: list[PageRef] = field(default_factory=list)
    num_cached_pages: int = 0  # leading pages already matched or inserted in the prefix cache
    chain: ChainPos = field(default_factory=ChainPos)  # set by the manager as pages are cached
    chain_open: bool = True  # False after a collision: later pages are not cached
    shared_name: str = ""  # the shared prefix its first pages are read from ("" = none)
    shared_chain: str = ""  # that publication's chain id (set with shared_name)
    num_shared_pages: int = 0  # leading pages read from the shared prefix (read-only)
    num_restored_pages: int = 0  # cached pages that came back from the KV tier at open
    num_hit_pages: int = 0  # pages cached at open (shared, pool and tier)

    @property
    def namespace(self) -> Namespace:
        return Namespace(
            self.tenant, adapter=self.adapter, salt=self.salt, shared=self.shared_chain
        )

    @property
    def num_slots(self) -> int:
        return len(self.pages) * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        """Extra pages needed so tokens ``[0, num_tokens)`` have slots."""
        return max(0, -(-num_tokens // self.page_size) - len(self.pages))

    def page_tokens(self, token_ids: Sequence[int], index: int) -> Sequence[int]:
        """Token ids stored in full page ``index``."""
        return token_ids[index * self.page_size : (index + 1) * self.page_size]

    def slots(self, start: int, end: int) -> list[int]:
        """Flat KV slots (``page_id * page_size + offset``) of tokens ``[start, end)``."""
        ps = self.page_size
        return [self.pages[i // ps].page_id * ps + i % ps for i in range(start, end)]

    def span(self, num_computed: int, num_new: int) -> SeqSpan:
        """The step span for ``num_new`` tokens after ``num_computed``; refuses a span that
        disagrees with the table (tokens without slots, or rewriting prefix-cached pages that
        other sequences may share)."""
        end = num_computed + num_new
        cached = self.num_cached_pages * self.page_size
        if num_new < 1 or num_computed < cached or end > self.num_slots:
            raise InvalidRequest(
                f"step entry for {self.seq_id!r} (computed {num_computed}, new {num_new}) "
                f"does not match its state (cached {cached}, slots {self.num_slots})"
            )
        return SeqSpan(
            q_start=num_computed,
            num_new=num_new,
            page_ids=tuple(r.page_id for r in self.pages[: -(-end // self.page_size)]),
            slots=tuple(self.slots(num_computed, end)),
        )
