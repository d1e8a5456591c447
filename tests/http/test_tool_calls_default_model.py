"""Tool calls on the default model (SmolLM2-135M) through the official ``openai`` SDK, with
a Pydantic model's schema as Pydantic writes it (a nested model in ``$defs``, no
``additionalProperties``): every ``required`` call closes and validates, named and ``auto``
calls are served. Twenty different requests, greedy; a 135M model can loop inside a string
value, which the call's grammar ends at ``MAX_STRING_CHARS``, within ``max_tokens``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from pydantic import BaseModel

from service.model import LoadedModel
from service.serve.kvfence_server import ServerOptions
from tests.http.conftest import client
from tests.serverutil import TEST_SIZING, ServerHandle, TenantSpec, running_server

pytestmark = pytest.mark.slow

PEOPLE = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov"]
CITIES = ["London", "Paris", "Tokyo", "Lima"]
ASKS = [f"Book a table for {n} guests under the name {p} in {c}."
        for (p, c), n in zip(((p, c) for c in CITIES for p in PEOPLE), range(2, 22), strict=True)]


class Place(BaseModel):
    city: str
    country: str


class Booking(BaseModel):
    name: str
    guests: int
    place: Place


@pytest.fixture(scope="module")
def srv(served_model: LoadedModel) -> Iterator[ServerHandle]:
    sizing = replace(TEST_SIZING, kv_memory="256MiB", max_model_len=2048)
    with running_server(served_model, {"acme": TenantSpec(max_concurrent_streams=8)},
                        sizing=sizing, options=ServerOptions(http_port=0)) as handle:
        yield handle


def _tool() -> Any:
    """``Booking.model_json_schema()`` as sent without strict mode (``pydantic_function_tool``
    would close it first)."""
    parameters = Booking.model_json_schema()
    assert "$defs" in parameters and "additionalProperties" not in str(parameters)
    return {"type": "function", "function": {"name": "book", "parameters": parameters}}


def _ask(srv: ServerHandle, choice: Any, ask: str) -> Any:
    return client(srv).with_options(timeout=600).chat.completions.create(
        model=str(srv.stack.model.name), messages=[{"role": "user", "content": ask}],
        tools=[_tool()], tool_choice=choice, parallel_tool_calls=False, max_tokens=1536,
        temperature=0)


def test_twenty_required_calls_close_and_validate_against_the_pydantic_model(
    srv: ServerHandle,
) -> None:
    assert len(set(ASKS)) == 20
    for ask in ASKS:
        choice = _ask(srv, "required", ask).choices[0]
        assert choice.finish_reason == "tool_calls", (ask, choice)
        [call] = choice.message.tool_calls
        assert call.function.name == "book"
        Booking.model_validate_json(call.function.arguments)


def test_named_and_auto_calls_are_served(srv: ServerHandle) -> None:
    named = _ask(srv, {"type": "function", "function": {"name": "book"}}, ASKS[0]).choices[0]
    [call] = named.message.tool_calls
    Booking.model_validate_json(call.function.arguments)
    auto = _ask(srv, "auto", ASKS[0]).choices[0]
    assert auto.finish_reason in ("tool_calls", "stop", "length")
    for made in auto.message.tool_calls or []:
        assert made.function.name == "book"
