from __future__ import annotations

import pytest

from clients.errors import ClientError
from clients.requests import build_generate_request, build_tokenize_request
from clients.retry import RetryPolicy, as_policy


def test_unset_options_stay_unset_so_the_server_defaults_apply() -> None:
    request = build_generate_request("hi")
    assert request.WhichOneof("input") == "text"
    assert request.text == "hi"
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
    ):
        assert not request.sampling.HasField(name), name
    assert not request.stopping.HasField("max_tokens")


def test_every_option_reaches_its_field() -> None:
    request = build_generate_request(
        token_ids=[1, 2, 3],
        options={
            "max_tokens": 7,
            "min_tokens": 2,
            "temperature": 0.0,
            "top_k": 5,
            "top_p": 0.5,
            "min_p": 0.25,
            "repetition_penalty": 1.5,
            "presence_penalty": -1.0,
            "frequency_penalty": 0.5,
            "seed": 42,
            "stop": ["\n", "END"],
            "stop_token_ids": [2],
            "ignore_eos": True,
            "logprobs": 3,
            "client_request_id": "abc",
            "bypass_prefix_cache": True,
            "model": "m",
        },
    )
    assert list(request.token_ids.ids) == [1, 2, 3]
    s = request.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.0, 5, 0.5, 0.25)
    assert s.HasField("temperature")  # greedy 0.0 is sent, not dropped as "unset"
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.seed) == (
        1.5,
        -1.0,
        0.5,
        42,
    )
    t = request.stopping
    assert (t.max_tokens, t.min_tokens, list(t.stop), list(t.stop_token_ids), t.ignore_eos) == (
        7,
        2,
        ["\n", "END"],
        [2],
        True,
    )
    assert (
        request.logprobs,
        request.client_request_id,
        request.bypass_prefix_cache,
        request.model,
    ) == (3, "abc", True, "m")


def test_messages_and_empty_token_ids_select_their_input() -> None:
    chat = build_generate_request(
        messages=[{"role": "user", "content": "yo"}], add_generation_prompt=False
    )
    assert chat.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "yo")]
    assert chat.chat.add_generation_prompt is False
    assert build_generate_request(token_ids=[]).WhichOneof("input") == "token_ids"


def test_a_bare_stop_string_is_one_stop_string() -> None:
    assert list(build_generate_request("x", options={"stop": "END"}).stopping.stop) == ["END"]


@pytest.mark.parametrize(
    "kwargs", [{}, {"prompt": "a", "token_ids": [1]}, {"prompt": "a", "messages": []}]
)
def test_exactly_one_input(kwargs: dict[str, object]) -> None:
    with pytest.raises(ClientError, match="exactly one of prompt, token_ids or messages"):
        build_generate_request(**kwargs)  # type: ignore[arg-type]


def test_bad_messages_and_unknown_options_are_refused() -> None:
    with pytest.raises(ClientError, match=r"messages\[1\] needs string 'role' and 'content'"):
        build_generate_request(messages=[{"role": "user", "content": "a"}, {"role": "user"}])
    with pytest.raises(ClientError, match=r"unknown generate option\(s\): max_new_tokens"):
        build_generate_request("a", options={"max_new_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(ClientError, match="exactly one of text or messages"):
        build_tokenize_request()


def test_retries_argument() -> None:
    assert as_policy(0).attempts == 1
    assert as_policy(3).attempts == 4
    assert RetryPolicy(enabled=False, max_attempts=9).attempts == 1
    with pytest.raises(ClientError):
        as_policy(-1)
    with pytest.raises(ClientError):
        RetryPolicy(max_attempts=0)
