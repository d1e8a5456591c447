"""Each OpenAI field on docs/openai.md's lists does what the list says: honoured fields change
the output as specified, ignored ones change nothing, refused and unknown ones are a 400
naming the field. Also ``cache_salt`` on both fronts, through a real server."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.http import body_fields
from service.serve.kvfence_server import ServerOptions
from tests.http.conftest import TENANTS, base_url
from tests.serverutil import ServerHandle, running_server

MESSAGES = [{"role": "user", "content": "Tell me about the weather today."}]
LONG = "1234567890 3.14159 2.71828 -42 +7 100% " * 6  # several full KV pages


@pytest.fixture(scope="module")
def srv(tiny_model: Any) -> Iterator[ServerHandle]:
    with running_server(
        tiny_model, TENANTS, options=ServerOptions(http_port=0), log_stream=io.StringIO()
    ) as handle:
        yield handle


def post(srv: ServerHandle, path: str, body: dict[str, Any], tenant: str = "acme") -> httpx.Response:
    return httpx.post(
        f"{base_url(srv)}/{path}",
        json=body,
        headers={"Authorization": f"Bearer {srv.keys[tenant]}"},
        timeout=60,
    )


def chat(srv: ServerHandle, tenant: str = "acme", **extra: Any) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    return post(srv, "chat/completions", body, tenant)


def chat_text(srv: ServerHandle, **extra: Any) -> str:
    r = chat(srv, **extra)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def grpc_ids(srv: ServerHandle, req: inference_pb2.GenerateRequest, tenant: str = "acme") -> list[Any]:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    return list(stub.Generate(req, metadata=srv.auth(tenant)))


@pytest.mark.parametrize("name", sorted(body_fields.IGNORED))
def test_an_ignored_field_is_accepted_and_changes_nothing(srv: ServerHandle, name: str) -> None:
    value = {"metadata": {"k": "v"}, "store": True}.get(name, "auto")
    assert chat_text(srv, **{name: value}) == chat_text(srv)


@pytest.mark.parametrize("name", sorted(body_fields.REFUSED))
def test_a_refused_field_is_a_400_naming_it(srv: ServerHandle, name: str) -> None:
    r = chat(srv, **{name: {"x": 1}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", name)
    assert body_fields.REFUSED[name] in err["message"]


def test_an_unknown_field_is_a_400_naming_it(srv: ServerHandle) -> None:
    r = chat(srv, frobnicate=1)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "frobnicate"
    assert "unknown" in r.json()["error"]["message"]


def test_a_null_field_is_an_absent_one(srv: ServerHandle) -> None:
    """Gateways send explicit nulls, for refused fields too."""
    assert chat_text(srv, functions=None, frobnicate=None, seed=None) == chat_text(srv)


def test_modalities_text_is_accepted_and_audio_refused(srv: ServerHandle) -> None:
    assert chat_text(srv, modalities=["text"]) == chat_text(srv)
    r = chat(srv, modalities=["text", "audio"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "modalities"


def test_logit_bias_is_honoured_and_matches_grpc(srv: ServerHandle) -> None:
    token = 77
    text = chat_text(srv, logit_bias={str(token): 100})
    req = inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(
            messages=[inference_pb2.ChatMessage(role="user", content=MESSAGES[0]["content"])]
        ),
        sampling=inference_pb2.SamplingParams(temperature=0.0, logit_bias={token: 100.0}),
        stopping=inference_pb2.StoppingParams(max_tokens=6, ignore_eos=True),
    )
    out = grpc_ids(srv, req)
    ids = [t for m in out if m.HasField("chunk") for t in m.chunk.token_ids]
    assert ids == [token] * 6
    assert text == "".join(m.chunk.text for m in out if m.HasField("chunk"))
    assert text != chat_text(srv)
    # A ban: the unbiased greedy first token never comes back.
    first = grpc_ids(srv, inference_pb2.GenerateRequest(
        chat=req.chat, sampling=inference_pb2.SamplingParams(temperature=0.0),
        stopping=inference_pb2.StoppingParams(max_tokens=1, ignore_eos=True),
    ))[1].chunk.token_ids[0]
    req.sampling.logit_bias.clear()
    req.sampling.logit_bias[first] = -100.0
    assert first not in [t for m in grpc_ids(srv, req) if m.HasField("chunk") for t in m.chunk.token_ids]


@pytest.mark.parametrize(
    ("bias", "param"),
    [({"x": 1}, "logit_bias"), ({"5": "a"}, "logit_bias"), ({"5": 101}, "logit_bias"),
     ({"999999": 1}, "logit_bias"), ([1], "logit_bias")],
)
def test_a_bad_logit_bias_is_a_400(srv: ServerHandle, bias: Any, param: str) -> None:
    r = chat(srv, logit_bias=bias)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("name", ["user", "safety_identifier"])
def test_the_end_user_is_logged_only_as_a_keyed_hash(srv: ServerHandle, name: str) -> None:
    user = f"end-user-{name}@example.com"
    before = len(srv.log_lines())
    assert chat_text(srv, **{name: user}) == chat_text(srv)
    lines = srv.log_lines()[before:]
    accepted = [json.loads(x) for x in lines if '"http.accepted"' in x]
    hashes = [e["end_user"] for e in accepted]
    assert hashes[1] is None  # the request without one
    assert len(hashes[0]) == 16 and int(hashes[0], 16) >= 0
    assert not any(user in x for x in lines)
    again = len(srv.log_lines())
    chat_text(srv, **{name: user})
    assert json.loads(next(x for x in srv.log_lines()[again:] if '"http.accepted"' in x))[
        "end_user"
    ] == hashes[0]  # stable: one end user, one id


def test_cache_salt_must_be_a_non_empty_string(srv: ServerHandle) -> None:
    for bad in ("", 5):
        r = chat(srv, cache_salt=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    r = chat(srv, cache_salt="x" * 257)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def _cached(srv: ServerHandle, tenant: str, **extra: Any) -> int:
    r = post(srv, "completions", {"prompt": LONG, "max_tokens": 1, **extra}, tenant)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_two_salts_of_one_tenant_share_no_cached_tokens(srv: ServerHandle) -> None:
    assert _cached(srv, "acme", cache_salt="alice") == 0
    assert _cached(srv, "acme", cache_salt="bob") == 0
    assert _cached(srv, "acme") == 0  # no salt is a namespace of its own
    assert _cached(srv, "acme", cache_salt="alice") > 0
    assert _cached(srv, "acme", cache_salt="bob") > 0


def test_a_salt_cannot_reach_another_tenants_pages(srv: ServerHandle) -> None:
    prompt = LONG + " other"
    assert _cached(srv, "acme", cache_salt="shared", prompt=prompt) == 0
    assert _cached(srv, "acme", cache_salt="shared", prompt=prompt) > 0
    for salt in ("shared", "acme", "acme\x00shared"):
        assert _cached(srv, "globex", cache_salt=salt, prompt=prompt) == 0


def test_grpc_salt_is_the_same_namespace_as_http(srv: ServerHandle) -> None:
    prompt = LONG + " grpc"
    assert _cached(srv, "acme", cache_salt="carol", prompt=prompt) == 0

    def grpc_cached(salt: str) -> int:
        req = inference_pb2.GenerateRequest(
            text=prompt, cache_salt=salt, stopping=inference_pb2.StoppingParams(max_tokens=1)
        )
        return int(grpc_ids(srv, req)[0].started.cached_prompt_tokens)

    assert grpc_cached("dave") == 0
    assert grpc_cached("carol") > 0
