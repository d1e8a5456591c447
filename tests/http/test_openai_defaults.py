"""OpenAI's defaults with the official ``openai`` SDK: a request without ``max_tokens`` runs
to the end of the context, ``--served-model-name`` names the model, and errors name HTTP
routes, not gRPC methods."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from service.serve.kvfence_server import ServerOptions
from tests.http.conftest import TENANTS, client
from tests.serverutil import ServerHandle, running_server

CONTEXT = 512  # tests.serverutil.TEST_SIZING.max_model_len
NAMES = ("smol", "tiny-chat")


@pytest.fixture(scope="module")
def named(tiny_model: Any) -> Iterator[ServerHandle]:
    options = ServerOptions(http_port=0, served_model_names=NAMES)
    with running_server(tiny_model, TENANTS, options=options) as handle:
        yield handle


def _long_message(words: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": " ".join(["hello"] * words)}]


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(named: ServerHandle) -> None:
    r = client(named).chat.completions.create(
        model="smol", messages=_long_message(100), temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens > 16
    assert r.usage.prompt_tokens + r.usage.completion_tokens == CONTEXT


def test_completion_without_max_tokens_runs_to_the_end_of_the_context(
    named: ServerHandle,
) -> None:
    prompt = [7] * 450
    r = client(named).completions.create(
        model="smol", prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == CONTEXT - len(prompt)


def test_an_unset_max_tokens_stays_within_the_tenants_tokens_per_minute(
    named: ServerHandle,
) -> None:
    """``slow_rate`` may spend 60 tokens a minute: the open-ended request is sized to fit
    that, where the context's end would be refused outright."""
    r = client(named, "slow_rate").completions.create(
        model="smol", prompt=[7] * 8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.choices[0].finish_reason == "length"
    assert 16 < r.usage.completion_tokens <= 60 - 8


def test_served_model_names_are_listed_and_answer_on_both_fronts(named: ServerHandle) -> None:
    from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc

    c = client(named)
    assert [m.id for m in c.models.list().data] == list(NAMES)
    for name in NAMES:
        r = c.chat.completions.create(
            model=name, messages=_long_message(2), max_tokens=3, temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.model == name and r.usage is not None and r.usage.completion_tokens == 3
    stub = inference_pb2_grpc.InferenceStub(named.channel())
    listed = stub.ListModels(inference_pb2.ListModelsRequest(), metadata=named.auth("acme"))
    assert [m.name for m in listed.models] == list(NAMES)
    req = inference_pb2.GenerateRequest(
        model="tiny-chat", text="hello", stopping=inference_pb2.StoppingParams(max_tokens=2)
    )
    finished = [m for m in stub.Generate(req, metadata=named.auth("acme"))
                if m.HasField("finished")]
    assert finished[0].finished.usage.completion_tokens == 2


def test_the_unknown_model_error_points_http_clients_at_get_v1_models(
    named: ServerHandle,
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client(named).chat.completions.create(
            model=str(named.stack.model.name) + "-not-served", messages=_long_message(2),
            max_tokens=2,
        )
    err = caught.value
    assert err.status_code == 400
    message = err.body["message"] if isinstance(err.body, dict) else ""
    assert message == "model: is not served here (see GET /v1/models)"
    assert "ListModels" not in str(err)


def test_shared_error_texts_name_http_routes_and_fields_on_http() -> None:
    """The texts both fronts share say what an HTTP client can do, not a gRPC method or
    field."""
    from service.admission.tenant_adapters import UNKNOWN_MODEL
    from service.errors import invalid_argument
    from service.http.error_replies import error_body

    no_template = ("chat", "the model has no chat template; send text or token_ids")
    body = error_body(invalid_argument([no_template, UNKNOWN_MODEL]))["error"]
    assert body["message"] == (
        "messages: the model has no chat template; send a prompt to /v1/completions; "
        "model: is not served here (see GET /v1/models)"
    )
    assert body["param"] == "messages"
