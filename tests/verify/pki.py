"""Throwaway certificate authorities and certificates for the TLS and mTLS cases."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True, slots=True)
class Authority:
    name: str
    cert_pem: bytes
    _key: ec.EllipticCurvePrivateKey

    def issue(self, subject: str, *, server: bool = False, uri: str | None = None) -> KeyPair:
        """A leaf for ``subject``: a server cert (localhost, 127.0.0.1) or a client cert
        whose identity is the URI SAN ``uri``."""
        key = ec.generate_private_key(ec.SECP256R1())
        if server:
            san = x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            )
            usage = ExtendedKeyUsageOID.SERVER_AUTH
        else:
            san = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri or subject)])
            usage = ExtendedKeyUsageOID.CLIENT_AUTH
        ca_cert = x509.load_pem_x509_certificate(self.cert_pem)
        cert = (
            _builder(subject, key, ca_cert.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(san, critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _pem(key))


def make_authority(name: str) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(name, key, subject)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Authority(name, cert.public_bytes(serialization.Encoding.PEM), key)


def write_pair(directory: Path, stem: str, pair: KeyPair) -> tuple[Path, Path]:
    cert, key = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert.write_bytes(pair.cert_pem)
    key.write_bytes(pair.key_pem)
    return cert, key


def _builder(
    cn: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
