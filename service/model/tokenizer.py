"""The tokenizer the rest of the service sees: a thin wrapper over ``tokenizers.Tokenizer``."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import tokenizers


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class Tokenizer:
    """Text <-> token ids, plus the raw bytes of each token for incremental detokenizing."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self._special = frozenset(i for i, tok in added.items() if tok.special)
        self._token_bytes = self._build_token_bytes({i: tok.content for i, tok in added.items()})

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token. Concatenating these for a sequence gives its UTF-8 text."""
        if not 0 <= token_id < len(self._token_bytes):
            raise ValueError(f"token id {token_id} out of range [0, {len(self._token_bytes)})")
        return self._token_bytes[token_id]

    def special_ids(self) -> frozenset[int]:
        return self._special

    def _build_token_bytes(self, added: dict[int, str]) -> list[bytes]:
        # NOTE: precomputed once so detokenizing a token is a list lookup, not a decode call.
        table = _unicode_to_bytes()
        vocab = self._backend.get_vocab(with_added_tokens=False)
        out = [b""] * self.vocab_size
        for token, i in vocab.items():
            if i >= self.vocab_size:
                continue
            if all(ch in table for ch in token):
                out[i] = bytes(table[ch] for ch in token)
            else:  # not byte-level (e.g. sentencepiece pieces): let the decoder spell it
                out[i] = str(self._backend.decode([i], skip_special_tokens=False)).encode("utf-8")
        for i, content in added.items():
            if i < self.vocab_size:
                out[i] = content.encode("utf-8")
        return out
