"""The tenants file, key lookup and the authenticator's decisions (no server needed)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.rpc.error_details_pb2 import ErrorInfo

from service.admission.auth import Authenticator
from service.admission.tenants import (
    MAX_SHARED_PREFIX_CHARS,
    DeclaredPrefix,
    Quotas,
    TenantsFileError,
    add_tenant,
    hash_key,
    load_tenants,
    parse_tenants,
)
from service.errors import ServiceError

KEY_A, KEY_B = "kvf_alpha-key", "kvf_beta-key"


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def test_full_tenant_entry_parses(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        f"""
[tenants.acme]
api_key_sha256 = ["{hash_key(KEY_A).hex()}", "{hash_key(KEY_B).hex()}"]
mtls_identities = ["uri:spiffe://acme/worker"]
weight = 2.5
max_concurrent_streams = 3
max_kv_pages = 100
max_prompt_tokens = 50
tokens_per_minute = 1000
prefix_cache_ttl_seconds = 0
models = ["m1"]
allow_reflection = true
""",
    )
    (acme,) = load_tenants(path).tenants.values()
    assert acme.name == "acme" and acme.weight == 2.5
    assert acme.key_hashes == (hash_key(KEY_A), hash_key(KEY_B))
    assert acme.quotas == Quotas(3, 100, 50, 1000)
    assert acme.prefix_cache_ttl_seconds == 0.0
    assert acme.models == ("m1",) and acme.may_use_model("m1") and not acme.may_use_model("m2")
    assert acme.allow_reflection and acme.mtls_identities == ("uri:spiffe://acme/worker",)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[tenants.a]\nweight = 1.0\n", "needs api_key_sha256 or mtls_identities"),
        ('[tenants.a]\napi_key_sha256 = ["abc"]\n', "64 lowercase hex"),
        ('[tenants.a]\nmtls_identities = ["uri:x"]\nweight = 0\n', "weight"),
        (
            '[tenants.a]\nmtls_identities = ["uri:x"]\nmax_kv_page = 1\n',
            "unknown keys ['max_kv_page']",
        ),
        (
            '[tenants.a]\nmtls_identities = ["uri:x"]\nmax_concurrent_streams = 0\n',
            "max_concurrent_streams",
        ),
        ('[tenants.a]\nmtls_identities = ["uri:x"]\ntokens_per_minute = -1\n', "tokens_per_minute"),
        (
            '[tenants.a]\nmtls_identities = ["uri:x"]\n[tenants.b]\nmtls_identities = ["uri:x"]\n',
            "mapped to both",
        ),
        ('[tenants."__engine"]\nmtls_identities = ["uri:x"]\n', "invalid name"),
        ("[tenants.a\n", "cannot read"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(TenantsFileError) as info:
        load_tenants(_file(tmp_path, body))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(tmp_path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match="not found"):
        load_tenants(tmp_path / "absent.toml")


def test_add_tenant_stores_only_the_hash_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    key1 = add_tenant(path, "acme")
    key2 = add_tenant(path, "globex")
    text = path.read_text()
    assert key1 not in text and key2 not in text
    assert hash_key(key1).hex() in text
    registry = load_tenants(path)
    owner = registry.by_key(key1)
    assert owner is not None and owner.name == "acme"
    owner = registry.by_key(key2)
    assert owner is not None and owner.name == "globex"
    assert registry.by_key(key1 + "x") is None
    with pytest.raises(TenantsFileError, match="already exists"):
        add_tenant(path, "acme")
    with pytest.raises(TenantsFileError, match="invalid tenant name"):
        add_tenant(path, "bad name")


def _registry() -> Authenticator:
    return Authenticator(
        parse_tenants(
            {
                "tenants": {
                    "acme": {
                        "api_key_sha256": [hash_key(KEY_A).hex()],
                        "mtls_identities": ["uri:acme"],
                    },
                    "beta": {"api_key_sha256": [hash_key(KEY_B).hex()]},
                }
            }
        )
    )


def _reason(
    auth: Authenticator, metadata: list[tuple[str, str]], sans: list[bytes] | None = None
) -> str:
    ctx = {"peer_uri": sans} if sans else {}
    with pytest.raises(ServiceError) as info:
        auth.authenticate(metadata, ctx)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    return str(info.value.detail(ErrorInfo).reason)


def test_authenticator_decisions() -> None:
    auth = _registry()
    assert auth.authenticate([("authorization", f"Bearer {KEY_A}")], {}).name == "acme"
    assert auth.authenticate([("Authorization", f"bearer {KEY_B}")], {}).name == "beta"
    assert auth.authenticate([], {"peer_uri": [b"acme"]}).name == "acme"
    assert (
        auth.authenticate([("authorization", f"Bearer {KEY_A}")], {"peer_uri": [b"acme"]}).name
        == "acme"
    )
    assert _reason(auth, []) == "UNAUTHENTICATED"
    assert _reason(auth, [("authorization", "Bearer nope")]) == "INVALID_KEY"
    assert _reason(auth, [("authorization", KEY_A)]) == "MALFORMED"
    assert _reason(auth, [("authorization", f"Bearer {KEY_A}")] * 2) == "DUPLICATE_CREDENTIALS"
    assert _reason(auth, [], [b"nobody"]) == "UNKNOWN_CERT"
    assert _reason(auth, [("authorization", f"Bearer {KEY_B}")], [b"acme"]) == "MISMATCH"


def test_replace_swaps_the_registry_atomically() -> None:
    auth = _registry()
    auth.replace(parse_tenants({"tenants": {"beta": {"api_key_sha256": [hash_key(KEY_B).hex()]}}}))
    assert _reason(auth, [("authorization", f"Bearer {KEY_A}")]) == "INVALID_KEY"
    assert auth.authenticate([("authorization", f"Bearer {KEY_B}")], {}).name == "beta"


# A key hash under two tenants, or a certificate naming two tenants, must never be
# resolved by file order; a SAN matches only an identity of its own type.


def test_key_hash_under_two_tenants_is_refused_at_load(tmp_path: Path) -> None:
    digest = hash_key(KEY_A).hex()
    body = (
        f'[tenants.a]\napi_key_sha256 = ["{digest}"]\n'
        f'[tenants.b]\napi_key_sha256 = ["{hash_key(KEY_B).hex()}", "{digest}"]\n'
    )
    with pytest.raises(TenantsFileError) as info:
        load_tenants(_file(tmp_path, body))
    assert "listed under both 'a' and 'b'" in str(info.value) and "\n" not in str(info.value)
    assert digest not in str(info.value)  # a prefix names it; the file is the reference


def _typed() -> Authenticator:
    return Authenticator(
        parse_tenants(
            {
                "tenants": {
                    "uri_tenant": {"mtls_identities": ["uri:svc.example"]},
                    "dns_tenant": {"mtls_identities": ["dns:svc.example"]},
                    "mail_tenant": {"mtls_identities": ["email:ops@svc.example"]},
                }
            }
        )
    )


@pytest.mark.parametrize(
    ("context", "tenant"),
    [
        ({"peer_uri": [b"svc.example"]}, "uri_tenant"),
        ({"peer_dns": [b"svc.example"]}, "dns_tenant"),
        ({"peer_email": [b"ops@svc.example"]}, "mail_tenant"),
    ],
)
def test_san_matches_only_its_own_type(context: dict[str, list[bytes]], tenant: str) -> None:
    assert _typed().authenticate([], context).name == tenant


def test_san_of_another_type_does_not_match() -> None:
    auth = _typed()
    for context in ({"peer_dns": [b"ops@svc.example"]}, {"peer_uri": [b"ops@svc.example"]}):
        with pytest.raises(ServiceError) as info:
            auth.authenticate([], context)
        assert info.value.detail(ErrorInfo).reason == "UNKNOWN_CERT"


def test_certificate_mapping_to_two_tenants_is_refused() -> None:
    auth = _typed()
    both = {"peer_uri": [b"svc.example"], "peer_dns": [b"svc.example"]}
    with pytest.raises(ServiceError) as info:
        auth.authenticate([], both)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert info.value.detail(ErrorInfo).reason == "AMBIGUOUS_CERT"


@pytest.mark.parametrize("entry", ["spiffe://acme/worker", "ip:10.0.0.1", "uri:", "acme"])
def test_untyped_identity_is_refused_at_load(entry: str) -> None:
    with pytest.raises(TenantsFileError, match="must name its SAN type"):
        parse_tenants({"tenants": {"a": {"mtls_identities": [entry]}}})


# Quotas travel as uint32 in GetUsage; a larger value must fail at load, not as
# UNKNOWN on every GetUsage.


@pytest.mark.parametrize(
    "key", ["max_kv_pages", "max_concurrent_streams", "max_prompt_tokens", "tokens_per_minute"]
)
def test_quota_over_uint32_is_refused_at_load(key: str) -> None:
    tenant = {"api_key_sha256": [hash_key(KEY_A).hex()]}
    parse_tenants({"tenants": {"a": {**tenant, key: 2**32 - 1}}})  # the largest that fits
    with pytest.raises(TenantsFileError, match=f"{key} must be an integer in"):
        parse_tenants({"tenants": {"a": {**tenant, key: 2**32}}})


@pytest.mark.parametrize("ttl", [float("inf"), float("nan"), 1e12, -1])
def test_ttl_must_be_finite_and_bounded(ttl: float) -> None:
    tenant = {"api_key_sha256": [hash_key(KEY_A).hex()], "prefix_cache_ttl_seconds": ttl}
    with pytest.raises(TenantsFileError, match="prefix_cache_ttl_seconds"):
        parse_tenants({"tenants": {"a": tenant}})


def test_add_tenant_writes_every_quota_explicitly(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    add_tenant(path, "acme")
    text = path.read_text()
    for key in (
        "weight",
        "max_concurrent_streams",
        "max_kv_pages",
        "max_prompt_tokens",
        "tokens_per_minute",
    ):
        assert f"\n{key} = " in text, key
    assert load_tenants(path).tenants["acme"].quotas == Quotas()


SHARED = '''
[shared_prefixes]
support = "You are the support assistant.\\n"
legal = "Answer as counsel would.\\n"

[shared_prefixes.helpdesk]
system = "You are the help desk."

[tenants.acme]
api_key_sha256 = ["{key}"]
shared_prefixes = ["support", "legal", "support"]

[tenants.globex]
api_key_sha256 = ["{other}"]
'''


def test_shared_prefixes_are_declared_once_and_opted_into_by_name(tmp_path: Path) -> None:
    path = _file(tmp_path, SHARED.format(key=hash_key(KEY_A).hex(), other=hash_key(KEY_B).hex()))
    registry = load_tenants(path)
    assert registry.shared_prefixes == {
        "support": DeclaredPrefix("You are the support assistant.\n"),
        "legal": DeclaredPrefix("Answer as counsel would.\n"),
        "helpdesk": DeclaredPrefix("You are the help desk.", system=True),
    }
    assert registry.tenants["acme"].shared_prefixes == ("support", "legal")
    assert registry.tenants["globex"].shared_prefixes == ()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[shared_prefixes]\nsupport = "x"\n[tenants.a]\napi_key_sha256 = ["{key}"]\n'
         'shared_prefixes = ["sales"]\n',
         "tenant 'a': shared_prefixes names 'sales', which [shared_prefixes] does not declare"),
        ('[tenants.a]\napi_key_sha256 = ["{key}"]\nshared_prefixes = ["support"]\n',
         "shared_prefixes names 'support', which [shared_prefixes] does not declare"),
        ('[shared_prefixes]\n"no spaces" = "x"\n', "name 'no spaces' is invalid"),
        ('[shared_prefixes]\nsupport = ""\n', "'support' must be a text of 1 to 65536"),
        ("[shared_prefixes]\nsupport = 3\n", "'support' must be a text of 1 to 65536"),
        ('shared_prefixes = "support"\n', "[shared_prefixes] must be a table"),
        ('[shared_prefixes.support]\nuser = "x"\n',
         "'support' is neither form: name = \"text\", or a table holding system = \"text\" "
         "alone (it holds 'user')"),
        ('[shared_prefixes.support]\nsystem = "x"\nuser = "y"\n',
         "(it holds 'system', 'user')"),
        ("[shared_prefixes.support]\n", "(it holds nothing)"),
        ('[shared_prefixes.support]\nsystem = ""\n',
         "'support': system must be a text of 1 to 65536"),
        ("[shared_prefixes.support]\nsystem = [1]\n",
         "'support': system must be a text of 1 to 65536"),
        ('[tenants.a]\napi_key_sha256 = ["{key}"]\nshared_prefixes = "support"\n',
         "shared_prefixes must be a list of strings"),
    ],
)
def test_bad_shared_prefixes_are_refused_by_name(tmp_path: Path, body: str, message: str) -> None:
    path = _file(tmp_path, body.format(key=hash_key(KEY_A).hex()))
    with pytest.raises(TenantsFileError) as err:
        load_tenants(path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_shared_prefix_text_is_bounded(tmp_path: Path) -> None:
    long = "a" * (MAX_SHARED_PREFIX_CHARS + 1)
    with pytest.raises(TenantsFileError):
        parse_tenants({"shared_prefixes": {"big": long}})
    assert parse_tenants({"shared_prefixes": {"big": long[1:]}}).shared_prefixes["big"].text == (
        long[1:]
    )
    with pytest.raises(TenantsFileError):
        parse_tenants({"shared_prefixes": {"big": {"system": long}}})
