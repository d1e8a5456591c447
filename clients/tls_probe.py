"""Why a connection failed, in one line: probe the server's TLS with the `ssl` module.

gRPC reports every handshake failure as `UNAVAILABLE: ... Socket closed` (or similar), which
does not say what to fix. After such a failure the CLI opens one plain TCP connection and runs
a TLS handshake with the same settings, and names the cause: nothing listening, the server
requires TLS, the server does not use TLS, the server's certificate is not trusted (unknown CA
or wrong name), or a client certificate is required or refused.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from clients.channel import TlsConfig

PROBE_TIMEOUT_S = 2.0
_MTLS_HINT = "pass --tls-cert and --tls-key"
_CERT_REQUIRED = "client certificate required: the server uses mTLS; " + _MTLS_HINT


def split_target(target: str) -> tuple[str, int] | None:
    """`host:port`, `[v6]:port`, `ipv4:host:port` or `dns:///host:port` -> (host, port)."""
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        target = target.removeprefix(prefix)
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def explain_unavailable(target: str, tls: TlsConfig | None) -> str | None:
    """One line naming the cause of an UNAVAILABLE on `target`, or None if no cause is found."""
    address = split_target(target)
    if address is None:
        return None
    try:
        sock = socket.create_connection(address, timeout=PROBE_TIMEOUT_S)
    except OSError as err:
        return (f"cannot connect to {target} ({err.strerror or err}); "
                "is `kvfence serve` running there?")
    with sock:
        if tls is None:
            return _plaintext_client(sock, address[0])
        return _tls_client(sock, address[0], tls)


def _context(tls: TlsConfig | None) -> ssl.SSLContext:
    if tls is None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        ca = None if tls.ca_file is None else str(tls.ca_file)
        context = ssl.create_default_context(cafile=ca)
        if tls.cert_file is not None and tls.key_file is not None:
            context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    context.set_alpn_protocols(["h2"])
    return context


def _plaintext_client(sock: socket.socket, host: str) -> str | None:
    """We spoke plaintext: does the server answer a TLS hello?"""
    try:
        with _context(None).wrap_socket(sock, server_hostname=host):
            pass
    except ssl.SSLError as err:
        if "ALERT" not in str(err).upper():
            return None  # not a TLS server: the failure has another cause
    except OSError:
        return None
    return "the server requires TLS: pass --tls-ca CA.pem (and for mTLS " + _MTLS_HINT + ")"


def _tls_client(sock: socket.socket, host: str, tls: TlsConfig) -> str | None:
    ca = f"--tls-ca {tls.ca_file}" if tls.ca_file is not None else "the system CAs"
    try:
        context = _context(tls)
    except (OSError, ssl.SSLError) as err:
        return f"cannot use the TLS files: {err}"
    name = tls.server_name or host
    try:
        with context.wrap_socket(sock, server_hostname=name) as tls_sock:
            return _after_handshake(tls_sock, tls)
    except ssl.SSLCertVerificationError as err:
        if "hostname" in str(err.verify_message).lower():
            return f"the server's certificate is not valid for {name!r} ({err.verify_message})"
        return (f"unknown CA: the server's certificate is not signed by {ca} "
                f"({err.verify_message})")
    except ssl.SSLError as err:
        return _alert(err, tls) or _not_tls(err)
    except OSError:
        return None


def _after_handshake(sock: ssl.SSLSocket, tls: TlsConfig) -> str | None:
    # NOTE: under TLS 1.3 the server checks the client certificate after the client has
    # finished its handshake, so a refusal arrives on the first read: as an alert, or (from
    # gRPC's BoringSSL) as the connection simply closing.
    sock.settimeout(PROBE_TIMEOUT_S / 2)
    try:
        data = sock.recv(1)
    except ssl.SSLError as err:
        return _alert(err, tls)
    except OSError:
        return None
    if data:
        return None
    if tls.cert_file is None:
        return _CERT_REQUIRED
    return _refused(tls)


def _alert(err: ssl.SSLError, tls: TlsConfig) -> str | None:
    text = str(err).upper()
    if "CERTIFICATE_REQUIRED" in text or (
            "HANDSHAKE_FAILURE" in text and tls.cert_file is None):
        return _CERT_REQUIRED
    if "UNKNOWN_CA" in text or "BAD_CERTIFICATE" in text or "CERTIFICATE_UNKNOWN" in text:
        return _refused(tls)
    return None


def _refused(tls: TlsConfig) -> str:
    cert = Path(str(tls.cert_file)).name
    return f"the server refused the client certificate {cert} (not signed by its client CA)"


def _not_tls(err: ssl.SSLError) -> str | None:
    text = str(err).upper()
    if "WRONG_VERSION_NUMBER" in text or "RECORD_LAYER" in text or "PACKET_LENGTH" in text:
        return "the server does not use TLS: drop --tls-ca, --tls-cert and --tls-key"
    return None
