"""KVTier: a lower tier for tenants' cached prefix pages (an index in host memory, the
pages in files on disk), off unless the manager is given one.

When memory pressure evicts a cached page (LRU in the pool, or its tenant's own quota; not
a TTL expiry, a purge or a withdrawn shared prefix), the manager hands the page's K/V bytes
and its :class:`~kvcache.tier_seal.TierRecord` (prefix key, parent, token ids, namespace,
generation, TTL deadline) to :meth:`KVTier.put`. A later ``open`` that misses in the pool
asks :meth:`KVTier.take` for the next page of its chain; the page comes back into the
tenant's own share and passes the fence like any page. A page lives in one tier at a time:
taking it deletes its file.

At rest every record is sealed per tenant (``tier_seal``). A record that fails any check
(authentication, size, owner, its token ids or parent against the request's) is a miss,
counted in ``rejected``, and its file is deleted: the tier answers a miss, never wrong KV.

Budgets: ``budget_bytes`` for the whole tier, and the ``limit`` of each ``put`` (the
tenant's ``TenantCachePolicy.tier_bytes``; None: the whole budget). Eviction is per tenant:
a put evicts its own tenant's least recently stored records until the tenant is within its
limit and the tier within its budget; when the tenant's own records are not enough, the put
is dropped. Another tenant's records are never evicted for it, so, as long as the tenants'
limits add up to no more than the budget, one tenant's load cannot push another's pages
out of the tier.

Files: the directory must be a real directory owned by this user and not group- or
world-writable (it is created 0700 if missing, and narrowed to 0700); records are written
0600. Restart: the tier does not restore a previous process's records. At start it deletes
every tier file (``*.kvt``, ``*.kvt.part``) the directory holds, since TTL deadlines are
readings of a clock that does not survive the process and the prefix cache's keys may not
either; the index is built only from this process's puts.

Writes and reads run on the caller's thread (the engine loop): a put is one page, sealed and
written when the pool needs the page.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcache.errors import KVCacheError
from kvcache.prefix_cache import Namespace
from kvcache.tier_seal import SUFFIX, TierRecord, TierSeal

PART = ".part"


class TierDirectoryRefused(KVCacheError, ValueError):
    """The tier directory is not one only this user can write."""


@dataclass(frozen=True, slots=True)
class _Slot:
    file: str
    nbytes: int
    number: int  # record number, bound into the sealed file
    expires_at: float


_Where = tuple[Namespace, bytes]  # (namespace, prefix key)


def _secure_directory(path: Path) -> Path:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise TierDirectoryRefused(f"KV tier directory {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise TierDirectoryRefused(f"KV tier directory {path} is owned by another user")
    if st.st_mode & 0o022:
        raise TierDirectoryRefused(f"KV tier directory {path} is group- or world-writable")
    os.chmod(path, 0o700)
    return path


class KVTier:
    """Sealed page records per tenant, LRU per tenant, within a byte budget."""

    def __init__(self, directory: str | Path, budget_bytes: int, secret: bytes) -> None:
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
        self.directory = _secure_directory(Path(directory))
        self.budget_bytes = budget_bytes
        self._seal = TierSeal(secret)
        self._slots: dict[str, OrderedDict[_Where, _Slot]] = {}  # tenant -> LRU of records
        self._bytes: dict[str, int] = {}
        self._deadlines: list[tuple[float, int, str, Namespace, bytes]] = []
        self._next_number = 1
        self.total_bytes = 0
        self.rejected = 0  # records refused on the way back (a miss each)
        self.dropped = 0  # puts not kept (over a limit, or the write failed)
        self.expired = 0
        self._wipe()

    def _wipe(self) -> None:
        with os.scandir(self.directory) as entries:
            for entry in entries:
                ours = entry.name.endswith((SUFFIX, SUFFIX + PART))
                if ours and not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.path)

    # -- queries -------------------------------------------------------------------------
    def holds(self, ns: Namespace, key: bytes) -> bool:
        slots = self._slots.get(ns.tenant)
        return slots is not None and (ns, key) in slots

    def tenant_bytes(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def tenant_entries(self, tenant: str) -> int:
        slots = self._slots.get(tenant)
        return 0 if slots is None else len(slots)

    def bytes_by_tenant(self) -> Mapping[str, int]:
        return dict(self._bytes)

    def tenants(self) -> list[str]:
        return list(self._slots)

    def path_of(self, ns: Namespace, key: bytes) -> Path | None:
        """The record's file (tests and operators' checks), or None."""
        slots = self._slots.get(ns.tenant)
        slot = None if slots is None else slots.get((ns, key))
        return None if slot is None else self.directory / slot.file

    # -- transitions ---------------------------------------------------------------------
    def put(self, record: TierRecord, data: bytes, limit: int | None) -> bool:
        """Keep one evicted page; returns whether it was kept (see the module's budgets)."""
        ns, tenant = record.namespace, record.namespace.tenant
        if self.holds(ns, record.key):
            self._drop(tenant, (ns, record.key))
        number = self._next_number
        self._next_number += 1
        blob = self._seal.seal(record, number, data)
        size = len(blob)
        cap = self.budget_bytes if limit is None else min(limit, self.budget_bytes)
        if size > cap:
            self.dropped += 1
            return False
        slots = self._slots.get(tenant)
        while self.tenant_bytes(tenant) + size > cap or self.total_bytes + size > self.budget_bytes:
            if not slots:
                self.dropped += 1
                return False
            self._drop(tenant, next(iter(slots)))
        slot = _Slot(self._seal.file_name(ns, record.key), size, number, record.expires_at)
        try:
            self._write(slot.file, blob)
        except OSError:
            self.dropped += 1
            return False
        self._slots.setdefault(tenant, OrderedDict())[(ns, record.key)] = slot
        self._bytes[tenant] = self.tenant_bytes(tenant) + size
        self.total_bytes += size
        heapq.heappush(self._deadlines, (record.expires_at, number, tenant, ns, record.key))
        entries = sum(len(s) for s in self._slots.values())
        if len(self._deadlines) > 4 * entries + 64:
            # NOTE: taken records leave their deadlines behind; compact so they cannot pile up.
            self._deadlines = [
                (s.expires_at, s.number, t, w[0], w[1])
                for t, slots in self._slots.items()
                for w, s in slots.items()
            ]
            heapq.heapify(self._deadlines)
        return True

    def take(
        self,
        ns: Namespace,
        key: bytes,
        parent_key: bytes,
        token_ids: Sequence[int],
        nbytes: int,
    ) -> tuple[TierRecord, bytes] | None:
        """The record for (``ns``, ``key``) and its K/V bytes, if it opens under exactly
        that tenant, namespace and key, follows ``parent_key``, holds ``token_ids`` and
        ``nbytes`` of K/V. The record leaves the tier whatever the answer."""
        slots = self._slots.get(ns.tenant)
        slot = None if slots is None else slots.get((ns, key))
        if slot is None:
            return None
        blob = self._read(slot)
        self._drop(ns.tenant, (ns, key))
        opened = None if blob is None else self._seal.open(ns, key, slot.number, blob)
        if opened is None or not (
            opened[0].parent_key == parent_key
            and opened[0].token_ids == tuple(token_ids)
            and len(opened[1]) == nbytes
        ):
            self.rejected += 1
            return None
        return opened

    def expire(self, now: float) -> int:
        """Delete every record whose TTL deadline is at or before ``now``."""
        count = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, number, tenant, ns, key = heapq.heappop(self._deadlines)
            slots = self._slots.get(tenant)
            slot = None if slots is None else slots.get((ns, key))
            if slot is not None and slot.number == number:
                self._drop(tenant, (ns, key))
                count += 1
        self.expired += count
        return count

    def purge(self, tenant: str) -> int:
        """Delete every record of ``tenant``; returns how many."""
        return self._drop_where(tenant, lambda ns: True)

    def drop_shared(self, chain: str) -> int:
        """Delete every tenant's records whose chain starts from the shared prefix ``chain``."""
        return sum(self._drop_where(t, lambda ns: ns.shared == chain) for t in self.tenants())

    def _drop_where(self, tenant: str, which: Callable[[Namespace], bool]) -> int:
        where = [w for w in self._slots.get(tenant, {}) if which(w[0])]
        for w in where:
            self._drop(tenant, w)
        return len(where)

    def _drop(self, tenant: str, where: _Where) -> None:
        slots = self._slots[tenant]
        slot = slots.pop(where)
        if not slots:
            del self._slots[tenant]
        self._bytes[tenant] -= slot.nbytes
        if not self._bytes[tenant]:
            del self._bytes[tenant]
        self.total_bytes -= slot.nbytes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.directory / slot.file)
        if not self._slots:
            self._deadlines.clear()

    # -- files ---------------------------------------------------------------------------
    def _write(self, name: str, blob: bytes) -> None:
        part = self.directory / (name + PART)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(part, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(part, self.directory / name)

    def _read(self, slot: _Slot) -> bytes | None:
        """The file's bytes if it is still a regular file of this user, 0600, of the size
        written; else None."""
        try:
            fd = os.open(self.directory / slot.file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != os.geteuid()
                or st.st_mode & 0o077
                or st.st_size != slot.nbytes
            ):
                return None
            chunks = []
            left = slot.nbytes
            while left:
                chunk = os.read(fd, left)
                if not chunk:
                    return None
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
