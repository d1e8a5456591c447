"""Page allocator: refcounts, owner tenants, generation fences and the LRU free list.

Every page has one owner at a time and a generation counter. The owner is a tenant, or
:data:`SHARED_OWNER`, the operator, for the pages of a declared shared prefix: those are
sealed read-only once prefilled, and any tenant's sequence that holds one may read it, none
may write it. The generation goes up
whenever the page leaves its owner (free or eviction) and again when it is handed out, so a
``PageRef(page_id, generation)`` taken earlier can never name the page's next life.
``check`` is the fence: it refuses a ref whose generation, owner or holder does not
match, and raises :class:`FenceViolation` instead of letting the caller near the memory.

Each page records which sequences hold it; the refcount is the number of holders. Naming
the holder makes a double free detectable even while other sequences still share the page.
Refcounts count sequence references only (a sealed shared page is kept by its declaration,
not by a refcount); the prefix cache holds no refcount (a cached
page with refcount 0 is "idle" and lives in the eviction queue, not the free list).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvcache.errors import FenceViolation

#: The owner of shared-prefix pages. Tenant names never contain ``@`` (tenant names are
#: validated names of letters, digits, ``_``, ``.`` and ``-``), so no tenant can be it.
SHARED_OWNER = "@shared"


@dataclass(frozen=True, slots=True)
class PageRef:
    """A claim on one page in one generation. Stale as soon as the page changes hands."""

    page_id: int
    generation: int


@dataclass(slots=True)
class PageState:
    holders: set[str] = field(default_factory=set)  # sequence ids holding a reference
    owner: str | None = None  # tenant holding the page (running or cached); None when free
    data_owner: str | None = None  # tenant whose KV bytes the page holds; None when zeroed
    generation: int = 0
    read_only: bool = False  # a sealed shared-prefix page (owner SHARED_OWNER)

    @property
    def refcount(self) -> int:
        return len(self.holders)


@dataclass(slots=True)
class TenantPages:
    owned: int = 0  # pages whose owner is the tenant (referenced + cached idle)
    referenced: int = 0  # owned pages with refcount > 0


class PageAllocator:
    """Hands out pages to tenants and fences every later use."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._pages = [PageState() for _ in range(num_pages)]
        # NOTE: vLLM block_pool style LRU: take from the front, return to the back. Callers
        # return a sequence's pages in reverse, so its tail is reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))
        self._tenants: dict[str, TenantPages] = {}
        self.violations = 0

    # -- queries -------------------------------------------------------------------------
    def num_free(self) -> int:
        return len(self._free)

    def free_page_ids(self) -> list[int]:
        """Free pages in the order they will be handed out."""
        return list(self._free)

    def state(self, page_id: int) -> PageState:
        """A copy of one page's bookkeeping (for stats and tests)."""
        s = self._pages[page_id]
        return PageState(set(s.holders), s.owner, s.data_owner, s.generation, s.read_only)

    def tenant_pages(self, tenant: str) -> TenantPages:
        t = self._tenants.get(tenant)
        return TenantPages() if t is None else TenantPages(t.owned, t.referenced)

    # -- the fence -----------------------------------------------------------------------
    def _violation(self, page_id: int, reason: str) -> FenceViolation:
        self.violations += 1
        return FenceViolation(page_id, reason)

    def check(
        self,
        ref: PageRef,
        tenant: str,
        holder: str,
        not_held: str = "page not held by this sequence",
        *,
        write: bool = False,
    ) -> None:
        """Raise FenceViolation unless sequence ``holder`` of ``tenant`` may use ``ref`` now:
        read it, or also write it when ``write``. A sealed shared page may be read by any
        sequence holding it and written by none."""
        if not 0 <= ref.page_id < self.num_pages:
            raise self._violation(ref.page_id, "page id out of range")
        s = self._pages[ref.page_id]
        if s.generation != ref.generation:
            raise self._violation(ref.page_id, "stale generation")
        if s.owner != tenant and not (s.owner == SHARED_OWNER and s.read_only):
            raise self._violation(ref.page_id, "page owned by another tenant")
        if holder not in s.holders:
            raise self._violation(ref.page_id, not_held)
        if write and s.read_only:
            raise self._violation(ref.page_id, "write to a read-only shared page")

    # -- transitions ---------------------------------------------------------------------
    def take(self, tenant: str, holder: str) -> tuple[PageRef, str | None]:
        """Take the least recently freed page for ``tenant``.

        Returns the new ref and the tenant whose data the page still holds (None if it is
        zeroed), so the caller can scrub before any write. Caller checks availability.
        """
        page_id, _ = self._free.popitem(last=False)
        s = self._pages[page_id]
        s.generation += 1  # reassignment
        s.owner = tenant
        s.holders = {holder}
        t = self._tenants.setdefault(tenant, TenantPages())
        t.owned += 1
        t.referenced += 1
        return PageRef(page_id, s.generation), s.data_owner

    def mark_written(self, page_id: int, tenant: str) -> None:
        """Record that ``tenant``'s KV may now be in the page."""
        self._pages[page_id].data_owner = tenant

    def mark_zeroed(self, page_id: int) -> None:
        self._pages[page_id].data_owner = None

    def share(self, page_id: int, tenant: str, holder: str) -> PageRef:
        """Add a reference to a page ``tenant`` already owns (a prefix-cache hit)."""
        s = self._pages[page_id]
        if s.owner != tenant:
            raise self._violation(page_id, "prefix hit on a page owned by another tenant")
        if holder in s.holders:
            raise self._violation(page_id, "sequence already holds this page")
        if not s.holders:
            self._tenants[tenant].referenced += 1
        s.holders.add(holder)
        return PageRef(page_id, s.generation)

    def share_sealed(self, ref: PageRef, holder: str) -> PageRef:
        """Add a reference to a sealed shared page (a shared-prefix hit), only in the
        generation ``ref`` names."""
        s = self._pages[ref.page_id]
        if s.generation != ref.generation or s.owner != SHARED_OWNER or not s.read_only:
            raise self._violation(ref.page_id, "shared hit on a page that is not sealed")
        if holder in s.holders:
            raise self._violation(ref.page_id, "sequence already holds this page")
        if not s.holders:
            self._tenants[SHARED_OWNER].referenced += 1
        s.holders.add(holder)
        return ref

    def seal(self, page_id: int) -> None:
        """Make a shared page read-only (its prefix is prefilled and published)."""
        s = self._pages[page_id]
        if s.owner != SHARED_OWNER:
            raise self._violation(page_id, "seal of a page the operator does not own")
        s.read_only = True

    def release(self, ref: PageRef, tenant: str, holder: str) -> int:
        """Drop one reference; returns the remaining refcount. Double free and stale or
        foreign refs raise FenceViolation and change nothing."""
        self.check(ref, tenant, holder, not_held="double free")
        s = self._pages[ref.page_id]
        s.holders.remove(holder)
        if not s.holders:
            assert s.owner is not None
            self._tenants[s.owner].referenced -= 1
        return s.refcount

    def reclaim(self, page_id: int) -> None:
        """Return an unreferenced page to the back of the free list (free or eviction)."""
        s = self._pages[page_id]
        if s.refcount != 0 or s.owner is None:
            raise self._violation(page_id, "reclaim of a referenced or free page")
        self._tenants[s.owner].owned -= 1
        s.owner = None
        s.read_only = False
        s.generation += 1  # free / eviction
        self._free[page_id] = None

    def bump_generation(self, page_id: int) -> None:
        """Fault-injection hook for fence tests: the page moves to its next life under
        whoever holds it, as a buggy recycle would. Never called by kvcache itself."""
        self._pages[page_id].generation += 1
