"""Per-tenant prefix cache over full pages, keyed by a chained, length-framed HMAC.

A namespace is (tenant, adapter, salt, shared): the tenant from the credential, the adapter
the request runs with ("" = the base model), the caller's cache salt ("" = none) and the
shared prefix its chain starts from ("" = none; a publication's chain id, see
``shared_prefix``). Keys: ``ns_key = HMAC-SHA256(secret, frame("kvfence-prefix-v2", tenant,
adapter, salt[, shared]))`` and, page by page, ``key_i = HMAC-SHA256(ns_key, frame(key_{i-1},
tokens_i))``. A chain after a shared prefix runs over the shared pages' tokens first (the
tenant stores no entry for those pages; the publication gives each one a serial), so the
tenant's own pages after it hang off a per-tenant chain that names the prefix's text. Every field is
length-framed, so no two different field tuples serialise to the same bytes. Each tenant
has its own key space (a dict per tenant) and each namespace its own HMAC key, so a tenant
can neither look up nor compute another tenant's keys, and a salt only ever selects keys
inside its own tenant's space.

A key hit is never trusted alone: the stored page's namespace and token ids must equal the
request's and its parent must be the exact entry matched one page earlier (entry serials are
never reused), so even a forced hash collision cannot splice a foreign prefix in. ``key_fn``
lets tests swap in a deliberately weak hash to prove that.
"""

from __future__ import annotations

import hashlib
import hmac
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

KeyFn = Callable[[bytes, bytes, Sequence[int]], bytes]
"""(tenant_key, parent_key, page token ids) -> page key."""

ROOT_KEY = b""
ROOT_SERIAL = 0
# Namespace keys held at once. NOTE: salts are caller-chosen and unbounded in number, so the
# memo is cleared when full rather than growing with every salt ever seen.
MAX_NAMESPACE_KEYS = 4096


@dataclass(frozen=True, slots=True)
class Namespace:
    """Whose cached pages a sequence may match and fill."""

    tenant: str
    adapter: str = ""  # "" = the base model
    salt: str = ""  # "" = the tenant's default namespace
    shared: str = ""  # "" = a chain from the root; else the shared prefix's chain id


def frame(*fields: bytes) -> bytes:
    """Length-prefix every field (8-byte big-endian) and concatenate."""
    return b"".join(len(f).to_bytes(8, "big") + f for f in fields)


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64."""
    return array("q", token_ids).tobytes()


def derive_namespace_key(secret: bytes, ns: Namespace) -> bytes:
    fields: tuple[bytes, ...] = (
        b"kvfence-prefix-v2", ns.tenant.encode(), ns.adapter.encode(), ns.salt.encode()
    )
    if ns.shared:
        fields += (ns.shared.encode(),)
    return hmac.new(secret, frame(*fields), hashlib.sha256).digest()


def chain_key(tenant_key: bytes, parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """The default :data:`KeyFn`: HMAC-SHA256 over the framed (parent, tokens)."""
    return hmac.new(
        tenant_key, frame(parent_key, encode_tokens(token_ids)), hashlib.sha256
    ).digest()


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One cached full page. ``serial`` is unique for the cache's lifetime (an entry that
    comes back from the KV tier keeps its own)."""

    namespace: Namespace
    key: bytes
    page_id: int
    token_ids: tuple[int, ...]
    parent_serial: int
    serial: int
    parent_key: bytes = ROOT_KEY


@dataclass(frozen=True, slots=True)
class ChainPos:
    """Where a sequence is in its chain: the last matched or inserted entry."""

    key: bytes = ROOT_KEY
    serial: int = ROOT_SERIAL


class PrefixCache:
    """Maps (tenant, chained key) to a cached page; the key chain starts from the namespace's
    key. Holds no refcounts and no KV."""

    def __init__(self, secret: bytes, key_fn: KeyFn = chain_key) -> None:
        self._secret = secret
        self._key_fn = key_fn
        self._ns_keys: dict[Namespace, bytes] = {}
        self._spaces: dict[str, dict[bytes, CacheEntry]] = {}
        self._by_page: dict[int, tuple[str, CacheEntry]] = {}
        self._next_serial = ROOT_SERIAL + 1
        self.collisions = 0  # key hits rejected by the token / parent comparison

    def key(self, ns: Namespace, parent_key: bytes, token_ids: Sequence[int]) -> bytes:
        nkey = self._ns_keys.get(ns)
        if nkey is None:
            if len(self._ns_keys) >= MAX_NAMESPACE_KEYS:
                self._ns_keys.clear()
            nkey = self._ns_keys[ns] = derive_namespace_key(self._secret, ns)
        return self._key_fn(nkey, parent_key, token_ids)

    def _verified(
        self, entry: CacheEntry, ns: Namespace, pos: ChainPos, token_ids: Sequence[int]
    ) -> bool:
        same_namespace = entry.namespace == ns
        if entry.parent_serial == pos.serial and same_namespace and entry.token_ids == tuple(token_ids):
            return True
        self.collisions += 1
        return False

    def lookup(self, ns: Namespace, pos: ChainPos, token_ids: Sequence[int]) -> CacheEntry | None:
        """The namespace's entry for the page after ``pos`` holding ``token_ids``, if any."""
        space = self._spaces.get(ns.tenant)
        if not space:
            return None
        entry = space.get(self.key(ns, pos.key, token_ids))
        if entry is None or not self._verified(entry, ns, pos, token_ids):
            return None
        return entry

    def new_serials(self, n: int) -> tuple[int, ...]:
        """``n`` serials no entry has or will have (a shared prefix's pages' chain serials)."""
        first = self._next_serial
        self._next_serial += n
        return tuple(range(first, first + n))

    def insert(
        self,
        ns: Namespace,
        pos: ChainPos,
        token_ids: Sequence[int],
        page_id: int,
        serial: int | None = None,
    ) -> CacheEntry | None:
        """Cache ``page_id`` after ``pos`` under ``serial``: the entry's own serial when it
        comes back from the KV tier (issued by this cache and held by no live entry), or
        None for a new one. If the key is taken, returns the existing entry when it holds
        the same prefix, and None (nothing inserted) on a collision."""
        key = self.key(ns, pos.key, token_ids)
        space = self._spaces.setdefault(ns.tenant, {})
        existing = space.get(key)
        if existing is not None:
            return existing if self._verified(existing, ns, pos, token_ids) else None
        if serial is None or not ROOT_SERIAL < serial < self._next_serial:
            serial = self._next_serial
            self._next_serial += 1
        entry = CacheEntry(ns, key, page_id, tuple(token_ids), pos.serial, serial, pos.key)
        space[key] = entry
        self._by_page[page_id] = (ns.tenant, entry)
        return entry

    def entry_for_page(self, page_id: int) -> tuple[str, CacheEntry] | None:
        return self._by_page.get(page_id)

    def remove_page(self, page_id: int) -> None:
        tenant, entry = self._by_page.pop(page_id)
        space = self._spaces[tenant]
        del space[entry.key]
        if not space:
            del self._spaces[tenant]

    def pages_of(self, tenant: str) -> list[int]:
        return [e.page_id for e in self._spaces.get(tenant, {}).values()]

    def pages_after_shared(self, chain: str) -> list[int]:
        """Every tenant's cached pages whose chain starts from the shared prefix ``chain``."""
        return [p for p, (_, e) in self._by_page.items() if e.namespace.shared == chain]

    def num_entries(self, tenant: str) -> int:
        return len(self._spaces.get(tenant, {}))

    def tenants(self) -> list[str]:
        return list(self._spaces)

    def entries(self, tenant: str) -> Mapping[bytes, CacheEntry]:
        """A read-only view of ``tenant``'s key space (key -> entry)."""
        return MappingProxyType(self._spaces.get(tenant, {}))

    def inject_entry(self, tenant: str, key: bytes, entry: CacheEntry) -> None:
        """Test hook (fence tests): store ``entry`` under ``key`` in ``tenant``'s key space,
        past every check :meth:`insert` makes, as a corrupted cache would; the owner check
        when a match shares the page must still refuse a foreign one."""
        self._spaces.setdefault(tenant, {})[key] = entry
