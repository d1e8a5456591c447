"""Request preparation is one pass with one owner: the steps run in order, each module once,
and a request refused at a step never reaches the later ones."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import pytest
from google.rpc import error_details_pb2

from protos.kvfence.v1 import inference_pb2
from service.admission.prep import RequestPrep
from service.admission.prompt import PromptBuilder
from service.admission.request_fields import ModelLimits
from service.admission.tenants import Tenant
from service.admission.tokenizer_pool import TokenizerPool
from service.engine.types import Request
from service.errors import ServiceError

MODEL = ModelLimits("m", vocab_size=300, max_model_len=64)
STEPS = ("request_fields", "prompt", "prompt_limits", "request_grammar")
STEP_MODULES = {
    "service.admission.request_fields", "service.admission.prompt",
    "service.admission.prompt_limits", "service.structured.request_grammar",
}


class ByteTokenizer:
    """One token per UTF-8 byte."""

    vocab_size = 300

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, parts: Sequence[tuple[str, bool]]) -> list[int]:
        return [b for text, _ in parts for b in text.encode("utf-8")]

    def id_to_token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id % 256])


def _prep() -> RequestPrep:
    return RequestPrep(MODEL, PromptBuilder(ByteTokenizer(), None, TokenizerPool()), None)


def _walk(request: inference_pb2.GenerateRequest) -> tuple[list[str], Request | ServiceError]:
    """The request preparation step modules entered, in order (the owner, prep.py, left
    out), and
    what preparing ``request`` gave."""
    entered: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module in STEP_MODULES:
            step = module.rsplit(".", 1)[1]
            if not entered or entered[-1] != step:
                entered.append(step)

    prep = _prep()  # built before the walk is recorded
    tenant = Tenant("acme")

    async def prepare() -> Request:
        fields = prep.read(tenant, request)
        return await prep.build(tenant, request, fields, "r1", None)

    sys.setprofile(profile)
    try:
        result: Request | ServiceError = asyncio.run(prepare())
    except ServiceError as err:
        result = err
    finally:
        sys.setprofile(None)
    return entered, result


def _request(text: str, max_tokens: int) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        text=text, stopping=inference_pb2.StoppingParams(max_tokens=max_tokens))


def test_a_request_visits_each_step_once_in_order() -> None:
    entered, result = _walk(_request("hello", 4))
    assert entered == list(STEPS)
    assert isinstance(result, Request)
    assert result.prompt_ids == tuple(b"hello") and result.stopping.max_tokens == 4


@pytest.mark.parametrize(("request_", "steps", "field"), [
    (_request("hello", 0), STEPS[:1], "stopping.max_tokens"),  # refused by its fields
    (_request("x" * 60, 10), STEPS[:3], "stopping.max_tokens"),  # by the context it leaves
])
def test_a_refused_request_stops_at_the_step_that_refused_it(
    request_: inference_pb2.GenerateRequest, steps: tuple[str, ...], field: str
) -> None:
    entered, result = _walk(request_)
    assert entered == list(steps)
    assert isinstance(result, ServiceError)
    assert result.detail(error_details_pb2.BadRequest).field_violations[0].field == field


def _built(request: inference_pb2.GenerateRequest, tenant: Tenant, to_context_end: bool,
           sequences: int = 1) -> tuple[int, Request]:
    """(max_tokens charged before tokenizing, the built request)."""
    prep = _prep()

    async def prepare() -> tuple[int, Request]:
        fields = prep.read(tenant, request, to_context_end=to_context_end, sequences=sequences)
        return fields.stopping.max_tokens, await prep.build(tenant, request, fields, "r1", None)

    return asyncio.run(prepare())


def test_an_unset_max_tokens_runs_to_the_context_end_only_when_asked() -> None:
    from service.admission.tenants import Quotas

    unset = inference_pb2.GenerateRequest(text="x" * 10)
    charged, req = _built(unset, Tenant("acme"), to_context_end=True)
    assert (charged, req.stopping.max_tokens) == (MODEL.max_model_len - 1, 64 - 10)
    assert _built(unset, Tenant("acme"), to_context_end=False)[1].stopping.max_tokens == 16
    # A set max_tokens is never changed.
    assert _built(_request("x" * 10, 5), Tenant("acme"), True)[1].stopping.max_tokens == 5
    # The tenant's tokens_per_minute bounds what one open-ended request is charged.
    slow = Tenant("slow", quotas=Quotas(tokens_per_minute=30))
    charged, req = _built(unset, slow, to_context_end=True)
    assert charged == req.stopping.max_tokens and 16 < charged < 30
    # n sequences are each charged: they share it.
    two, _ = _built(unset, slow, to_context_end=True, sequences=2)
    assert two == 15 - (30 - charged)  # the input's charge taken off each half


def test_min_tokens_past_what_the_context_leaves_is_refused_by_name() -> None:
    request = inference_pb2.GenerateRequest(
        text="x" * 40, stopping=inference_pb2.StoppingParams(min_tokens=30))
    with pytest.raises(ServiceError) as caught:
        _built(request, Tenant("acme"), to_context_end=True)
    violation = caught.value.details[0].field_violations[0]
    assert violation.field == "stopping.min_tokens" and "24 tokens" in violation.description
