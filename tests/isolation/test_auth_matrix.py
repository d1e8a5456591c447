"""The authentication matrix over real gRPC: every credential case gets its status, every
application-level denial is one ``auth.denied`` log line with its reason (and never the key),
and a tenant's Cache RPCs touch only its own namespace.

Transport-level refusals (plaintext to the TLS port, an untrusted client CA, no client
certificate) fail in the TLS handshake, before any kvfence code runs: the client sees
UNAVAILABLE and the application logs nothing, by construction.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc
from service.serve.kvfence_server import ServerOptions, TlsFiles
from tests.serverutil import ServerHandle, TenantSpec, running_server, write_tenants_file
from tests.verify.calls import Metadata, bearer, collect, gen_request
from tests.verify.pki import make_authority, write_pair
from tests.verify.recorder import Recorder

U = grpc.StatusCode.UNAUTHENTICATED
OK = grpc.StatusCode.OK
TENANTS = {"acme": TenantSpec(), "globex": TenantSpec(), "revokee": TenantSpec()}


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    metadata: Metadata
    method: str
    code: grpc.StatusCode
    reason: str | None  # the auth.denied reason logged; None = no denial logged


def _call(channel: grpc.Channel, method: str, metadata: Metadata) -> grpc.StatusCode:
    inference = inference_pb2_grpc.InferenceStub(channel)
    cache = cache_pb2_grpc.CacheStub(channel)
    calls: dict[str, Callable[[], Any]] = {
        "Generate": lambda: list(
            inference.Generate(gen_request([5, 6], max_tokens=1), metadata=metadata, timeout=10)
        ),
        "Tokenize": lambda: inference.Tokenize(
            inference_pb2.TokenizeRequest(text="hi"), metadata=metadata, timeout=10
        ),
        "ListModels": lambda: inference.ListModels(
            inference_pb2.ListModelsRequest(), metadata=metadata, timeout=10
        ),
        "GetUsage": lambda: cache.GetUsage(
            cache_pb2.GetUsageRequest(), metadata=metadata, timeout=10
        ),
        "Purge": lambda: cache.Purge(cache_pb2.PurgeRequest(), metadata=metadata, timeout=10),
    }
    try:
        calls[method]()
    except grpc.RpcError as err:
        return err.code()
    return OK


class DenialLog:
    """The ``auth.denied`` events of a server's JSON log, read incrementally."""

    def __init__(self, stream: io.StringIO) -> None:
        self._stream = stream
        self._seen = 0

    def new_denials(self) -> list[dict[str, Any]]:
        lines = self._stream.getvalue().splitlines()
        fresh, self._seen = lines[self._seen :], len(lines)
        events = [json.loads(line) for line in fresh if line.startswith("{")]
        return [e for e in events if e.get("event") == "auth.denied"]


def _run_cases(channel: grpc.Channel, log: DenialLog, cases: list[Case]) -> list[str]:
    wrong: list[str] = []
    log.new_denials()
    for case in cases:
        code = _call(channel, case.method, case.metadata)
        denials = log.new_denials()
        reasons = [d.get("reason") for d in denials]
        want = [] if case.reason is None else [case.reason]
        if code != case.code:
            wrong.append(f"{case.name}: {code.name}, expected {case.code.name}")
        if reasons != want:
            wrong.append(f"{case.name}: logged denials {reasons}, expected {want}")
    return wrong


@pytest.fixture
def srv(tiny: Any, tmp_path: Path) -> Iterator[ServerHandle]:
    with running_server(tiny, TENANTS, log_stream=io.StringIO(), tenants_dir=tmp_path) as handle:
        yield handle


def test_api_key_matrix(srv: ServerHandle, record: Recorder) -> None:
    assert srv.log_stream is not None
    log = DenialLog(srv.log_stream)
    key = srv.keys["acme"]
    wrong_key = "kvf_" + "0" * 40
    methods = ("Generate", "Tokenize", "ListModels", "GetUsage", "Purge")
    cases = [Case(f"no key, {m}", (), m, U, "UNAUTHENTICATED") for m in methods]
    cases += [
        Case("empty key", (("authorization", "Bearer "),), "GetUsage", U, "MALFORMED"),
        Case("empty header value", (("authorization", ""),), "GetUsage", U, "MALFORMED"),
        Case("scheme only", (("authorization", "Bearer"),), "GetUsage", U, "MALFORMED"),
        Case("key without scheme", (("authorization", key),), "GetUsage", U, "MALFORMED"),
        Case("Basic scheme", (("authorization", f"Basic {key}"),), "GetUsage", U, "MALFORMED"),
        Case("wrong key", bearer(wrong_key), "Generate", U, "INVALID_KEY"),
        Case("key in upper case", bearer(key.upper()), "GetUsage", U, "INVALID_KEY"),
        Case("duplicate header, same key", bearer(key) * 2, "Generate", U, "DUPLICATE_CREDENTIALS"),
        Case(
            "duplicate header, two tenants",
            bearer(key) + bearer(srv.keys["globex"]),
            "GetUsage",
            U,
            "DUPLICATE_CREDENTIALS",
        ),
        Case(
            "duplicate header, good + wrong",
            bearer(key) + bearer(wrong_key),
            "GetUsage",
            U,
            "DUPLICATE_CREDENTIALS",
        ),
        Case(
            "scheme 'bearer' (RFC 7235: case-insensitive)",
            (("authorization", f"bearer {key}"),),
            "GetUsage",
            OK,
            None,
        ),
        Case("scheme 'BEARER'", (("authorization", f"BEARER {key}"),), "Generate", OK, None),
        # HTTP/2 forbids upper-case header names: gRPC refuses to send it at all.
        Case(
            "header name 'Authorization'",
            (("Authorization", f"Bearer {key}"),),
            "GetUsage",
            grpc.StatusCode.INTERNAL,
            None,
        ),
        Case("valid key", bearer(key), "Generate", OK, None),
    ]
    channel = srv.channel()
    wrong = _run_cases(channel, log, cases)

    # Revocation by reload: the tenants file loses "revokee"; its key is refused at once.
    revoked_key = srv.keys["revokee"]
    before = _call(channel, "GetUsage", bearer(revoked_key))
    write_tenants_file(
        srv.tenants_path,
        {
            "acme": TenantSpec(api_key=key),
            "globex": TenantSpec(api_key=srv.keys["globex"]),
        },
    )
    assert srv.server.reload_tenants()
    log.new_denials()
    wrong += _run_cases(
        channel,
        log,
        [
            Case("revoked key after reload", bearer(revoked_key), "Generate", U, "INVALID_KEY"),
            Case("other keys survive the reload", bearer(key), "GetUsage", OK, None),
        ],
    )
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)

    text = srv.log_stream.getvalue()
    leaked = [k for k in (*srv.keys.values(), wrong_key) if k in text]
    n = len(cases) + 3
    assert before == OK
    assert record(
        "credential cases with the expected status and log line",
        n - len(wrong),
        f"== {n}",
        not wrong,
    ), wrong
    assert record("API keys appearing in the logs", len(leaked), "== 0", not leaked)
    assert record(
        "health without credentials",
        health.status == health.SERVING,
        "True",
        health.status == health.SERVING,
    )


def test_cache_rpcs_touch_only_the_callers_tenant(srv: ServerHandle, record: Recorder) -> None:
    inference = inference_pb2_grpc.InferenceStub(srv.channel())
    cache = cache_pb2_grpc.CacheStub(srv.channel())
    prompts = {"acme": list(range(10, 50)), "globex": list(range(100, 180))}  # 2 and 5 pages

    def generate(tenant: str) -> int:
        result = collect(
            inference.Generate(
                gen_request(prompts[tenant], max_tokens=2), metadata=srv.auth(tenant), timeout=30
            )
        )
        assert result.ok and result.started is not None
        return int(result.started.cached_prompt_tokens)

    def usage(tenant: str) -> Any:
        return cache.GetUsage(cache_pb2.GetUsageRequest(), metadata=srv.auth(tenant), timeout=10)

    for tenant in prompts:
        generate(tenant)
    acme, globex = usage("acme"), usage("globex")
    truth_acme, truth_globex = srv.usage("acme"), srv.usage("globex")
    views_own = (acme.pages_cached, acme.cached_prefixes) == (
        truth_acme.pages_cached,
        truth_acme.cached_prefixes,
    ) and (globex.pages_cached, globex.cached_prefixes) == (
        truth_globex.pages_cached,
        truth_globex.cached_prefixes,
    )
    purged = cache.Purge(cache_pb2.PurgeRequest(), metadata=srv.auth("acme"), timeout=10)
    globex_after = srv.usage("globex")
    untouched = (globex_after.pages_cached, globex_after.cached_prefixes) == (
        truth_globex.pages_cached,
        truth_globex.cached_prefixes,
    )
    globex_hit, acme_hit = generate("globex"), generate("acme")

    assert truth_acme.pages_cached != truth_globex.pages_cached  # the views are tellable apart
    assert record("GetUsage shows exactly the caller's own cache", views_own, "True", views_own)
    assert record(
        "pages purged by A == A's cached pages",
        purged.pages_purged,
        f"== {truth_acme.pages_cached}",
        purged.pages_purged == truth_acme.pages_cached,
    )
    assert record("B's cache untouched by A's Purge", untouched, "True", untouched)
    assert record("B's cached tokens after A's Purge", globex_hit, "> 0", globex_hit > 0)
    assert record("A's cached tokens after its own Purge", acme_hit, "== 0", acme_hit == 0)


def test_tls_and_mtls_matrix(tiny: Any, tmp_path: Path, record: Recorder) -> None:
    ca, rogue = make_authority("kvfence-test-ca"), make_authority("rogue-ca")
    cert, key = write_pair(tmp_path, "server", ca.issue("localhost", server=True))
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    mapped, unmapped = "spiffe://kvfence/worker", "spiffe://kvfence/stranger"
    tenants = {
        "acme": TenantSpec(),
        "mtls": TenantSpec(mtls_identities=(f"uri:{mapped}",), with_key=False),
    }
    options = ServerOptions(tls=TlsFiles(cert, key, tmp_path / "ca.pem"))
    stream = io.StringIO()
    with running_server(
        tiny, tenants, options=options, log_stream=stream, tenants_dir=tmp_path
    ) as srv:
        log = DenialLog(stream)

        def secure(client: Any | None) -> grpc.Channel:
            creds = grpc.ssl_channel_credentials(
                root_certificates=ca.cert_pem,
                private_key=None if client is None else client.key_pem,
                certificate_chain=None if client is None else client.cert_pem,
            )
            return grpc.secure_channel(
                srv.target, creds, options=[("grpc.ssl_target_name_override", "localhost")]
            )

        good, stranger = ca.issue("worker", uri=mapped), ca.issue("stranger", uri=unmapped)
        forged = rogue.issue("worker", uri=mapped)  # same identity, untrusted issuer
        key_acme = bearer(srv.keys["acme"])
        unavailable = grpc.StatusCode.UNAVAILABLE
        matrix: list[tuple[grpc.Channel, Case]] = [
            (
                grpc.insecure_channel(srv.target),
                Case("plaintext to the TLS port", key_acme, "GetUsage", unavailable, None),
            ),
            (
                secure(None),
                Case("TLS without a client certificate", key_acme, "GetUsage", unavailable, None),
            ),
            (
                secure(forged),
                Case("client cert from an untrusted CA", (), "GetUsage", unavailable, None),
            ),
            (secure(good), Case("trusted, mapped client cert", (), "Generate", OK, None)),
            (
                secure(stranger),
                Case("trusted cert, unmapped identity", (), "GetUsage", U, "UNKNOWN_CERT"),
            ),
            (
                secure(good),
                Case("mapped cert + another tenant's key", key_acme, "GetUsage", U, "MISMATCH"),
            ),
        ]
        wrong: list[str] = []
        for channel, case in matrix:
            wrong += _run_cases(channel, log, [case])
            channel.close()
    assert record(
        "TLS/mTLS cases with the expected status and log line",
        len(matrix) - len(wrong),
        f"== {len(matrix)}",
        not wrong,
    ), wrong
