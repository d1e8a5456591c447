"""TLS with API keys, and mTLS where the client certificate's SAN names the tenant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc
from service.serve.kvfence_server import ServerOptions, TlsFiles
from tests.serverutil import TenantSpec, running_server
from tests.service import certs
from tests.service.rpc import details, request

ACME_URI = "spiffe://kvfence.test/acme/worker"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("pki")
    ca, ca_key, ca_cert = certs.make_ca()
    (d / "ca.crt").write_bytes(ca.cert)
    server = certs.server_cert(ca_key, ca_cert)
    server_paths = certs.write(d, "server", server)
    _other_ca, other_key, other_cert = certs.make_ca("someone else's CA")
    return {
        "dir": d,
        "ca": ca.cert,
        "server": server_paths,
        "acme": certs.client_cert(ca_key, ca_cert, ACME_URI),
        "stranger": certs.client_cert(ca_key, ca_cert, "spiffe://kvfence.test/nobody"),
        "forged": certs.client_cert(other_key, other_cert, ACME_URI),
        # A DNS SAN spelled like acme's URI identity, and a cert naming two tenants.
        "dns_lookalike": certs.issue(ca_key, ca_cert, "lookalike", [x509.DNSName(ACME_URI)]),
        "two_tenants": certs.issue(
            ca_key,
            ca_cert,
            "both",
            [x509.UniformResourceIdentifier(ACME_URI), x509.DNSName("globex.kvfence.test")],
        ),
    }


def _channel(target: str, ca: bytes, client: certs.Pem | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None,
    )
    return grpc.secure_channel(target, creds)


def test_tls_with_api_key(tiny_model: Any, pki: dict[str, Any], tmp_path: Path) -> None:
    cert, key = pki["server"]
    options = ServerOptions(tls=TlsFiles(cert, key))
    with running_server(
        tiny_model, {"acme": TenantSpec()}, options=options, tenants_dir=tmp_path
    ) as srv:
        stub = inference_pb2_grpc.InferenceStub(_channel(srv.target, pki["ca"]))
        out = list(stub.Generate(request("Hello", max_tokens=2), metadata=srv.auth("acme")))
        assert out[-1].finished.usage.completion_tokens == 2
        with pytest.raises(grpc.RpcError) as plain:
            inference_pb2_grpc.InferenceStub(srv.channel()).ListModels(
                inference_pb2.ListModelsRequest(), metadata=srv.auth("acme"), timeout=5
            )
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE  # no plaintext on a TLS port


def test_mtls_client_certificate_names_the_tenant(
    tiny_model: Any, pki: dict[str, Any], tmp_path: Path
) -> None:
    cert, key = pki["server"]
    options = ServerOptions(tls=TlsFiles(cert, key, pki["dir"] / "ca.crt"))
    tenants = {
        "acme": TenantSpec(mtls_identities=(f"uri:{ACME_URI}",), with_key=False),
        "globex": TenantSpec(),
    }
    with running_server(tiny_model, tenants, options=options, tenants_dir=tmp_path) as srv:
        acme = _channel(srv.target, pki["ca"], pki["acme"])
        usage = cache_pb2_grpc.CacheStub(acme).GetUsage(cache_pb2.GetUsageRequest())
        assert usage.page_size == 16
        out = list(inference_pb2_grpc.InferenceStub(acme).Generate(request("Hi", max_tokens=2)))
        assert out[-1].finished.usage.completion_tokens == 2
        assert srv.usage("acme").miss_tokens == out[0].started.prompt_tokens  # billed to acme

        # A valid certificate that maps to no tenant.
        stranger = _channel(srv.target, pki["ca"], pki["stranger"])
        with pytest.raises(grpc.RpcError) as unmapped:
            cache_pb2_grpc.CacheStub(stranger).GetUsage(cache_pb2.GetUsageRequest())
        assert unmapped.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert details(unmapped.value)["ErrorInfo"].reason == "UNKNOWN_CERT"

        # acme's certificate with globex's key: the credentials disagree.
        with pytest.raises(grpc.RpcError) as mixed:
            cache_pb2_grpc.CacheStub(acme).GetUsage(
                cache_pb2.GetUsageRequest(), metadata=srv.auth("globex")
            )
        assert mixed.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert details(mixed.value)["ErrorInfo"].reason == "MISMATCH"

        # The same SAN signed by another CA never gets past the handshake.
        forged = _channel(srv.target, pki["ca"], pki["forged"])
        with pytest.raises(grpc.RpcError) as bad_ca:
            cache_pb2_grpc.CacheStub(forged).GetUsage(cache_pb2.GetUsageRequest(), timeout=5)
        assert bad_ca.value.code() == grpc.StatusCode.UNAVAILABLE

        # No client certificate at all: refused by the handshake.
        anonymous = _channel(srv.target, pki["ca"])
        with pytest.raises(grpc.RpcError) as no_cert:
            cache_pb2_grpc.CacheStub(anonymous).GetUsage(
                cache_pb2.GetUsageRequest(), metadata=srv.auth("globex"), timeout=5
            )
        assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_san_types_and_ambiguous_certificates(
    tiny_model: Any, pki: dict[str, Any], tmp_path: Path
) -> None:
    """A certificate naming two tenants, over a real handshake: gRPC's typed SAN properties
    reach the matcher."""
    cert, key = pki["server"]
    options = ServerOptions(tls=TlsFiles(cert, key, pki["dir"] / "ca.crt"))
    tenants = {
        "acme": TenantSpec(mtls_identities=(f"uri:{ACME_URI}",), with_key=False),
        "globex": TenantSpec(mtls_identities=("dns:globex.kvfence.test",), with_key=False),
    }
    with running_server(tiny_model, tenants, options=options, tenants_dir=tmp_path) as srv:
        acme = _channel(srv.target, pki["ca"], pki["acme"])
        cache_pb2_grpc.CacheStub(acme).GetUsage(cache_pb2.GetUsageRequest(), timeout=10)
        for name, reason in (("dns_lookalike", "UNKNOWN_CERT"), ("two_tenants", "AMBIGUOUS_CERT")):
            channel = _channel(srv.target, pki["ca"], pki[name])
            with pytest.raises(grpc.RpcError) as info:
                cache_pb2_grpc.CacheStub(channel).GetUsage(cache_pb2.GetUsageRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert details(info.value)["ErrorInfo"].reason == reason, name
