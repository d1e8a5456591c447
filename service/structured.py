"""Structured outputs at the service boundary: the wire's ``ResponseFormat`` -> a compiled
grammar for the engine, compiled on the compile executor with the tenant's own cache.

Both fronts (gRPC and the OpenAI-compatible HTTP front) call ``compile_response_format``.
"""

from __future__ import annotations

from typing import Protocol

from protos.kvfence.v1 import inference_pb2
from service.engine.compile_executor import CompileExecutor
from service.engine.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarLimits,
    GrammarSpec,
    Vocabulary,
)
from service.errors import invalid_argument
from service.held_work import outlive_cancel

FIELD = "response_format"


def spec_from_proto(msg: inference_pb2.ResponseFormat) -> GrammarSpec | None:
    which = msg.WhichOneof("format")
    if which == "json_schema":
        return GrammarSpec("json_schema", msg.json_schema)
    if which == "json_object":
        return GrammarSpec("json_object") if msg.json_object else None
    if which == "regex":
        return GrammarSpec("regex", msg.regex)
    if which == "lark_grammar":
        return GrammarSpec("lark", msg.lark_grammar)
    return None


async def compile_response_format(
    compiler: GrammarCompiler | None, tenant: str, request: inference_pb2.GenerateRequest
) -> CompiledGrammar | None:
    """The request's compiled grammar, or None when it asks for none.

    Raises INVALID_ARGUMENT (field ``response_format``) with the reason when the spec is
    too large or does not compile, or when the server has no grammar support.
    """
    if not request.HasField("response_format"):
        return None
    spec = spec_from_proto(request.response_format)
    if spec is None:
        return None
    if compiler is None:
        raise invalid_argument([(FIELD, "structured outputs are not enabled on this server")])
    reason = compiler.check(spec)  # cheap refusals without a thread hop
    if reason is not None:
        raise invalid_argument([(FIELD, reason)])
    try:
        # NOTE: llguidance drops the GIL while it compiles, so the loop keeps serving.
        return await outlive_cancel(compiler.submit(tenant, spec))
    except GrammarError as err:
        raise invalid_argument([(FIELD, str(err))]) from None


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
