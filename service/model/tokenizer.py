"""The tokenizer the rest of the service sees: a thin wrapper over ``tokenizers.Tokenizer``.

Every encode goes through ``encode_batch``: the Rust side releases the GIL for the whole call
there, while ``encode`` holds it, so one long text would stall the event loop and the engine
thread for as long as it takes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import cache

import tokenizers

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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


def _content_spans(parts: Sequence[tuple[str, bool]]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    at = 0
    for text, is_content in parts:
        if is_content and text:
            spans.append((at, at + len(text)))
        at += len(text)
    return spans


def _overlaps(offset: tuple[int, int], spans: Sequence[tuple[int, int]]) -> bool:
    start, end = offset
    return any(start < hi and lo < end for lo, hi in spans)


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
        # NOTE: a second backend that spells special-token text as plain text, for chat message
        # content; a copy, because the flag lives on the (shared, multi-threaded) tokenizer.
        self._plain = tokenizers.Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self._token_bytes = self._build_token_bytes({i: tok.content for i, tok in added.items()})

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token text in it becomes control tokens."""
        batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def encode_chat(self, parts: Sequence[tuple[str, bool]]) -> list[int]:
        """Token ids of a rendered chat given as ``(text, is_content)`` pieces in order.

        The template's markup may spell control tokens (``<|im_start|>``); message content
        never does: text in it that looks like a control token is encoded as plain text, so
        a relayed message cannot forge a turn. When no control token overlaps content (every
        ordinary chat) the ids are exactly those of encoding the whole text at once.
        """
        text = "".join(t for t, _ in parts)
        whole = self._backend.encode_batch([text], add_special_tokens=False)[0]
        spans = _content_spans(parts)
        forged = any(
            i in self._special and _overlaps(offset, spans)
            for i, offset in zip(whole.ids, whole.offsets, strict=True)
        )
        if not forged:
            return list(whole.ids)
        markup = [t for t, is_content in parts if not is_content]
        content = [t for t, is_content in parts if is_content]
        markup_ids = iter(self._backend.encode_batch(markup, add_special_tokens=False))
        content_ids = iter(self._plain.encode_batch(content, add_special_tokens=False))
        out: list[int] = []
        for _, is_content in parts:
            out.extend(next(content_ids if is_content else markup_ids).ids)
        return out

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
        model = json.loads(self._backend.to_str()).get("model", {})
        pieces = model.get("type") == "BPE" and bool(model.get("byte_fallback"))
        out = [b""] * self.vocab_size
        for token, i in vocab.items():
            if i >= self.vocab_size:
                continue
            if pieces:
                # SentencePiece: ``▁`` is a space and ``<0xNN>`` one raw byte. Spelled here, not
                # by the decoder, which would strip the leading space of every lone piece.
                byte = _BYTE_PIECE.fullmatch(token)
                out[i] = (
                    bytes([int(byte[1], 16)]) if byte else token.replace("\u2581", " ").encode()
                )
            elif all(ch in table for ch in token):
                out[i] = bytes(table[ch] for ch in token)
            else:  # neither: let the decoder spell it
                out[i] = str(self._backend.decode([i], skip_special_tokens=False)).encode("utf-8")
        for i, content in added.items():
            if i < self.vocab_size:
                out[i] = content.encode("utf-8")
        return out
