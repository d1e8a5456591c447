"""The tenants file's ``[shared_prefixes]`` in the engine: tokenized, published, and kept in
step with each reload.

A declared text is tokenized as a ``text`` prompt is (special tokens added the same way), so
a request whose text begins with it begins with its tokens, provided the text ends where the
tokenizer cannot merge across (a newline, say). A declared ``system`` message is rendered as
a chat holding that one system message, without a generation prompt, by the served model's
chat template, and tokenized as the prompt path tokenizes chats
(``service.admission.prompt``: ``template_messages``, ``render_parts``, ``encode_chat``), so
a chat whose first message is that system message begins with its tokens wherever the
template renders the first turn the same whatever follows it (a template that does not is a
miss, never wrong KV: matching compares tokens). A model without a chat template refuses the
``system`` form by name, at start and on a reload. Only full KV pages are shared; they are
computed once on the engine thread (``Engine.publish_shared``) and read by the tenants that
list its name, on base-model requests without a cache salt (kvcache/shared_prefix.py).

The pages the shared prefixes may hold are fixed at start, before the tenants' KV shares are
cut from the pool: twice what the declared prefixes take, so each can be replaced while its
old pages are still read. A reload that needs more is refused for that prefix (logged; the
rest of the file applies). Names and sizes are logged, never the text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Mapping, Sequence

from structlog.typing import FilteringBoundLogger

from protos.kvfence.v1 import inference_pb2
from service.admission.prompt import ChatTemplateLike, TokenizerLike
from service.admission.tenants import DeclaredPrefix
from service.engine import SharedPublish
from service.protocols import EngineLike
from service.structured import tools


class SharedPrefixError(ValueError):
    """A declared prefix the served model cannot render; the message names it, in one line.
    ``reason``: ``no_chat_template``, ``template_refused`` or ``system_not_rendered``."""

    def __init__(self, name: str, reason: str, message: str) -> None:
        super().__init__(f"tenants file: shared prefix {name!r}: {message}")
        self.reason = reason


def declared_ids(
    name: str,
    declared: DeclaredPrefix,
    tokenizer: TokenizerLike,
    template: ChatTemplateLike | None,
) -> list[int]:
    """The token ids a request beginning with ``declared`` begins with: a ``text`` prompt's,
    or a chat's whose first message is the declared system message. Raises
    ``SharedPrefixError``."""
    if not declared.system:
        return tokenizer.encode(declared.text, True)
    if template is None:
        raise SharedPrefixError(
            name, "no_chat_template",
            "declares a chat system message and the served model has no chat template",
        )
    chat = inference_pb2.ChatMessages(
        messages=[inference_pb2.ChatMessage(role="system", content=declared.text)]
    )
    messages, tool_list = tools.template_messages(chat, template.native_tools)
    try:
        parts = template.render_parts(messages, False, tool_list)
    except ValueError as err:  # ChatTemplateError: the template's own complaint
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SharedPrefixError(
            name, "template_refused", f"the chat template refused a lone system message: {first}"
        ) from None
    if not any(is_content for _, is_content in parts):
        raise SharedPrefixError(
            name, "system_not_rendered",
            "the chat template does not render a lone system message (it keeps it for the "
            "first user turn); declare it as a text instead",
        )
    return tokenizer.encode_chat(parts)


def shared_prefix_ids(
    declared: Mapping[str, DeclaredPrefix],
    tokenizer: TokenizerLike,
    template: ChatTemplateLike | None = None,
) -> dict[str, list[int]]:
    """Each declared prefix's token ids (``declared_ids``). Raises ``SharedPrefixError``."""
    return {name: declared_ids(name, d, tokenizer, template) for name, d in declared.items()}


def shared_page_budget(ids: Mapping[str, Sequence[int]], page_size: int) -> int:
    """The pages the shared prefixes may hold: twice the full pages of the declared ones."""
    return 2 * sum(len(t) // page_size for t in ids.values())


class SharedPrefixPublisher:
    """Publishes what the tenants file declares and withdraws what it no longer does."""

    def __init__(
        self,
        engine: EngineLike,
        tokenizer: TokenizerLike,
        log: FilteringBoundLogger,
        template: ChatTemplateLike | None = None,
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._template = template
        self._log = log
        self._declared: dict[str, DeclaredPrefix] = {}  # what was sent to the engine
        self._failed: set[str] = set()  # published but refused or failed: sent again
        self._pending: list[concurrent.futures.Future[SharedPublish]] = []

    def apply(self, declared: Mapping[str, DeclaredPrefix]) -> None:
        """Withdraw the names ``declared`` lacks, publish the new and changed ones. Engine
        commands run in order, so they take effect before any tenant policy sent after. A
        prefix the model cannot render is logged by name and keeps what it had."""
        for name in sorted(set(self._declared) - set(declared)):
            self._engine.withdraw_shared(name)
            self._log.info("shared_prefix.withdrawn", name=name)
        for name, prefix in sorted(declared.items()):
            if self._declared.get(name) == prefix and name not in self._failed:
                continue
            self._failed.discard(name)
            try:
                ids = declared_ids(name, prefix, self._tokenizer, self._template)
            except SharedPrefixError as err:
                self._failed.add(name)
                self._log.error("shared_prefix.refused", name=name, reason=err.reason)
                continue
            future = self._engine.publish_shared(name, ids)
            future.add_done_callback(functools.partial(self._done, name))
            self._pending.append(future)
        self._declared = dict(declared)
        self._pending = [f for f in self._pending if not f.done()]

    async def settled(self) -> None:
        """Wait for every publication sent so far (start-up: before serving)."""
        pending, self._pending = self._pending, []
        for future in pending:
            # The outcome is logged by _done; a failure must not stop the server.
            await asyncio.wait([asyncio.wrap_future(future)])

    def _done(self, name: str, future: concurrent.futures.Future[SharedPublish]) -> None:
        """On the engine thread: log the outcome; a refusal is sent again on the next apply."""
        err = future.exception()
        if err is not None:
            self._failed.add(name)
            self._log.error("shared_prefix.failed", name=name, error=type(err).__name__)
            return
        pub = future.result()
        if not pub.ok:
            self._failed.add(name)
            self._log.error(
                "shared_prefix.refused", name=name, reason=pub.reason,
                requested=pub.requested, limit=pub.limit,
            )
        elif pub.seq_id:
            self._log.info("shared_prefix.published", name=name, tokens=len(pub.token_ids))
