"""The tenants file's ``[shared_prefixes]`` in the engine: tokenized, published, and kept in
step with each reload.

A declared text is tokenized as a ``text`` prompt is (special tokens added the same way), so
a request whose text begins with it begins with its tokens, provided the text ends where the
tokenizer cannot merge across (a newline, say). Only its full KV pages are shared; they are
computed once on the engine thread (``Engine.publish_shared``) and read by the tenants that
list its name, on base-model requests without a cache salt (kvcache/shared_prefix.py). A
chat prompt starts with the chat template's markup, which a declared text never produces
(special tokens are never parsed out of text), so shared prefixes serve text and token-id
prompts.

The pages the shared prefixes may hold are fixed at start, before the tenants' KV shares are
cut from the pool: twice what the declared texts take, so each can be replaced while its old
pages are still read. A reload that needs more is refused for that prefix (logged; the rest
of the file applies). Names and sizes are logged, never the text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Mapping, Sequence

from structlog.typing import FilteringBoundLogger

from service.admission.prompt import TokenizerLike
from service.engine import SharedPublish
from service.protocols import EngineLike


def shared_prefix_ids(
    texts: Mapping[str, str], tokenizer: TokenizerLike
) -> dict[str, list[int]]:
    """Each declared text's token ids, as a ``text`` prompt's."""
    return {name: tokenizer.encode(text, True) for name, text in texts.items()}


def shared_page_budget(ids: Mapping[str, Sequence[int]], page_size: int) -> int:
    """The pages the shared prefixes may hold: twice the full pages of the declared ones."""
    return 2 * sum(len(t) // page_size for t in ids.values())


class SharedPrefixPublisher:
    """Publishes what the tenants file declares and withdraws what it no longer does."""

    def __init__(
        self, engine: EngineLike, tokenizer: TokenizerLike, log: FilteringBoundLogger
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._log = log
        self._texts: dict[str, str] = {}  # what was sent to the engine
        self._failed: set[str] = set()  # published but refused or failed: sent again
        self._pending: list[concurrent.futures.Future[SharedPublish]] = []

    def apply(self, texts: Mapping[str, str]) -> None:
        """Withdraw the names ``texts`` lacks, publish the new and changed ones. Engine
        commands run in order, so they take effect before any tenant policy sent after."""
        for name in sorted(set(self._texts) - set(texts)):
            self._engine.withdraw_shared(name)
            self._log.info("shared_prefix.withdrawn", name=name)
        for name, text in sorted(texts.items()):
            if self._texts.get(name) == text and name not in self._failed:
                continue
            self._failed.discard(name)
            future = self._engine.publish_shared(name, self._tokenizer.encode(text, True))
            future.add_done_callback(functools.partial(self._done, name))
            self._pending.append(future)
        self._texts = dict(texts)
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
