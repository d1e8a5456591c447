"""The grammar compiler for the served model's vocabulary (structured outputs and
constrained tool choices); requests compile with it in ``service/structured/request_grammar.py``.
"""

from __future__ import annotations

from typing import Protocol

from service.structured.compile_executor import CompileExecutor
from service.structured.grammar import (
    GrammarCompiler,
    GrammarLimits,
    Vocabulary,
)


class VocabTokenizer(Protocol):
    bos_token_id: int | None

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def id_to_token_bytes(self, token_id: int) -> bytes: ...
    def special_ids(self) -> frozenset[int]: ...


def build_grammar_compiler(
    tokenizer: VocabTokenizer,
    vocab_size: int,
    extra_eos_ids: tuple[int, ...] = (),
    limits: GrammarLimits | None = None,
    executor: CompileExecutor | None = None,
) -> GrammarCompiler:
    """A compiler for the model's vocabulary (``vocab_size`` = the logits width), compiling
    on ``executor`` (None: in the caller's thread)."""

    def token_bytes(i: int) -> bytes:
        try:
            return tokenizer.id_to_token_bytes(i)
        except (KeyError, IndexError, ValueError):
            return b""  # padded logits columns beyond the tokenizer

    vocab = Vocabulary(
        token_bytes=[token_bytes(i) for i in range(vocab_size)],
        eos_token_ids=tuple(sorted(set(tokenizer.eos_token_ids) | set(extra_eos_ids))),
        bos_token_id=tokenizer.bos_token_id,
        special_token_ids=tuple(sorted(i for i in tokenizer.special_ids() if i < vocab_size)),
        encode=lambda text: tokenizer.encode(text, False),
    )
    return GrammarCompiler(vocab, limits or GrammarLimits(), executor)
