"""Sealing KV tier records: per-tenant AES-GCM keys, bound associated data, keyed file names.

Each tenant's key is ``HKDF-SHA256(secret, salt="kvfence-kv-tier-v1", info=frame("tenant",
tenant))``; the associated data of a record is ``frame("kvfence-kv-tier-v1", tenant,
adapter, salt, shared, prefix key, record number)``. A record opens only under the tenant,
namespace, prefix key and record number it was sealed for: a file moved to another tenant's
or another prefix's name, an older copy put back in place of a newer one, or any flipped
byte fails authentication. File names are an HMAC (a key HKDF derives from the secret for
names alone) over the same fields, so they reveal neither tenants nor prefixes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvcache.prefix_cache import Namespace, encode_tokens, frame

MAGIC = b"KVT1"
NONCE_BYTES = 12
SUFFIX = ".kvt"
_LABEL = b"kvfence-kv-tier-v1"
_NUMBERS = struct.Struct(">qqqd")  # parent serial, serial, generation, expires_at


@dataclass(frozen=True, slots=True)
class TierRecord:
    """What the tier keeps of one cached page besides its K/V bytes: where it sits in its
    tenant's prefix chain, its owner's namespace, the page's generation when it left the
    pool, and its TTL deadline (the manager's clock)."""

    namespace: Namespace
    key: bytes
    parent_key: bytes
    parent_serial: int
    serial: int
    token_ids: tuple[int, ...]
    generation: int
    expires_at: float


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_LABEL, info=info).derive(secret)


def tenant_key(secret: bytes, tenant: str) -> bytes:
    """The AES-256-GCM key of ``tenant``'s records."""
    return _hkdf(secret, frame(b"tenant", tenant.encode()))


def _ns_fields(ns: Namespace, key: bytes) -> tuple[bytes, ...]:
    return (ns.tenant.encode(), ns.adapter.encode(), ns.salt.encode(), ns.shared.encode(), key)


def associated_data(ns: Namespace, key: bytes, number: int) -> bytes:
    """What a record's authentication binds besides its contents."""
    return frame(_LABEL, *_ns_fields(ns, key), number.to_bytes(8, "big"))


def unframe(data: bytes, count: int) -> list[bytes] | None:
    """The ``count`` fields :func:`frame` joined, or None unless ``data`` is exactly that."""
    fields: list[bytes] = []
    at = 0
    for _ in range(count):
        if at + 8 > len(data):
            return None
        n = int.from_bytes(data[at : at + 8], "big")
        at += 8
        if n > len(data) - at:
            return None
        fields.append(data[at : at + n])
        at += n
    return fields if at == len(data) else None


class TierSeal:
    """Keys, file names and the sealed form of records (no files, no state but keys)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the KV tier secret must be at least 16 bytes")
        self._secret = secret
        self._name_key = _hkdf(secret, frame(b"names"))
        self._ciphers: dict[str, AESGCM] = {}

    def _cipher(self, tenant: str) -> AESGCM:
        cipher = self._ciphers.get(tenant)
        if cipher is None:
            cipher = self._ciphers[tenant] = AESGCM(tenant_key(self._secret, tenant))
        return cipher

    def file_name(self, ns: Namespace, key: bytes) -> str:
        digest = hmac.new(self._name_key, frame(*_ns_fields(ns, key)), hashlib.sha256)
        return digest.hexdigest() + SUFFIX

    def seal(self, record: TierRecord, number: int, data: bytes) -> bytes:
        """The file contents for ``record`` (record number ``number``) and its K/V bytes."""
        numbers = _NUMBERS.pack(
            record.parent_serial, record.serial, record.generation, record.expires_at
        )
        plain = frame(record.parent_key, encode_tokens(record.token_ids), numbers, data)
        nonce = os.urandom(NONCE_BYTES)
        aad = associated_data(record.namespace, record.key, number)
        return MAGIC + nonce + self._cipher(record.namespace.tenant).encrypt(nonce, plain, aad)

    def open(
        self, ns: Namespace, key: bytes, number: int, blob: bytes
    ) -> tuple[TierRecord, bytes] | None:
        """The record and K/V bytes sealed for exactly (``ns``, ``key``, ``number``), or
        None when ``blob`` is anything else (altered, moved, replayed, truncated)."""
        head = len(MAGIC) + NONCE_BYTES
        if len(blob) < head or not blob.startswith(MAGIC):
            return None
        nonce = blob[len(MAGIC) : head]
        try:
            plain = self._cipher(ns.tenant).decrypt(nonce, blob[head:], associated_data(ns, key, number))
        except InvalidTag:
            return None
        fields = unframe(plain, 4)
        if fields is None or len(fields[1]) % 8 or len(fields[2]) != _NUMBERS.size:
            return None
        parent_key, tokens, numbers, data = fields
        parent_serial, serial, generation, expires_at = _NUMBERS.unpack(numbers)
        token_ids = tuple(
            int.from_bytes(tokens[i : i + 8], "little", signed=True)
            for i in range(0, len(tokens), 8)
        )
        record = TierRecord(
            ns, key, parent_key, parent_serial, serial, token_ids, generation, expires_at
        )
        return record, data
