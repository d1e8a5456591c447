"""Who is calling: API key or mTLS client identity -> ``Tenant``.

``AuthInterceptor`` (``service.grpc.interceptor``) asks the ``Authenticator`` on every RPC but
health and hands the tenant to kvfence's own handlers as an explicit third argument,
``handler(request, context, tenant)`` (see ``service/grpc/wire.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from service.admission.tenants import Tenant, TenantRegistry
from service.errors import unauthenticated

# gRPC's auth-context property for each SAN type the tenants file can name. The untyped
# ``x509_subject_alternative_name`` list is deliberately not read: it would let a DNS SAN
# match an identity written for a URI (or an email) of the same spelling.
_SAN_KEYS = (("uri", "peer_uri"), ("dns", "peer_dns"), ("email", "peer_email"))

class Authenticator:
    """Maps credentials to tenants. ``replace`` swaps in a reloaded tenants file atomically."""

    def __init__(self, registry: TenantRegistry) -> None:
        self._registry = registry

    @property
    def registry(self) -> TenantRegistry:
        return self._registry

    def replace(self, registry: TenantRegistry) -> None:
        self._registry = registry

    def authenticate(
        self,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        auth_context: Mapping[str, Iterable[bytes]],
    ) -> Tenant:
        """Resolve the caller. Raises ``ServiceError(UNAUTHENTICATED)``; never logs the key."""
        registry = self._registry  # one snapshot for the whole decision
        by_key = _by_header(registry, metadata)
        identities = _client_identities(auth_context)
        mapped = registry.by_identity(identities) if identities else ()
        if len(mapped) > 1:
            raise unauthenticated(
                "client certificate maps to more than one tenant", "AMBIGUOUS_CERT"
            )
        by_cert = mapped[0] if mapped else None
        if by_key is not None:
            if identities and (by_cert is None or by_cert.name != by_key.name):
                raise unauthenticated("API key and client certificate disagree", "MISMATCH")
            return by_key
        if by_cert is not None:
            return by_cert
        if identities:
            raise unauthenticated("client certificate is not mapped to a tenant", "UNKNOWN_CERT")
        raise unauthenticated(_MISSING)

    def precheck(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, client_certs: bool
    ) -> None:
        """What can be decided from the headers alone, before the request body is parsed.

        A bad or unknown API key is refused here; so is a call with no key where the server
        takes no client certificates. Raises ``ServiceError(UNAUTHENTICATED)``. A call that
        passes still goes through ``authenticate`` (the certificate check needs the TLS
        context, which gRPC gives only to the handler).
        """
        if _by_header(self._registry, metadata) is None and not client_certs:
            raise unauthenticated(_MISSING)


_MISSING = "missing credentials: send 'authorization: Bearer <api key>'"


def _by_header(
    registry: TenantRegistry, metadata: Iterable[tuple[str, str | bytes]] | None
) -> Tenant | None:
    """The tenant of the ``authorization`` header; None when there is no header."""
    headers = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
    if len(headers) > 1:
        raise unauthenticated("duplicate authorization headers", "DUPLICATE_CREDENTIALS")
    if not headers:
        return None
    value = headers[0]
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, key = value.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthenticated("authorization must be 'Bearer <api key>'", "MALFORMED")
    tenant = registry.by_key(key.strip())
    if tenant is None:
        raise unauthenticated("invalid API key", "INVALID_KEY")
    return tenant


def _client_identities(auth_context: Mapping[str, Iterable[bytes]]) -> tuple[str, ...]:
    """The certificate's SANs as ``type:value`` strings, the form the tenants file uses."""
    found: list[str] = []
    for kind, key in _SAN_KEYS:
        for raw in auth_context.get(key, ()):
            ident = f"{kind}:{raw.decode('utf-8', 'replace')}"
            if ident not in found:
                found.append(ident)
    return tuple(found)
