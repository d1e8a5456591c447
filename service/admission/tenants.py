"""The tenants file: who may call the server, with which credential, under which quotas.

Format (TOML; every key except ``api_key_sha256``/``mtls_identities`` is optional)::

    [tenants.acme]
    api_key_sha256 = ["9f86d081884c7d65..."]   # hex sha256 of each valid API key
    mtls_identities = ["uri:spiffe://acme/worker"] # client-certificate SANs, typed (mTLS)
    weight = 2.0                               # weighted-fair-queueing share
    max_concurrent_streams = 8                 # running + queued Generate streams
    max_kv_pages = 4096                        # running + cached KV pages; 0 = a share of
                                               # the pool by weight (service/admission/kv_shares.py)
    max_prompt_tokens = 2048                   # 0 = the model's context length
    tokens_per_minute = 60000                  # prompt + max_tokens; 0 = unlimited
    prefix_cache_ttl_seconds = 600             # 0 = no prefix caching for this tenant
    models = ["SmolLM2-135M-Instruct"]         # models the tenant may use; absent = all
    allow_reflection = false                   # may call server reflection (--reflection)
    adapter_root = "/srv/adapters/acme"        # where the tenant may load adapters from at
                                               # run time (absent: it may not; docs/lora.md)

    shared_prefixes = ["support"]              # the operator's shared prefixes it reads

    [tenants.acme.adapters]                    # LoRA adapters only this tenant sees
    sql = "/srv/adapters/acme-sql"             # name = PEFT LoRA directory (docs/lora.md)

    [shared_prefixes]                          # the operator's prompt prefixes, name = text
    support = "You are the support assistant of Example Inc.\n"

    [shared_prefixes.helpdesk]                 # or a chat's first message: a system message
    system = "You are the help desk of Example Inc."

A shared prefix is operator data, never a tenant's: its full KV pages are computed once and
read by the tenants that list its name, on base-model requests without a cache salt whose
prompt tokens begin with its tokens (kvcache/shared_prefix.py). A text is tokenized as a
``text`` prompt is; a ``system`` table's text is rendered as a chat's lone system message
by the served model's chat template (service/serve/shared_prefixes.py). A table holding
anything but ``system``, or a tenant naming a prefix the file does not declare, is refused
by name.

Only hashes are stored; ``kvfence tenants add`` prints the plaintext key once. An API-key
hash may belong to one tenant only, and an mTLS identity names its SAN type (``uri:``,
``dns:`` or ``email:``) so a DNS name can never match a URI SAN of the same spelling. Counts
are checked against ``MAX_QUOTA`` (they travel as uint32 in ``GetUsage``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
KEY_PREFIX = "kvf_"
MAX_QUOTA = 2**32 - 1
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600.0
MAX_SHARED_PREFIX_CHARS = 64 * 1024  # one declared text; its tokens are prefilled at load
SAN_TYPES = ("uri", "dns", "email")
_KNOWN_KEYS = frozenset(
    {
        "api_key_sha256",
        "mtls_identities",
        "weight",
        "max_concurrent_streams",
        "max_kv_pages",
        "max_prompt_tokens",
        "tokens_per_minute",
        "prefix_cache_ttl_seconds",
        "models",
        "allow_reflection",
        "adapters",
        "adapter_root",
        "shared_prefixes",
    }
)


class TenantsFileError(Exception):
    """The tenants file is missing or malformed; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class Quotas:
    """Per-tenant limits. 0 means unlimited (``max_prompt_tokens``: the model's context;
    ``max_kv_pages``: the tenant's weight-proportional share of what the pool has left)."""

    max_concurrent_streams: int = 16
    max_kv_pages: int = 0
    max_prompt_tokens: int = 0
    tokens_per_minute: int = 0


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant. ``key_hashes`` are raw sha256 digests of its API keys."""

    name: str
    key_hashes: tuple[bytes, ...] = ()
    mtls_identities: tuple[str, ...] = ()
    weight: float = 1.0
    quotas: Quotas = Quotas()
    prefix_cache_ttl_seconds: float | None = None  # None = server default
    models: tuple[str, ...] | None = None  # None = every served model
    allow_reflection: bool = False
    adapters: tuple[tuple[str, str], ...] = ()  # (name, PEFT LoRA directory)
    adapter_root: str | None = None  # absolute directory run-time loads resolve in; None = none
    shared_prefixes: tuple[str, ...] = ()  # names in [shared_prefixes] the tenant reads

    def may_use_model(self, model: str) -> bool:
        return self.models is None or model in self.models


def hash_key(key: str) -> bytes:
    """The stored form of an API key: its raw sha256 digest."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class DeclaredPrefix:
    """One entry of ``[shared_prefixes]``: ``text`` as a ``text`` prompt's, or (``system``)
    the content of a chat's first message, a system message."""

    text: str
    system: bool = False


@dataclass(frozen=True, slots=True)
class TenantRegistry:
    """An immutable snapshot of the tenants file. Reloading builds a new one."""

    tenants: Mapping[str, Tenant]
    shared_prefixes: Mapping[str, DeclaredPrefix] = field(default_factory=dict)

    def by_key(self, key: str) -> Tenant | None:
        """The tenant owning ``key``; compares every stored digest in constant time."""
        digest = hash_key(key)
        found: Tenant | None = None
        # NOTE: no early exit, so the time taken does not depend on which tenant matched.
        for tenant in self.tenants.values():
            for stored in tenant.key_hashes:
                if hmac.compare_digest(stored, digest):
                    found = tenant
        return found

    def by_identity(self, identities: tuple[str, ...]) -> tuple[Tenant, ...]:
        """Every tenant one of the client certificate's typed SANs (``uri:...``) maps to.

        More than one means the certificate is ambiguous; the caller refuses it rather than
        picking one by file order.
        """
        return tuple(
            tenant
            for tenant in self.tenants.values()
            if any(ident in tenant.mtls_identities for ident in identities)
        )

    def names(self) -> tuple[str, ...]:
        return tuple(self.tenants)


def load_tenants(path: str | Path) -> TenantRegistry:
    """Parse and check the tenants file. Raises ``TenantsFileError``."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TenantsFileError(f"{path}: tenants file not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TenantsFileError(f"{path}: cannot read tenants file: {exc}") from None
    return parse_tenants(data, source=str(path))


def parse_tenants(data: Mapping[str, Any], source: str = "<tenants>") -> TenantRegistry:
    section = data.get("tenants", {})
    if not isinstance(section, dict):
        raise TenantsFileError(f"{source}: [tenants] must be a table")
    shared = _shared_prefixes(data.get("shared_prefixes", {}), source)
    tenants: dict[str, Tenant] = {}
    identities: dict[str, str] = {}
    key_owners: dict[bytes, str] = {}
    for name, raw in section.items():
        tenant = _parse_tenant(name, raw, source)
        for digest in tenant.key_hashes:
            owner = key_owners.setdefault(digest, name)
            if owner != name:
                raise TenantsFileError(
                    f"{source}: api_key_sha256 {digest.hex()[:12]}... is listed under both "
                    f"{owner!r} and {name!r}; a key must name one tenant"
                )
        for ident in tenant.mtls_identities:
            if ident in identities:
                raise TenantsFileError(
                    f"{source}: mTLS identity {ident!r} is mapped to both "
                    f"{identities[ident]!r} and {name!r}"
                )
            identities[ident] = name
        for prefix in tenant.shared_prefixes:
            if prefix not in shared:
                raise TenantsFileError(
                    f"{source}: tenant {name!r}: shared_prefixes names {prefix!r}, which "
                    "[shared_prefixes] does not declare"
                )
        tenants[name] = tenant
    return TenantRegistry(tenants=tenants, shared_prefixes=shared)


def _shared_prefixes(raw: object, source: str) -> dict[str, DeclaredPrefix]:
    """``[shared_prefixes]``: name -> a non-empty text (``name = "text"``) or a chat's system
    message (``[shared_prefixes.name]`` holding ``system = "text"`` alone), each text at most
    ``MAX_SHARED_PREFIX_CHARS``."""
    where = f"{source}: [shared_prefixes]"
    if not isinstance(raw, dict):
        raise TenantsFileError(f"{where} must be a table of name = \"text\"")
    declared: dict[str, DeclaredPrefix] = {}
    for name, value in raw.items():
        if not _NAME_RE.match(name):
            raise TenantsFileError(
                f"{where}: name {name!r} is invalid (letters, digits, '_', '.', '-')"
            )
        system = isinstance(value, dict)
        if system and set(value) != {"system"}:
            held = ", ".join(repr(k) for k in sorted(value)) or "nothing"
            raise TenantsFileError(
                f"{where}: {name!r} is neither form: name = \"text\", or a table holding "
                f"system = \"text\" alone (it holds {held})"
            )
        text = value["system"] if system else value
        if not isinstance(text, str) or not text or len(text) > MAX_SHARED_PREFIX_CHARS:
            what = f"{name!r}: system" if system else repr(name)
            raise TenantsFileError(
                f"{where}: {what} must be a text of 1 to {MAX_SHARED_PREFIX_CHARS} characters"
            )
        declared[name] = DeclaredPrefix(text, system)
    return declared


def _parse_tenant(name: str, raw: object, source: str) -> Tenant:
    where = f"{source}: tenant {name!r}"
    if not _NAME_RE.match(name) or name.startswith("__"):
        raise TenantsFileError(f"{where}: invalid name (letters, digits, '_', '.', '-')")
    if not isinstance(raw, dict):
        raise TenantsFileError(f"{where}: must be a table")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise TenantsFileError(f"{where}: unknown keys {unknown}")
    hashes = _str_list(raw, "api_key_sha256", where)
    for h in hashes:
        if not _HEX64_RE.match(h):
            raise TenantsFileError(f"{where}: api_key_sha256 entries must be 64 lowercase hex")
    idents = [_typed_identity(i, where) for i in _str_list(raw, "mtls_identities", where)]
    if not hashes and not idents:
        raise TenantsFileError(f"{where}: needs api_key_sha256 or mtls_identities")
    weight = raw.get("weight", 1.0)
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 < weight <= 1e6:
        raise TenantsFileError(f"{where}: weight must be a number in (0, 1e6]")
    ttl = raw.get("prefix_cache_ttl_seconds")
    if ttl is not None and (
        not isinstance(ttl, int | float) or isinstance(ttl, bool) or not 0 <= ttl <= MAX_TTL_SECONDS
    ):
        raise TenantsFileError(
            f"{where}: prefix_cache_ttl_seconds must be a number in [0, {MAX_TTL_SECONDS:g}]"
        )
    models = _str_list(raw, "models", where) if "models" in raw else None
    reflection = raw.get("allow_reflection", False)
    if not isinstance(reflection, bool):
        raise TenantsFileError(f"{where}: allow_reflection must be true or false")
    adapters = _adapters(raw.get("adapters", {}), where)
    shared = tuple(dict.fromkeys(_str_list(raw, "shared_prefixes", where)))
    root = raw.get("adapter_root")
    if root is not None and not (isinstance(root, str) and Path(root).is_absolute()):
        raise TenantsFileError(f"{where}: adapter_root must be an absolute directory path")
    quotas = Quotas(
        max_concurrent_streams=_int(raw, "max_concurrent_streams", 16, where, minimum=1),
        max_kv_pages=_int(raw, "max_kv_pages", 0, where),
        max_prompt_tokens=_int(raw, "max_prompt_tokens", 0, where),
        tokens_per_minute=_int(raw, "tokens_per_minute", 0, where),
    )
    return Tenant(
        name=name,
        key_hashes=tuple(bytes.fromhex(h) for h in hashes),
        mtls_identities=tuple(idents),
        weight=float(weight),
        quotas=quotas,
        prefix_cache_ttl_seconds=None if ttl is None else float(ttl),
        models=None if models is None else tuple(models),
        allow_reflection=reflection,
        adapters=adapters,
        adapter_root=root,
        shared_prefixes=shared,
    )


def valid_name(name: str) -> bool:
    """A tenant or adapter name: letters, digits, '_', '.', '-' (at most 64, a letter or
    digit first)."""
    return _NAME_RE.match(name) is not None


def _adapters(raw: object, where: str) -> tuple[tuple[str, str], ...]:
    """``[tenants.NAME.adapters]``: adapter name -> directory; names are model names."""
    if not isinstance(raw, dict) or not all(isinstance(v, str) and v for v in raw.values()):
        raise TenantsFileError(f"{where}: adapters must be a table of name = \"/directory\"")
    for name in raw:
        if not _NAME_RE.match(name):
            raise TenantsFileError(
                f"{where}: adapter name {name!r} is invalid (letters, digits, '_', '.', '-')"
            )
    return tuple(sorted(raw.items()))


def _str_list(raw: Mapping[str, Any], key: str, where: str) -> list[str]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TenantsFileError(f"{where}: {key} must be a list of strings")
    return value


def _int(raw: Mapping[str, Any], key: str, default: int, where: str, minimum: int = 0) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= MAX_QUOTA:
        raise TenantsFileError(f"{where}: {key} must be an integer in [{minimum}, {MAX_QUOTA}]")
    return value


def _typed_identity(entry: str, where: str) -> str:
    """``uri:spiffe://a/b`` -> itself, checked; the type is matched against the SAN's type."""
    kind, sep, value = entry.partition(":")
    if not sep or kind not in SAN_TYPES or not value:
        raise TenantsFileError(
            f"{where}: mtls_identities entry {entry!r} must name its SAN type: "
            '"uri:spiffe://...", "dns:host.example" or "email:user@example"'
        )
    return entry


def add_tenant(path: str | Path, name: str) -> str:
    """Append a new tenant with a fresh API key to ``path`` (created if absent).

    Returns the plaintext key; only its sha256 is written. Existing content and comments are
    kept. Raises ``TenantsFileError`` if the name is invalid or already present.
    """
    path = Path(path)
    if not _NAME_RE.match(name) or name.startswith("__"):
        raise TenantsFileError(f"invalid tenant name {name!r} (letters, digits, '_', '.', '-')")
    existing = ""
    if path.exists():
        existing = path.read_text(encoding="utf-8")
        if name in load_tenants(path).tenants:
            raise TenantsFileError(f"{path}: tenant {name!r} already exists")
    key = new_api_key()
    q = Quotas()
    block = (
        f'[tenants."{name}"]\n'
        f'api_key_sha256 = ["{hash_key(key).hex()}"]\n'
        "weight = 1.0\n"
        f"max_concurrent_streams = {q.max_concurrent_streams}\n"
        f"max_kv_pages = {q.max_kv_pages}  # 0 = a share of the KV pool by weight\n"
        f"max_prompt_tokens = {q.max_prompt_tokens}  # 0 = the model's context length\n"
        f"tokens_per_minute = {q.tokens_per_minute}  # 0 = unlimited\n"
    )
    sep = (
        ""
        if not existing or existing.endswith("\n\n")
        else ("\n" if existing.endswith("\n") else "\n\n")
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(existing + sep + block, encoding="utf-8")
    load_tenants(path)  # the file we wrote must parse
    return key
