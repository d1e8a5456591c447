"""Request preparation, step 2: the input (text, token ids or chat messages) as prompt
token ids.

Its sizes were bounded in step 1 (``fields``), so the tokenizer's work is bounded; it runs
in the ``TokenizerPool`` so a long prompt never stalls the event loop and tenants take
turns. Chat message content is encoded as plain text: only the template's markup can
produce control tokens. Lengths are checked in step 3 (``limits``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from protos.kvfence.v1 import inference_pb2
from service.admission.tokenizer_pool import TokenizerPool
from service.errors import invalid_argument
from service.model.chat_template import ToolFormat
from service.structured import tools


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def encode_chat(self, parts: Sequence[tuple[str, bool]]) -> list[int]: ...
    def id_to_token_bytes(self, token_id: int) -> bytes: ...


class ChatTemplateLike(Protocol):
    native_tools: bool
    tool_format: ToolFormat

    def render_parts(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[tuple[str, bool]]: ...


def wants_generation_prompt(chat: inference_pb2.ChatMessages) -> bool:
    """``add_generation_prompt`` is true when set, and also when left unset (proto3 false)
    unless the last message is the assistant's, which asks to continue that message."""
    return chat.add_generation_prompt or chat.messages[-1].role != "assistant"


class PromptBuilder:
    """Tokenizes inputs for one model."""

    def __init__(
        self, tokenizer: TokenizerLike, chat_template: ChatTemplateLike | None, pool: TokenizerPool
    ) -> None:
        self._tok = tokenizer
        self._template = chat_template
        self._pool = pool

    @property
    def tool_format(self) -> ToolFormat | None:
        """How the model's chat template writes tool calls; None without a template."""
        return self._template.tool_format if self._template is not None else None

    async def prompt_ids(
        self,
        tenant: str,
        which: str,
        req: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest,
        add_special_tokens: bool = True,
    ) -> list[int]:
        """Token ids of an input that passed ``fields.check_input``; INVALID_ARGUMENT (field
        ``chat``) when the chat template refuses the messages."""
        if which == "token_ids":
            assert isinstance(req, inference_pb2.GenerateRequest)
            return list(req.token_ids.ids)
        if which == "text":
            text = req.text
            return await self._pool.run(tenant, lambda: self._tok.encode(text, add_special_tokens))
        assert self._template is not None
        template = self._template
        generation_prompt = wants_generation_prompt(req.chat)
        messages, tool_list = tools.template_messages(req.chat, template.native_tools)
        try:
            parts = template.render_parts(messages, generation_prompt, tool_list)
        except ValueError as exc:  # ChatTemplateError: the template's own complaint
            raise invalid_argument([("chat", f"chat template refused the messages: {exc}")]) from None
        # The rendered template already spells out its special tokens.
        return await self._pool.run(tenant, lambda: self._tok.encode_chat(parts))

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token_bytes(token_id).decode("utf-8", "replace")

    async def text_of(self, tenant: str, ids: Sequence[int]) -> str:
        """The text of ``ids``: their bytes joined, then decoded (a token may hold part of a
        character), on the tenant's share of the tokenizer pool."""
        tok = self._tok
        return await self._pool.run(
            tenant,
            lambda: b"".join(tok.id_to_token_bytes(t) for t in ids).decode("utf-8", "replace"),
        )
