"""Shared prefixes: token prefixes the operator declares public, held in read-only pages.

A declaration is a name and the token ids of a prompt prefix (a system prompt, say). Only
its full pages are shared; the tokens of a last partial page are not part of it. Its pages
belong to :data:`~kvcache.allocator.SHARED_OWNER`, count against the server's
``shared_pages`` budget and never against a tenant's quota, are prefilled once through the
ordinary step path by an internal sequence, and are sealed read-only when that sequence has
committed them. From then on a tenant that opted in to the name (``TenantCachePolicy``)
reads them whenever its prompt begins with those pages' token ids (compared token by token,
never by a hash alone), on base-model, unsalted sequences only: a sequence with an adapter
or a cache salt never reads a shared page.

A shared page is never evicted while its name is declared, never written after it is
sealed (the fence refuses the write), and never reclaimed while a sequence reads it. A
withdrawn or replaced declaration takes no new hits at once; its pages are scrubbed and
freed when the last sequence reading them lets go.

Each publication has a chain id (the name and a serial) and one chain serial per page: a
tenant's own cached pages after a shared prefix live in the namespace that chain id names,
so they never meet the tenant's entries that start from the root, and they are dropped
with the publication.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvcache.allocator import PageRef


@dataclass(slots=True)
class SharedPrefix:
    """One publication of a declared name."""

    name: str
    chain: str  # the chain id: "name#serial", unique for the cache's lifetime
    token_ids: tuple[int, ...]  # the full pages' tokens
    seq_id: str  # the internal sequence that prefills it
    pages: tuple[PageRef, ...]
    serials: tuple[int, ...]  # each page's chain serial (prefix_cache)
    live: bool = False  # prefilled and sealed: tenants may read it
    declared: bool = True  # False once withdrawn or replaced

    @property
    def num_pages(self) -> int:
        return len(self.pages)


@dataclass(frozen=True, slots=True)
class SharedMatch:
    """A sequence's hit: the first ``num_pages`` pages of ``prefix``."""

    prefix: SharedPrefix
    num_pages: int


@dataclass(slots=True)
class SharedPrefixes:
    """The declared names, the publications still read after their withdrawal, and the hit
    counters per name. Holds no pages itself: the manager allocates and frees them."""

    declared: dict[str, SharedPrefix] = field(default_factory=dict)
    by_page: dict[int, SharedPrefix] = field(default_factory=dict)  # every page of every one
    by_seq: dict[str, SharedPrefix] = field(default_factory=dict)  # prefills not yet freed
    hits: dict[str, int] = field(default_factory=dict)  # name -> sequences that hit it
    hit_tokens: dict[str, int] = field(default_factory=dict)  # name -> tokens served

    def add(self, prefix: SharedPrefix) -> None:
        self.declared[prefix.name] = prefix
        self.by_seq[prefix.seq_id] = prefix
        for ref in prefix.pages:
            self.by_page[ref.page_id] = prefix

    def withdraw(self, name: str) -> SharedPrefix | None:
        """Take ``name`` out of the declared set (no new hits); returns its publication."""
        prefix = self.declared.pop(name, None)
        if prefix is not None:
            prefix.declared = False
        return prefix

    def forget_page(self, page_id: int) -> None:
        """The page went back to the pool."""
        del self.by_page[page_id]

    def match(
        self, names: Iterable[str], token_ids: Sequence[int], page_size: int, max_pages: int
    ) -> SharedMatch | None:
        """The longest run of leading full pages, at most ``max_pages``, that one live
        declared prefix among ``names`` shares with ``token_ids``, compared token by token."""
        best: SharedMatch | None = None
        for name in sorted(names):
            prefix = self.declared.get(name)
            if prefix is None or not prefix.live:
                continue
            n = 0
            limit = min(max_pages, prefix.num_pages)
            while n < limit and _same_page(prefix.token_ids, token_ids, n, page_size):
                n += 1
            if n and (best is None or n > best.num_pages):
                best = SharedMatch(prefix, n)
        return best

    def count_hit(self, name: str, tokens: int) -> None:
        self.hits[name] = self.hits.get(name, 0) + 1
        self.hit_tokens[name] = self.hit_tokens.get(name, 0) + tokens


def _same_page(a: Sequence[int], b: Sequence[int], index: int, page_size: int) -> bool:
    lo, hi = index * page_size, (index + 1) * page_size
    return len(b) >= hi and tuple(a[lo:hi]) == tuple(b[lo:hi])
