"""Log lines carry tenant, request id and peer; prompt and output text only with --log-content."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from service.serve.kvfence_server import ServerOptions
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.service.leaks import SECRET, SECRET_FRAGMENTS, leaked, log_strings
from tests.service.rpc import generate, request, stubs

OUTPUT_TOKENS = 24


def _events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines]


def _chat(content: str) -> Any:
    req = request(None, max_tokens=OUTPUT_TOKENS)
    req.chat.messages.add(role="user", content=content)
    return req


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_request_lines_carry_tenant_and_request_id_never_the_content(
    srv: ServerHandle, kind: str
) -> None:
    req = request(SECRET, max_tokens=OUTPUT_TOKENS) if kind == "text" else _chat(SECRET)
    before = len(srv.log_lines())
    out = generate(srv, "acme", req)
    request_id = out[0].started.request_id
    output = "".join(r.chunk.text for r in out[1:-1])
    lines = srv.log_lines()
    mine = [e for e in _events(lines[before:]) if e.get("request_id") == request_id]
    # (this module's server alerts above 3 KV pages per request)
    events = [e["event"] for e in mine if e["event"] != "kv.alert.request_pages"]
    assert events == ["generate.accepted", "generate.finished"]
    for event in mine:
        assert event["tenant"] == "acme"
        assert event["peer"].startswith("ipv4:127.0.0.1:")
    finished = mine[-1]
    assert (finished["reason"], finished["completion_tokens"]) == ("length", OUTPUT_TOKENS)
    assert finished["total_s"] >= 0 and "ttft_s" in finished and "queue_s" in finished
    # The generated text itself: long enough that finding it cannot be chance, and searched
    # in the decoded log (the tiny model's text is mostly non-ASCII, which JSON escapes).
    assert len(output) >= 8, repr(output)
    assert not leaked(log_strings(lines), [*SECRET_FRAGMENTS, output])


def test_each_auth_denial_is_its_own_event_without_the_key(srv: ServerHandle) -> None:
    inference, _ = stubs(srv)
    bad_key = "kvf_this-key-must-never-be-logged"
    before = len(srv.log_lines())
    for metadata in ((("authorization", f"Bearer {bad_key}"),), ()):
        with pytest.raises(grpc.RpcError):
            list(inference.Generate(request("hi"), metadata=metadata))
    new = _events(srv.log_lines()[before:])
    denials = [e for e in new if e["event"] == "auth.denied"]
    assert [(d["code"], d["reason"]) for d in denials] == [
        ("UNAUTHENTICATED", "INVALID_KEY"),
        ("UNAUTHENTICATED", "UNAUTHENTICATED"),
    ]
    assert all(
        d["method"] == "/kvfence.v1.Inference/Generate" and d["level"] == "warning" for d in denials
    )
    assert not leaked(log_strings(srv.log_lines()), [bad_key])


def test_log_content_flag_logs_the_prompt(tiny_model: Any, tmp_path: Path) -> None:
    log = io.StringIO()
    with running_server(
        tiny_model,
        {"acme": TenantSpec()},
        options=ServerOptions(log_content=True),
        log_stream=log,
        tenants_dir=tmp_path,
    ) as srv:
        out = generate(srv, "acme", request(SECRET, max_tokens=OUTPUT_TOKENS))
    lines = log.getvalue().splitlines()
    contents = [e for e in _events(lines) if e["event"] == "generate.content"]
    output = "".join(r.chunk.text for r in out[1:-1])
    assert contents[0]["prompt"] == SECRET
    assert contents[1]["output"] == output
    assert all(e["request_id"] == out[0].started.request_id for e in contents)
    # The same search the tests above rely on finds every fragment here (it has the power).
    found = {needle for needle, _ in leaked(log_strings(lines), [*SECRET_FRAGMENTS, output])}
    assert found == {*SECRET_FRAGMENTS, output}
