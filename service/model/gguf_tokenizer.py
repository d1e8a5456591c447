"""Rebuild a GGUF file's tokenizer from its ``tokenizer.ggml.*`` metadata.

Two vocabulary kinds are served, each rebuilt the way transformers converts it
(``integrations/gguf``), so both produce identical ids:

- ``gpt2``: byte-level BPE. Tokens respelled into the byte alphabet, the file's merges, and the
  split regexes the ``tokenizer.ggml.pre`` name stands for (:mod:`service.model.pretokenizers`).
- ``llama``: SentencePiece BPE (Llama 2, Mistral, Gemma). Spaces are ``▁``, a character outside
  the vocabulary becomes its UTF-8 bytes as ``<0xNN>`` tokens, and pieces merge best-first.
  The file has no merge list: merges are rebuilt from the vocabulary, every split of a token
  into two tokens, ranked by the merged token's score (SentencePiece's own priority). Where
  the scores carry no order (Gemma's files give every normal piece the same score) the
  tokens' order in the file is the merge order, as it is in the SentencePiece model they came from.

Control tokens become special tokens, user-defined ones plain added tokens (matched whole).
Any other ``tokenizer.ggml.model`` is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, decoders, models, normalizers, processors
from tokenizers import Tokenizer as HFTokenizer

from service.model.load_error import ModelLoadError
from service.model.pretokenizers import IGNORE_MERGES, byte_level_pre_tokenizer
from service.model.tokenizer import bytes_to_unicode

# llama.cpp's token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_NOT_MERGED = frozenset((_UNKNOWN, _CONTROL, _UNUSED, _BYTE))
_SPACE = "\u2581"


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """What a GGUF file says about its tokenizer (``tokenizer.ggml.*``)."""

    model: str
    pre: str | None
    tokens: Sequence[str]
    token_types: Sequence[int]  # empty when the file has none: every token is normal
    scores: Sequence[float]  # empty when the file has none
    merges: Sequence[str]
    special_token_ids: Sequence[int]  # bos/eos/unk/pad ids the file names
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool | None  # None: the file does not say (llama.cpp's default applies)
    add_eos_token: bool
    add_space_prefix: bool | None  # SentencePiece only; None: llama.cpp's default (True)

    def kind(self, i: int) -> int:
        return self.token_types[i] if i < len(self.token_types) else _NORMAL

    @property
    def adds_bos(self) -> bool:
        """llama.cpp adds BOS to SentencePiece vocabularies and to llama3-style BPE ones
        unless the file says otherwise."""
        if self.add_bos_token is not None:
            return self.add_bos_token
        return self.model == "llama" or self.pre in IGNORE_MERGES


def build_gguf_tokenizer(vocab: GGUFVocab) -> HFTokenizer:
    """The ``tokenizers`` backend for ``vocab``; :class:`ModelLoadError` for what it cannot honour."""
    if vocab.model == "gpt2":
        backend = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        backend = _sentencepiece_bpe(vocab)
    else:
        raise ModelLoadError(
            f"unsupported tokenizer.ggml.model {vocab.model!r} (supported: 'gpt2', 'llama')"
        )
    _post_process(backend, vocab)
    return backend


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **kw: object) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=merges, dropout=None, **kw)
    except Exception as e:  # tokenizers raises bare Exception on merges naming unknown tokens
        raise ModelLoadError(f"invalid tokenizer metadata ({e})") from None


def _byte_level_bpe(v: GGUFVocab) -> HFTokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(v.tokens)
    }
    pairs = [tuple(m.split(" ")) for m in v.merges]
    if any(len(p) != 2 for p in pairs):
        raise ModelLoadError("malformed tokenizer.ggml.merges entry")
    pre = byte_level_pre_tokenizer(v.pre)
    backend = HFTokenizer(
        _bpe(
            vocab,
            [(a, b) for a, b in pairs],
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=v.pre in IGNORE_MERGES,
        )
    )
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    # A token marked control that is not spelled in the byte alphabet is a converter mislabel:
    # adding it would grow the vocabulary past the model's embedding rows.
    _add_tokens(backend, v, lambda tok: set(tok) <= alphabet, lambda tok: tok)
    return backend


def _sentencepiece_bpe(v: GGUFVocab) -> HFTokenizer:
    # A SentencePiece piece spells a space as ``▁``; some converters (Gemma's) store the
    # whitespace-only pieces with real spaces, which text (respelled below) never matches.
    spelled = [
        tok.replace(" ", _SPACE) if v.kind(i) != _CONTROL else tok for i, tok in enumerate(v.tokens)
    ]
    vocab = {tok: i for i, tok in enumerate(spelled)}
    unk = None if v.unk_token_id is None else spelled[v.unk_token_id]
    backend = HFTokenizer(
        _bpe(vocab, _spm_merges(spelled, v), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix = v.add_space_prefix is not False
    # NOTE: a normalizer, not ``Metaspace``: that one skips the prefix on text that already
    # starts with a space, where SentencePiece and llama.cpp add it all the same. Like
    # llama.cpp (and Llama 2's own tokenizer.json), text after a special token gets it too.
    space = normalizers.Replace(" ", _SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), space]) if prefix else space
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_tokens(backend, v, lambda tok: True, lambda tok: tok.replace(" ", _SPACE))
    return backend


def _spm_merges(spelled: list[str], v: GGUFVocab) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens that concatenate to a mergeable token, best first."""
    vocab = {tok: i for i, tok in enumerate(spelled)}
    mergeable = [i for i in range(len(spelled)) if v.kind(i) not in _NOT_MERGED]
    normal_scores = {v.scores[i] for i in mergeable if i < len(v.scores) and v.kind(i) == _NORMAL}
    ranked = len(normal_scores) > 1

    def priority(i: int) -> tuple[bool, float, int]:
        # SentencePiece matches a user-defined piece whole: ranking them ahead of every normal
        # merge rebuilds the ones that cannot stay added tokens (respelled) from their parts.
        score = v.scores[i] if ranked and i < len(v.scores) else 0.0
        return (v.kind(i) != _USER_DEFINED, -score, i)

    mergeable.sort(key=priority)
    merges: list[tuple[str, str]] = []
    for i in mergeable:
        tok = spelled[i]
        splits = [
            (tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab
        ]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend(splits)
    return merges


def _add_tokens(
    backend: HFTokenizer,
    v: GGUFVocab,
    addable: Callable[[str], bool],
    respell: Callable[[str], str],
) -> None:
    named = set(v.special_token_ids)
    special = [
        AddedToken(tok, normalized=False, special=True)
        for i, tok in enumerate(v.tokens)
        if (v.kind(i) == _CONTROL and addable(tok)) or i in named
    ]
    backend.add_special_tokens(special)
    known = backend.get_vocab(with_added_tokens=True)
    # llama.cpp matches user-defined tokens whole in the text. One whose spelling changed
    # (Gemma's whitespace runs) is left to the merges, which rebuild it first.
    backend.add_tokens(
        [
            AddedToken(tok, normalized=False, special=False)
            for i, tok in enumerate(v.tokens)
            if v.kind(i) == _USER_DEFINED and tok in known and respell(tok) == tok
        ]
    )


def _post_process(backend: HFTokenizer, v: GGUFVocab) -> None:
    """BOS before (and EOS after) the text where the file asks for them."""
    single, pair, used = "$A:0", "$A:0 $B:1", {}
    if v.adds_bos and v.bos_token_id is not None:
        bos = v.tokens[v.bos_token_id]
        single, pair = f"{bos}:0 {single}", f"{bos}:0 {pair}"
        used[bos] = v.bos_token_id
    if v.add_eos_token:
        if v.eos_token_id is None:
            raise ModelLoadError("tokenizer.ggml.add_eos_token is set but no eos token is named")
        eos = v.tokens[v.eos_token_id]
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
        used[eos] = v.eos_token_id
    if used:
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(used.items())
        )
