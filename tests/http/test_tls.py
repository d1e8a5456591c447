"""The server's TLS flags apply to the HTTP front: TLS with a bearer key, and with a client
CA (mTLS) a client certificate is required before any request is read."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.serve.kvfence_server import ServerOptions, TlsFiles
from tests.serverutil import TenantSpec, running_server
from tests.service import certs


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("pki-http")
    ca, ca_key, ca_cert = certs.make_ca()
    (d / "ca.crt").write_bytes(ca.cert)
    client = certs.client_cert(ca_key, ca_cert, "spiffe://kvfence.test/acme")
    return {
        "dir": d,
        "server": certs.write(d, "server", certs.server_cert(ca_key, ca_cert)),
        "client": certs.write(d, "client", client),
    }


def test_https_with_api_key(tiny_model: Any, pki: dict[str, Any], tmp_path: Path) -> None:
    cert, key = pki["server"]
    options = ServerOptions(tls=TlsFiles(cert, key), http_port=0)
    with running_server(tiny_model, {"acme": TenantSpec()}, options=options,
                        tenants_dir=tmp_path) as srv:
        assert srv.server.http is not None
        url = f"https://127.0.0.1:{srv.server.http.port}/v1"
        ctx = ssl.create_default_context(cafile=str(pki["dir"] / "ca.crt"))
        c = openai.OpenAI(base_url=url, api_key=srv.keys["acme"], max_retries=0,
                          http_client=openai.DefaultHttpxClient(verify=ctx))
        r = c.completions.create(model=srv.stack.model.name, prompt="Hi", max_tokens=2,
                                 extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 2
        with pytest.raises(httpx.HTTPError):  # no plaintext on the TLS port
            httpx.get(url.replace("https", "http") + "/models", timeout=5)


def test_mtls_requires_a_client_certificate(
    tiny_model: Any, pki: dict[str, Any], tmp_path: Path
) -> None:
    cert, key = pki["server"]
    options = ServerOptions(tls=TlsFiles(cert, key, pki["dir"] / "ca.crt"), http_port=0)
    with running_server(tiny_model, {"acme": TenantSpec()}, options=options,
                        tenants_dir=tmp_path) as srv:
        assert srv.server.http is not None
        url = f"https://127.0.0.1:{srv.server.http.port}/v1/models"
        headers = {"Authorization": f"Bearer {srv.keys['acme']}"}
        ctx = ssl.create_default_context(cafile=str(pki["dir"] / "ca.crt"))
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, headers=headers, verify=ctx, timeout=5)
        client_cert, client_key = pki["client"]
        ctx.load_cert_chain(str(client_cert), str(client_key))
        r = httpx.get(url, headers=headers, verify=ctx, timeout=5)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == srv.stack.model.name
