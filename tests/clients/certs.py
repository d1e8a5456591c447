"""A throwaway CA, server and client certificates for the TLS tests (made with cryptography)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_pem: bytes
    server_cert_pem: bytes
    server_key_pem: bytes
    client_cert_pem: bytes
    client_key_pem: bytes
    ca_file: Path
    client_cert_file: Path
    client_key_file: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    is_ca: bool = False,
    san: x509.SubjectAlternativeName | None = None,
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("kvfence-test-ca")
    ca = _issue("kvfence-test-ca", ca_key, ca_name, ca_key, is_ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue(
        "localhost",
        server_key,
        ca_name,
        ca_key,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        san=x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        ),
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _issue("tenant-a", client_key, ca_name, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    pem = serialization.Encoding.PEM
    pki = Pki(
        ca.public_bytes(pem),
        server.public_bytes(pem),
        _key_pem(server_key),
        client.public_bytes(pem),
        _key_pem(client_key),
        directory / "ca.pem",
        directory / "client.pem",
        directory / "client.key",
    )
    pki.ca_file.write_bytes(pki.ca_pem)
    pki.client_cert_file.write_bytes(pki.client_cert_pem)
    pki.client_key_file.write_bytes(pki.client_key_pem)
    return pki
