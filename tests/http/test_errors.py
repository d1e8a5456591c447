"""Every error mapping of the HTTP front, seen through the ``openai`` SDK and raw HTTP:
OpenAI error JSON with the status the gRPC table implies."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.http.conftest import base_url, client
from tests.serverutil import ServerHandle

MESSAGES = [{"role": "user", "content": "Hello"}]


def _model(srv: ServerHandle) -> str:
    return str(srv.stack.model.name)


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body
    assert isinstance(body, dict), body
    assert set(body) >= {"message", "type", "param", "code"}, body
    return body


def test_missing_and_invalid_keys_are_401(srv: ServerHandle) -> None:
    with pytest.raises(openai.AuthenticationError) as bad:
        client(srv, key="kvf_not-a-key").chat.completions.create(model=_model(srv), messages=MESSAGES)
    assert bad.value.status_code == 401 and _error(bad.value)["code"] == "INVALID_KEY"
    r = httpx.post(base_url(srv) + "/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(base_url(srv) + "/models", headers={"Authorization": "Basic abc"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "MALFORMED"


def test_model_not_permitted_is_403(srv: ServerHandle) -> None:
    with pytest.raises(openai.PermissionDeniedError) as err:
        client(srv, "other_model").chat.completions.create(model=_model(srv), messages=MESSAGES)
    assert err.value.status_code == 403 and _error(err.value)["type"] == "permission_error"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1000}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"stop": [1, 2]}, "stop"),
        ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"tools": []}, "tools"),
        ({"tenant": "globex"}, "tenant"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_chat_fields_are_400_with_the_param(
    srv: ServerHandle, extra: dict[str, Any], param: str
) -> None:
    body = {"model": _model(srv), "messages": MESSAGES, **extra}
    r = httpx.post(
        base_url(srv) + "/chat/completions",
        content=json.dumps(body, allow_nan=True),
        headers={"Authorization": f"Bearer {srv.keys['acme']}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_unknown_model_and_bad_json_are_400(srv: ServerHandle) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(srv).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert _error(err.value)["param"] == "model"
    r = httpx.post(base_url(srv) + "/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {srv.keys['acme']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_ignored_fields_are_accepted(srv: ServerHandle) -> None:
    r = client(srv).chat.completions.create(
        model=_model(srv), messages=MESSAGES, max_tokens=2, user="u-1", store=False,
        metadata={"k": "v"},
    )
    assert r.choices[0].message.content is not None


def test_rate_limit_is_429_with_retry_after(srv: ServerHandle) -> None:
    c = client(srv, "slow_rate")
    c.completions.create(model=_model(srv), prompt="Hello", max_tokens=40)  # takes the bucket
    with pytest.raises(openai.RateLimitError) as err:
        c.completions.create(model=_model(srv), prompt="Hello", max_tokens=40)
    assert err.value.status_code == 429
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert _error(err.value)["code"] == "tokens_per_minute"


class _CountingTokenizer:
    """Wraps the server's tokenizer and counts encode calls."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        return list(self._inner.encode(text, add_special_tokens))


def test_input_is_charged_before_the_tokenizer_runs(
    srv: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on gRPC: slow_rate has 60 tokens per minute, and 400 bytes of input are charged
    100 tokens by their size, so the request is refused before any tokenizer work."""
    prompts = srv.server.prep.prompts  # the PromptBuilder both fronts share
    spy = _CountingTokenizer(prompts._tok)
    monkeypatch.setattr(prompts, "_tok", spy)
    c = client(srv, "slow_rate")
    text = "word " * 80
    with pytest.raises(openai.RateLimitError) as completion:
        c.completions.create(model=_model(srv), prompt=text, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as chat:
        c.chat.completions.create(
            model=_model(srv), messages=[{"role": "user", "content": text}], max_tokens=1
        )
    for err in (completion, chat):
        assert _error(err.value)["code"] == "tokens_per_minute"
    assert spy.calls == 0
    client(srv).completions.create(model=_model(srv), prompt="Hello", max_tokens=1)
    assert spy.calls == 1  # the spy sees the tokenizer when it does run


def test_deadline_is_504(srv: ServerHandle) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        client(srv).completions.create(
            model=_model(srv), prompt="Hello", max_tokens=400,
            extra_body={"ignore_eos": True}, extra_headers={"X-Kvfence-Timeout": "0.05"},
        )
    assert err.value.status_code == 504 and _error(err.value)["type"] == "timeout"
    with pytest.raises(openai.BadRequestError):
        client(srv).completions.create(
            model=_model(srv), prompt="Hello", extra_headers={"X-Kvfence-Timeout": "soon"}
        )


def test_unknown_route_is_404_and_health_is_open(srv: ServerHandle) -> None:
    r = httpx.get(base_url(srv) + "/audio/speech")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    health = httpx.get(base_url(srv).removesuffix("/v1") + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
