"""Turn a request's input (text, token ids or chat messages) into prompt token ids.

Sizes are checked before the tokenizer runs (see ``validation``); tokenization runs in the
``TokenizerPool`` so a long prompt never stalls the event loop and tenants take turns.
Chat message content is encoded as plain text: only the template's markup can produce
control tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from protos.kvfence.v1 import inference_pb2
from service import tools
from service.errors import invalid_argument
from service.limits import byte_tokens
from service.model.chat_template import ToolFormat
from service.tokenizer_pool import TokenizerPool
from service.validation import (
    ModelLimits,
    Violations,
    check_chat,
    check_prompt_ids,
    check_prompt_length,
    check_text,
    raise_if,
)


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
        self,
        tokenizer: TokenizerLike,
        chat_template: ChatTemplateLike | None,
        model: ModelLimits,
        pool: TokenizerPool,
    ) -> None:
        self._tok = tokenizer
        self._template = chat_template
        self.model = model
        self._pool = pool

    def input_cost(
        self, which: str, req: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest
    ) -> int:
        """Tokens an input that passed ``check_input`` is charged before it is tokenized."""
        if which == "token_ids":
            assert isinstance(req, inference_pb2.GenerateRequest)
            return len(req.token_ids.ids)
        if which == "text":
            return byte_tokens(len(req.text.encode("utf-8")))
        chat = req.chat
        size = sum(len(m.content.encode("utf-8")) for m in chat.messages)
        size += sum(len(c.arguments) + len(c.name) for m in chat.messages for c in m.tool_calls)
        size += sum(len(t.description) + len(t.parameters) for t in chat.tools)
        return byte_tokens(size)

    def tool_plan(self, req: inference_pb2.GenerateRequest) -> tools.ToolPlan | None:
        """How the request's output is read for tool calls; None without tools."""
        if req.WhichOneof("input") != "chat" or self._template is None:
            return None
        return tools.plan(req.chat, self._template.tool_format)

    def check_input(
        self,
        which: str | None,
        req: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest,
        token_limit: int,
        out: Violations,
    ) -> None:
        """Size checks that need no tokenizer; ``which`` is the set ``input`` oneof field."""
        if which is None:
            out.append(("input", "one of text, token_ids or chat is required"))
        elif which == "text":
            check_text(req.text, "text", token_limit, out)
        elif which == "token_ids":
            assert isinstance(req, inference_pb2.GenerateRequest)
            check_prompt_ids(
                req.token_ids.ids, "token_ids.ids", token_limit, self.model.vocab_size, out
            )
        elif which == "chat":
            check_chat(req.chat, "chat", token_limit, out)
            tools.check_tools(req.chat, "chat", out)
            if self._template is None:
                out.append(("chat", "the model has no chat template; send text or token_ids"))

    async def prompt_ids(
        self,
        tenant: str,
        which: str,
        req: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest,
        token_limit: int,
        add_special_tokens: bool = True,
    ) -> list[int]:
        """Token ids of an input that passed ``check_input``; raises INVALID_ARGUMENT if the
        tokenized prompt is empty or over ``token_limit``."""
        if which == "token_ids":
            assert isinstance(req, inference_pb2.GenerateRequest)
            return list(req.token_ids.ids)
        if which == "text":
            text = req.text
            ids = await self._pool.run(tenant, lambda: self._tok.encode(text, add_special_tokens))
        else:
            assert self._template is not None
            template = self._template
            messages, tool_list = tools.template_messages(req.chat, template.native_tools)
            try:
                parts = template.render_parts(
                    messages, wants_generation_prompt(req.chat), tool_list
                )
            except ValueError as exc:  # ChatTemplateError: the template's own complaint
                raise invalid_argument(
                    [("chat", f"chat template refused the messages: {exc}")]
                ) from None
            # The rendered template already spells out its special tokens.
            ids = await self._pool.run(tenant, lambda: self._tok.encode_chat(parts))
        out: Violations = []
        check_prompt_length(len(ids), which, token_limit, out)
        raise_if(out)
        return ids

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token_bytes(token_id).decode("utf-8", "replace")
