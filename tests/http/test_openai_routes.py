"""The routes agents and tools call, with the official ``openai`` SDK (and plain HTTP where
it has no method): ``/v1/responses`` (plain, streamed, a function tool and its output),
``/tokenize`` and ``/detokenize``, the ``/v1/embeddings`` refusal, ``/metrics`` on the
HTTP port."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from service.serve.kvfence_server import ServerOptions
from tests.http.conftest import TENANTS, base_url, client
from tests.serverutil import TEST_SIZING, ServerHandle, running_server

CONTEXT = 1024  # the tiny model's own length

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served(tiny_model: Any) -> Iterator[ServerHandle]:
    options = ServerOptions(http_port=0, metrics_on_http=True)
    # Room for the tool preamble: several hundred tokens of the tiny vocabulary.
    sizing = replace(TEST_SIZING, kv_memory="64MiB", max_model_len=CONTEXT)
    with running_server(tiny_model, TENANTS, sizing=sizing, options=options) as handle:
        yield handle


def _model(srv: ServerHandle) -> str:
    return str(srv.stack.model.name)


def _post(srv: ServerHandle, path: str, body: dict[str, Any], tenant: str | None = "acme"
          ) -> httpx.Response:
    root = base_url(srv).removesuffix("/v1")
    headers = {"Authorization": f"Bearer {srv.keys[tenant]}"} if tenant else {}
    return httpx.post(root + path, json=body, headers=headers, timeout=60)


def _chat_text(srv: ServerHandle, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    return client(srv).chat.completions.create(
        model=_model(srv), messages=messages, max_tokens=max_tokens, **GREEDY
    )


def test_responses_plain_text_is_the_chat_answer(served: ServerHandle) -> None:
    r = client(served).responses.create(
        model=_model(served), input="Hello there", max_output_tokens=6, **GREEDY
    )
    chat = _chat_text(served, [{"role": "user", "content": "Hello there"}], 6)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and r.usage.output_tokens == 6
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_instructions_and_message_list_map_to_chat_messages(
    served: ServerHandle,
) -> None:
    r = client(served).responses.create(
        model=_model(served), instructions="Be brief.", max_output_tokens=5,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               {"role": "assistant", "content": "Hello!"},
               {"role": "user", "content": "Again"}],
        **GREEDY,
    )
    chat = _chat_text(served, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"},
    ], 5)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_stream_sends_the_sdk_event_types(served: ServerHandle) -> None:
    events = list(client(served).responses.create(
        model=_model(served), input="Hello there", max_output_tokens=6, stream=True, **GREEDY
    ))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    plain = client(served).responses.create(
        model=_model(served), input="Hello there", max_output_tokens=6, **GREEDY
    )
    assert text == plain.output_text and text
    last = events[-1].response
    assert last.output_text == text and last.usage is not None and last.usage.output_tokens == 6


def test_a_function_tool_call_and_its_output_follow_up(served: ServerHandle) -> None:
    c = client(served)
    question = {"role": "user", "content": "Weather in Paris?"}
    first = c.responses.create(
        model=_model(served), input=[question], tools=[WEATHER], tool_choice="required",
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and first.status == "completed"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    assert calls[0].call_id.startswith("call_")
    follow = [question, *[item.model_dump(exclude_none=True) for item in first.output],
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    second = c.responses.create(
        model=_model(served), input=follow, tools=[WEATHER], tool_choice="none",
        max_output_tokens=4, **GREEDY,
    )
    # The same conversation as chat messages gives the same prompt and answer.
    chat = c.chat.completions.create(
        model=_model(served), max_tokens=4, tool_choice="none", messages=[
            question,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": calls[0].call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"},
        ],
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in
                                                 ("name", "description", "parameters")}}],
        **GREEDY,
    )
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


def test_a_streamed_function_call_arrives_as_call_events(served: ServerHandle) -> None:
    """Through the SDK's ``responses.stream`` helper, which rebuilds the response from the
    events and refuses a stream whose events do not add up."""
    with client(served).responses.stream(
        model=_model(served), input="Weather in Oslo?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and set(json.loads(done[0].arguments)) == {"city"}
    assert events[-1].type == "response.completed" and final.status == "completed"
    call = final.output[0]
    assert call.type == "function_call" and call.arguments == done[0].arguments


@pytest.mark.parametrize(("field", "value"), [("store", True), ("previous_response_id", "r1")])
def test_responses_refuses_what_needs_a_stored_response(
    served: ServerHandle, field: str, value: Any
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client(served).responses.create(model=_model(served), input="Hi", **{field: value})
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == field
    assert "stores no" in body["message"]


def test_tokenize_round_trips_through_detokenize(served: ServerHandle) -> None:
    text = "Hello, world! café"
    r = _post(served, "/tokenize", {"model": _model(served), "prompt": text,
                                    "add_special_tokens": False, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == CONTEXT
    assert len(body["token_strs"]) == body["count"]
    back = _post(served, "/detokenize", {"model": _model(served), "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_messages_counts_what_chat_prompts_with(served: ServerHandle) -> None:
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    r = _post(served, "/tokenize", {"messages": messages})
    chat = _chat_text(served, messages, 1)
    assert r.status_code == 200 and r.json()["count"] == chat.usage.prompt_tokens
    assert r.json()["token_strs"] is None


def test_token_routes_need_a_key_and_valid_ids(served: ServerHandle) -> None:
    assert _post(served, "/tokenize", {"prompt": "x"}, tenant=None).status_code == 401
    assert _post(served, "/detokenize", {"tokens": [1]}, tenant=None).status_code == 401
    bad = _post(served, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = _post(served, "/tokenize", {"model": "nope", "prompt": "x"})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["message"] == "model: is not served here (see GET /v1/models)"


def test_embeddings_are_refused_by_name(served: ServerHandle) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client(served).embeddings.create(model=_model(served), input="hello")
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "embeddings_not_supported"
    assert "decoder language model" in body["message"]
    assert _post(served, "/v1/embeddings", {"input": "x"}, tenant=None).status_code == 401


def test_metrics_on_http_serves_the_prometheus_page(served: ServerHandle, srv: ServerHandle
                                                    ) -> None:
    _chat_text(served, [{"role": "user", "content": "count me"}], 1)
    root = base_url(served).removesuffix("/v1")
    page = httpx.get(root + "/metrics", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    served_line = 'kvfence_requests_total{code="OK",front="http",method="chat.completions",tenant="acme"}'
    assert served_line in page.text
    off = httpx.get(base_url(srv).removesuffix("/v1") + "/metrics", timeout=30)
    assert off.status_code == 404  # without --metrics-on-http
