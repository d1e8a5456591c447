"""GGUF tokenizers: SentencePiece vocabularies against sentencepiece itself, and the BPE split
each ``tokenizer.ggml.pre`` name stands for."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Protocol

import pytest
from tokenizers import Regex, pre_tokenizers

from service.model.gguf_tokenizer import GGUFVocab, build_gguf_tokenizer
from service.model.load_error import ModelLoadError
from service.model.pretokenizers import SPLITS, byte_level_pre_tokenizer
from service.model.tokenizer import Tokenizer
from tools.parity.corpus import tokenizer_corpus

spm = pytest.importorskip("sentencepiece")

_TRAIN = (
    "The quick brown fox jumps over the lazy dog. Numbers 12345 and 67890 appear often.\n"
    "Multi-tenant inference servers batch requests; pages are recycled with care.\n"
    "    def f(x):\n        return x * 2\n"
    "Größe naïve café résumé. Ελληνικά γράμματα. Кириллица и пробелы.\n"
    "Spaces  between   words    vary. Tabs\tand\nnewlines too. <sep> marks a break.\n"
) * 40

# Text the vocabulary was not trained on forces byte fallback (CJK, emoji, control bytes).
_TEXTS = [
    *tokenizer_corpus(),
    "fox 123456789 4.5e-3",
    "日本語 🚀 👩‍👩‍👧‍👦 \x07\x1b",
    "  two leading spaces, trailing two  ",
    "a<sep>b <sep> c",
]

# SentencePiece piece kinds as llama.cpp's converter writes them (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class SentencePiece(Protocol):
    """The part of sentencepiece's ``SentencePieceProcessor`` these tests call (the package
    ships no type information)."""

    def get_piece_size(self) -> int: ...
    def is_unknown(self, i: int) -> bool: ...
    def is_control(self, i: int) -> bool: ...
    def is_byte(self, i: int) -> bool: ...
    def is_unused(self, i: int) -> bool: ...
    def id_to_piece(self, i: int) -> str: ...
    def piece_to_id(self, piece: str) -> int: ...
    def get_score(self, i: int) -> float: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def _train(tmp_path: Path, *, dummy_prefix: bool) -> SentencePiece:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_TRAIN.splitlines(keepends=True)),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix,
        user_defined_symbols=["<sep>"],
        split_digits=False,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    processor: SentencePiece = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return processor


def _vocab(sp: SentencePiece, *, dummy_prefix: bool, scores: bool = True) -> GGUFVocab:
    """The tokenizer.ggml.* fields llama.cpp's converter writes for a SentencePiece model."""
    n = sp.get_piece_size()

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return _UNKNOWN
        if sp.is_control(i):
            return _CONTROL
        if sp.is_byte(i):
            return _BYTE
        if sp.is_unused(i):
            return _UNUSED
        return _USER_DEFINED if sp.id_to_piece(i) == "<sep>" else _NORMAL

    return GGUFVocab(
        model="llama",
        pre="default",
        tokens=[sp.id_to_piece(i) for i in range(n)],
        token_types=[kind(i) for i in range(n)],
        scores=[sp.get_score(i) for i in range(n)] if scores else [],
        merges=[],
        special_token_ids=[0, 1, 2],
        bos_token_id=1,
        eos_token_id=2,
        unk_token_id=0,
        add_bos_token=None,
        add_eos_token=False,
        add_space_prefix=dummy_prefix,
    )


def _tokenizer(vocab: GGUFVocab) -> Tokenizer:
    return Tokenizer(build_gguf_tokenizer(vocab), bos_token_id=1, eos_token_ids=(2,))


@pytest.mark.parametrize("dummy_prefix", [True, False])
def test_a_sentencepiece_vocab_encodes_and_decodes_like_sentencepiece(
    tmp_path: Path, dummy_prefix: bool
) -> None:
    sp = _train(tmp_path, dummy_prefix=dummy_prefix)
    tok = _tokenizer(_vocab(sp, dummy_prefix=dummy_prefix))
    fallbacks = 0
    for text in _TEXTS:
        if dummy_prefix and "<sep>" in text:
            continue  # llama.cpp prefixes text after an added token too: see the test below
        want = sp.encode(text)
        # As message content, control-token text ("</s>") is plain text, as sentencepiece sees it.
        assert tok.encode_chat([(text, True)]) == want, repr(text)
        if not any(t in text for t in ("<s>", "</s>", "<unk>")):
            assert tok.encode(text) == want, repr(text)
        assert tok.decode(want) == sp.decode(want), repr(text)
        fallbacks += sum(sp.is_byte(i) for i in want)
    assert fallbacks > 20  # the set exercises byte fallback, not just in-vocabulary text


def test_without_scores_the_file_order_is_the_merge_order(tmp_path: Path) -> None:
    # sentencepiece's BPE scores a piece by its rank; a file that drops the scores still
    # tokenizes the same when the pieces stay in rank order.
    sp = _train(tmp_path, dummy_prefix=True)
    tok = _tokenizer(_vocab(sp, dummy_prefix=True, scores=False))
    for text in _TEXTS:
        if "<sep>" in text:
            continue  # llama.cpp prefixes text after an added token too
        want = sp.encode(text)
        assert tok.encode_chat([(text, True)]) == want, repr(text)


def test_sentencepiece_token_bytes_concatenate_to_the_text(tmp_path: Path) -> None:
    sp = _train(tmp_path, dummy_prefix=False)
    tok = _tokenizer(_vocab(sp, dummy_prefix=False))
    for text in _TEXTS:
        ids = tok.encode(text)
        assert b"".join(tok.id_to_token_bytes(i) for i in ids) == text.encode("utf-8")
    emoji = tok.encode("🚀")
    assert len(emoji) == 4 and [tok.id_to_token_bytes(i) for i in emoji] == [
        bytes([b]) for b in "🚀".encode()
    ]


def test_bos_follows_the_add_bos_key_and_llama_cpps_default(tmp_path: Path) -> None:
    sp = _train(tmp_path, dummy_prefix=True)
    vocab = _vocab(sp, dummy_prefix=True)
    ids = sp.encode("fox")
    assert _tokenizer(vocab).encode("fox", add_special_tokens=True) == [1, *ids]
    off = dataclasses.replace(vocab, add_bos_token=False)
    assert _tokenizer(off).encode("fox", add_special_tokens=True) == ids
    eos = dataclasses.replace(vocab, add_bos_token=False, add_eos_token=True)
    assert _tokenizer(eos).encode("fox", add_special_tokens=True) == [*ids, 2]


def test_control_tokens_are_special_and_user_defined_ones_match_whole(tmp_path: Path) -> None:
    sp = _train(tmp_path, dummy_prefix=False)
    tok = _tokenizer(_vocab(sp, dummy_prefix=False))
    sep = sp.piece_to_id("<sep>")
    assert tok.encode("x<sep>y").count(sep) == 1
    assert sep not in tok.special_ids() and {0, 1, 2} <= tok.special_ids()
    assert tok.encode("</s>") == [2]


def test_with_a_space_prefix_text_after_an_added_token_gets_one_as_in_llama_cpp(
    tmp_path: Path,
) -> None:
    sp = _train(tmp_path, dummy_prefix=True)
    tok = _tokenizer(_vocab(sp, dummy_prefix=True))
    sep = sp.piece_to_id("<sep>")
    assert tok.encode("fox<sep>fox") == [*sp.encode("fox"), sep, *sp.encode("fox")]


def test_an_unknown_tokenizer_model_is_refused_by_name(tmp_path: Path) -> None:
    vocab = _vocab(_train(tmp_path, dummy_prefix=True), dummy_prefix=True)
    with pytest.raises(ModelLoadError, match="'bert'"):
        build_gguf_tokenizer(dataclasses.replace(vocab, model="bert"))


# name -> (text, the pieces llama.cpp's split gives), one name per distinct rule
_SPLIT_CASES = {
    "llama-bpe": ("abc 1234567 don'T", ["abc", " ", "123", "456", "7", " don", "'T"]),
    "qwen2": ("abc 1234 x", ["abc", " ", "1", "2", "3", "4", " x"]),
    "gpt-2": ("abc 1234  x", ["abc", " 1234", " ", " x"]),
    "starcoder": ("abc 1234 x", ["abc", " ", "1", "2", "3", "4", " x"]),
    "smollm": ("ab12", ["ab", "1", "2"]),
    "falcon": ("a,b 12345", ["a", ",", "b", " ", "123", "45"]),
    "deepseek-llm": ("ab 中文\n12", ["ab", " ", "中文", "\n", "12"]),
    "deepseek-coder": ("ab 中文12", ["ab", " ", "中文", "1", "2"]),
    "deepseek-v3": ("1234 日本", ["123", "4", " ", "日本"]),
    "tekken": ("HelloWorld 12", ["Hello", "World", " ", "1", "2"]),
    "command-r": ("x 42", ["x", " ", "4", "2"]),
    "bloom": ("a b,c", ["a", " b", ",", "c"]),
}


@pytest.mark.parametrize("name", sorted(_SPLIT_CASES))
def test_each_pre_name_splits_text_with_its_own_rule(name: str) -> None:
    text, want = _SPLIT_CASES[name]
    split = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in SPLITS[name]]
    )
    assert [piece for piece, _ in split.pre_tokenize_str(text)] == want


def test_every_listed_pre_name_builds() -> None:
    for name in SPLITS:
        byte_level_pre_tokenizer(name).pre_tokenize_str("Hello, world 123!")


@pytest.mark.parametrize("name", ["gpt2", "mystery-bpe", "default", None])
def test_an_unknown_or_missing_pre_name_is_refused_by_name(name: str | None) -> None:
    with pytest.raises(ModelLoadError, match=repr(name or "missing")):
        byte_level_pre_tokenizer(name)
