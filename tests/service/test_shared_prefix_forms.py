"""The two forms of a declared shared prefix, without a model: a text is tokenized as a
``text`` prompt, a ``system`` message is rendered by the chat template as a lone system turn
(no generation prompt) and tokenized as chats are, so a chat that goes on after it begins
with its ids. A model that cannot render it refuses it by name; on a reload the publisher
logs the refusal and publishes nothing for it."""

from __future__ import annotations

import concurrent.futures
import io
import json
from collections.abc import Sequence

import pytest

from kvcache.results import SharedPublish
from service.admission.tenants import DeclaredPrefix
from service.model.chat_template import ChatTemplate
from service.model.chat_templates import GEMMA3_CHAT_TEMPLATE
from service.serve.shared_prefixes import (
    SharedPrefixError,
    SharedPrefixPublisher,
    declared_ids,
    shared_prefix_ids,
)
from service.telemetry.logs import make_logger
from tests.fixtures.tiny_models import CHATML_TEMPLATE

SYSTEM = "You are the help desk of Example Inc."


class _Bytes:
    """Token ids are the UTF-8 bytes (a BOS of 1 before a text prompt's)."""

    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] * add_special_tokens + list(text.encode())

    def encode_chat(self, parts: Sequence[tuple[str, bool]]) -> list[int]:
        return [b for text, _ in parts for b in text.encode()]

    def id_to_token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])


class _Engine:
    def __init__(self) -> None:
        self.published: list[tuple[str, list[int]]] = []

    def publish_shared(
        self, name: str, token_ids: Sequence[int]
    ) -> concurrent.futures.Future[SharedPublish]:
        self.published.append((name, list(token_ids)))
        future: concurrent.futures.Future[SharedPublish] = concurrent.futures.Future()
        future.set_result(SharedPublish(True, seq_id=f"@shared:{name}", token_ids=tuple(token_ids)))
        return future

    def withdraw_shared(self, name: str) -> None:
        pass


def test_a_text_is_a_text_prompt_and_a_system_message_a_chats_first_turn() -> None:
    tok, chatml = _Bytes(), ChatTemplate(CHATML_TEMPLATE)
    assert declared_ids("t", DeclaredPrefix(SYSTEM), tok, chatml) == tok.encode(SYSTEM, True)
    ids = declared_ids("s", DeclaredPrefix(SYSTEM, system=True), tok, chatml)
    assert bytes(ids).decode() == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    chat = chatml.render_parts(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}], True
    )
    assert tok.encode_chat(chat)[: len(ids)] == ids


@pytest.mark.parametrize(
    ("template", "reason", "words"),
    [
        (None, "no_chat_template", "the served model has no chat template"),
        (GEMMA3_CHAT_TEMPLATE, "system_not_rendered", "does not render a lone system message"),
        ("{{ raise_exception('no system turns here') }}", "template_refused",
         "refused a lone system message: chat template error: no system turns here"),
    ],
)
def test_a_system_message_the_model_cannot_render_is_refused_by_name(
    template: str | None, reason: str, words: str
) -> None:
    chat = None if template is None else ChatTemplate(template, {"bos_token": "<bos>"})
    declared = {"plain": DeclaredPrefix(SYSTEM), "helpdesk": DeclaredPrefix(SYSTEM, system=True)}
    with pytest.raises(SharedPrefixError) as err:
        shared_prefix_ids(declared, _Bytes(), chat)
    assert err.value.reason == reason
    message = str(err.value)
    assert message.startswith("tenants file: shared prefix 'helpdesk': ") and words in message
    assert "\n" not in message and SYSTEM not in message
    assert shared_prefix_ids({"plain": declared["plain"]}, _Bytes(), chat) == {
        "plain": _Bytes().encode(SYSTEM, True)
    }


def test_the_publisher_logs_a_refused_form_and_republishes_a_changed_one() -> None:
    out = io.StringIO()
    engine = _Engine()
    publisher = SharedPrefixPublisher(engine, _Bytes(), make_logger("json", out), None)
    publisher.apply({"helpdesk": DeclaredPrefix(SYSTEM, system=True), "plain": DeclaredPrefix("x")})
    assert [name for name, _ in engine.published] == ["plain"]
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    refused = [line for line in lines if line["event"] == "shared_prefix.refused"]
    assert refused == [{**refused[0], "name": "helpdesk", "reason": "no_chat_template"}]
    assert SYSTEM not in out.getvalue()
    chatml = SharedPrefixPublisher(engine, _Bytes(), make_logger("json", io.StringIO()),
                                   ChatTemplate(CHATML_TEMPLATE))
    engine.published.clear()
    chatml.apply({"helpdesk": DeclaredPrefix(SYSTEM, system=True)})
    chatml.apply({"helpdesk": DeclaredPrefix(SYSTEM, system=True)})  # unchanged: nothing sent
    chatml.apply({"helpdesk": DeclaredPrefix(SYSTEM)})  # the other form: published again
    assert [bytes(ids[1:] if ids[0] == 1 else ids).decode() for _, ids in engine.published] == [
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", SYSTEM,
    ]
