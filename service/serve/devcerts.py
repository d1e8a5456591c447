"""``kvfence certs dev``: a development CA, a server certificate and a tenant's client certificate.

For trying TLS and mTLS on one machine, not for production. Keys are ECDSA P-256, written
0600. The server certificate names ``localhost``, ``127.0.0.1`` and ``::1`` (plus ``--host``);
the client certificate carries the URI SAN ``spiffe://kvfence/tenant/<tenant>``, which the
server maps to a tenant through ``mtls_identities`` as ``uri:spiffe://kvfence/tenant/<tenant>``
(``--tenants`` adds it there).
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from service.admission.tenants import TenantsFileError, load_tenants

IDENTITY_PREFIX = "spiffe://kvfence/tenant/"


@dataclass(frozen=True, slots=True)
class DevCerts:
    """Where ``write_dev_certs`` put each file."""

    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    identity: str


def _san(host: str) -> object:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def write_dev_certs(directory: Path, tenant: str, hosts: tuple[str, ...] = (),
                    days: int = 30) -> DevCerts:
    """Write ca.pem, server.pem/.key and <tenant>.pem/.key under ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer_key: ec.EllipticCurvePrivateKey,
              extensions: list[tuple[x509.ExtensionType, bool]]) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(name(subject))
                   .issuer_name(name("kvfence dev CA")).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=days)))
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(issuer_key, hashes.SHA256())

    def leaf(usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
             ) -> list[tuple[x509.ExtensionType, bool]]:
        return [(x509.BasicConstraints(ca=False, path_length=None), True),
                (x509.ExtendedKeyUsage([usage]), False),
                (x509.SubjectAlternativeName(sans), False)]

    directory.mkdir(parents=True, exist_ok=True)
    identity = IDENTITY_PREFIX + tenant
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("kvfence dev CA", ca_key, ca_key, [
        (x509.BasicConstraints(ca=True, path_length=0), True),
        (x509.KeyUsage(digital_signature=False, content_commitment=False,
                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                       key_cert_sign=True, crl_sign=True, encipher_only=False,
                       decipher_only=False), True)])
    server_key = ec.generate_private_key(ec.SECP256R1())
    names = list(dict.fromkeys(("localhost", "127.0.0.1", "::1", *hosts)))
    server = issue(names[0], server_key, ca_key, leaf(
        ExtendedKeyUsageOID.SERVER_AUTH, [_san(h) for h in names]))  # type: ignore[misc]
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = issue(tenant, client_key, ca_key, leaf(
        ExtendedKeyUsageOID.CLIENT_AUTH, [x509.UniformResourceIdentifier(identity)]))

    out = DevCerts(ca=directory / "ca.pem", ca_key=directory / "ca.key",
                   server_cert=directory / "server.pem", server_key=directory / "server.key",
                   client_cert=directory / f"{tenant}.pem",
                   client_key=directory / f"{tenant}.key", identity=identity)
    pem = serialization.Encoding.PEM
    for path, cert in ((out.ca, ca), (out.server_cert, server), (out.client_cert, client)):
        path.write_bytes(cert.public_bytes(pem))
    for path, key in ((out.ca_key, ca_key), (out.server_key, server_key),
                      (out.client_key, client_key)):
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return out


def add_identity(tenants: Path, tenant: str, identity: str) -> None:
    """Map ``identity`` to ``tenant`` in the tenants file (the tenant must exist there)."""
    text = tenants.read_text(encoding="utf-8") if tenants.exists() else ""
    registry = load_tenants(tenants)
    if tenant not in registry.tenants:
        raise TenantsFileError(
            f"{tenants}: no tenant {tenant!r}; run `kvfence tenants add {tenant} --file {tenants}`")
    if identity in registry.tenants[tenant].mtls_identities:
        return
    header = re.compile(rf'^\[tenants\.(?:"{re.escape(tenant)}"|{re.escape(tenant)})\]\s*$',
                        re.MULTILINE)
    match = header.search(text)
    section_end = text.find("\n[", match.end()) if match else -1
    section = text[match.end():section_end if section_end >= 0 else len(text)] if match else ""
    if match is None or "mtls_identities" in section:
        raise TenantsFileError(
            f"{tenants}: add {identity!r} to the mtls_identities of [tenants.{tenant}] by hand")
    line = f'\nmtls_identities = ["{identity}"]'
    tenants.write_text(text[:match.end()] + line + text[match.end():], encoding="utf-8")
    try:
        load_tenants(tenants)
    except TenantsFileError:
        tenants.write_text(text, encoding="utf-8")
        raise
