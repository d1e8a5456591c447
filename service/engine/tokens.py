"""What the engine needs of the tokenizer and model config, in one small object."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class TokenizerLike(Protocol):
    """The subset of ``service.model.Tokenizer`` the engine uses."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def id_to_token_bytes(self, token_id: int) -> bytes: ...

    def special_ids(self) -> frozenset[int]: ...


class TokenSource:
    """Vocabulary facts for validation, stopping and detokenizing.

    ``vocab_size`` is the model's logits width (token ids outside it are invalid input).
    EOS ids are the union of the tokenizer's and the model config's. Token bytes are
    memoised: the detokenizer asks for the same few thousand tokens over and over.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        vocab_size: int,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(set(tokenizer.eos_token_ids) | set(extra_eos_ids)))
        self.special_ids = frozenset(tokenizer.special_ids())
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            try:
                cached = self._tokenizer.id_to_token_bytes(token_id)
            except (KeyError, IndexError, ValueError):
                cached = b""  # padded vocab rows beyond the tokenizer have no text
            self._bytes[token_id] = cached
        return cached
