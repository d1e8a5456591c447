"""TLS: the key as call credentials over a secure channel, and mTLS client certificates."""

from __future__ import annotations

import asyncio

import pytest

from clients import AsyncClient, Client, ClientError, TlsConfig, Unavailable
from clients.channel import ChannelConfig
from tests.clients.certs import Pki
from tests.clients.fakeserver import GOOD_KEY, FakeInference, ServerTls, serve


def test_key_travels_as_call_credentials_over_tls(pki: Pki) -> None:
    fake = FakeInference()
    tls = TlsConfig(ca_file=pki.ca_file)
    # On a secure channel nothing is added per call: only the call credentials carry the key.
    assert ChannelConfig("x:1", GOOD_KEY, tls).call_metadata() == ()
    with (
        serve(fake, ServerTls(pki.server_cert_pem, pki.server_key_pem)) as target,
        Client(target, api_key=GOOD_KEY, tls=tls) as client,
    ):
        assert client.generate_text("hi").text == "Hello, world"
    assert fake.seen.metadata[0]["authorization"] == f"Bearer {GOOD_KEY}"


def test_untrusted_server_certificate_is_refused(pki: Pki) -> None:
    fake = FakeInference()
    with (
        serve(fake, ServerTls(pki.server_cert_pem, pki.server_key_pem)) as target,
        Client(target, api_key=GOOD_KEY, tls=TlsConfig(), retries=0, timeout=5) as client,
        pytest.raises(Unavailable),
    ):
        client.purge()  # system roots do not trust the test CA
    assert fake.seen.requests == []


def test_mtls_presents_the_client_certificate(pki: Pki) -> None:
    fake = FakeInference()
    server_tls = ServerTls(pki.server_cert_pem, pki.server_key_pem, client_ca_pem=pki.ca_pem)
    tls = TlsConfig(pki.ca_file, pki.client_cert_file, pki.client_key_file)

    async def main(target: str) -> str:
        async with AsyncClient(target, api_key=GOOD_KEY, tls=tls) as client:
            return (await client.generate_text("hi")).text

    with serve(fake, server_tls) as target:
        with Client(target, api_key=GOOD_KEY, tls=tls) as client:
            assert client.purge() == 5
        assert asyncio.run(main(target)) == "Hello, world"
        with (
            Client(
                target, api_key=GOOD_KEY, tls=TlsConfig(pki.ca_file), retries=0, timeout=5
            ) as no_cert,
            pytest.raises(Unavailable),
        ):
            no_cert.purge()
    assert [b"tenant-a" in ids for ids in fake.seen.peer_identities] == [True, True]
    assert [md["authorization"] for md in fake.seen.metadata] == [f"Bearer {GOOD_KEY}"] * 2


def test_tls_configuration_errors_are_clear(pki: Pki) -> None:
    with pytest.raises(ClientError, match="both a client certificate and its key"):
        TlsConfig(pki.ca_file, cert_file=pki.client_cert_file)
    with pytest.raises(ClientError, match=r"cannot read CA certificate '/nonexistent/ca\.pem'"):
        Client("127.0.0.1:1", tls=TlsConfig("/nonexistent/ca.pem"))
    with pytest.raises(ClientError, match="cannot read client key"):
        AsyncClient(
            "127.0.0.1:1",
            tls=TlsConfig(pki.ca_file, pki.client_cert_file, "/nonexistent/client.key"),
        )
