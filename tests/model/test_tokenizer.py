"""The Tokenizer wrapper: raw token bytes, special ids, BOS handling."""

from __future__ import annotations

from service.model import LoadedModel
from tools.parity.corpus import tokenizer_corpus


def test_token_bytes_concatenate_to_utf8_text(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    for text in tokenizer_corpus():
        ids = tok.encode(text)
        assert b"".join(tok.id_to_token_bytes(i) for i in ids) == text.encode("utf-8")


def test_token_bytes_can_split_a_character(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    ids = tok.encode("🚀")
    pieces = [tok.id_to_token_bytes(i) for i in ids]
    assert b"".join(pieces) == "🚀".encode()
    assert len(ids) > 1  # a 4-byte character spread over byte tokens


def test_special_ids_are_control_tokens(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    specials = tok.special_ids()
    assert {0, 1, 2} <= specials
    assert all(tok.id_to_token_bytes(i).startswith(b"<") for i in specials)
    assert tok.encode("hello") and not set(tok.encode("hello")) & specials
    assert tok.vocab_size == 49152


def test_add_special_tokens_follows_gguf_add_bos_flag(default_model: LoadedModel) -> None:
    # SmolLM2's GGUF says add_bos_token = false.
    tok = default_model.tokenizer
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
