"""Rebuild a byte-level BPE tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

Built the way transformers converts GGUF tokenizers (``integrations/gguf/gguf_tokenizer_mapping``),
so both produce identical ids: tokens respelled into the byte alphabet, the file's merges,
GPT-2 byte-level pre-tokenizer (or the split regex the ``tokenizer.ggml.pre`` name implies),
control tokens added as special tokens and user-defined ones as plain added tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from service.model.errors import ModelLoadError
from service.model.tokenizer import bytes_to_unicode

_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


def build_bpe_tokenizer(
    *,
    model: str,
    pre: str | None,
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    special_token_ids: Sequence[int],
    add_bos_token: bool,
    bos_token_id: int | None,
) -> HFTokenizer:
    """``special_token_ids``: bos/eos/unk/pad ids the file names, also added as special tokens."""
    if model != "gpt2":
        raise ModelLoadError(f"unsupported tokenizer model {model!r} (only byte-level BPE 'gpt2')")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ModelLoadError("malformed tokenizer.ggml.merges entry")
    try:
        bpe = models.BPE(
            vocab=vocab,
            merges=[(a, b) for a, b in pairs],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    except Exception as e:  # tokenizers raises bare Exception on merges naming unknown tokens
        raise ModelLoadError(f"invalid tokenizer metadata ({e})") from None
    backend = HFTokenizer(bpe)
    split = _SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL and set(tok) <= alphabet
    ]
    named = [AddedToken(tokens[i], normalized=False, special=True) for i in special_token_ids]
    backend.add_special_tokens(control + named)
    known = backend.get_vocab(with_added_tokens=True)
    backend.add_tokens(
        [
            AddedToken(tok, normalized=False, special=False)
            for tok, kind in zip(tokens, token_types, strict=False)
            if kind == _USER_DEFINED and tok in known
        ]
    )
    if add_bos_token and bos_token_id is not None:
        bos = tokens[bos_token_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_token_id)]
        )
    return backend
