"""Structured outputs: grammar specs, a per-tenant compiled-grammar cache, and the token mask.

A request may carry a ``GrammarSpec`` (a JSON schema, ``json_object``, a regex or a Lark
grammar). The service compiles it with llguidance *before* the request reaches the engine,
on a large-stack compile thread (``compile_executor``; llguidance drops the GIL while it
builds), so the engine thread never compiles. A spec nested deeper than ``GrammarLimits``
allows is refused before llguidance sees it (``grammar_depth``). A too-large or uncompilable spec is a ``GrammarError`` whose message is the reason.

The engine gives every constrained sequence its own ``GrammarMatcher`` (a copy of the
compiled template). At each step the sampler asks the constrained rows for their allowed-token
bitmask and sets every other logit to ``-inf`` before penalties, greedy or sampling, so
constrained and free rows share one batched step.

NOTE: the cache is per tenant. A shared cache would let tenant B learn from its own latency
whether tenant A had used a schema: the same side channel as a shared prefix cache.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import llguidance
import numpy as np
import torch

from service.structured.compile_executor import CompileExecutor
from service.structured.grammar_depth import (
    json_nesting,
    json_ref_depth,
    lark_depth,
    lark_json_schemas,
    parse_schema,
)

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "regex", "lark")
_JSON_OBJECT = '{"type": "object"}'
# Compact JSON: with flexible whitespace a model could emit blanks until max_tokens.
_JSON_OPTIONS: llguidance._lib.JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The spec cannot be compiled or is over a limit; the message says why (no source text).
    ``line``: the line of a Lark source the problem is on, when known (1-based)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the output must match. ``source`` is the schema's JSON text, the regex or the
    Lark grammar; it is empty for ``json_object``."""

    kind: GrammarKind
    source: str = ""
    # (line, field) pairs: a compile error on that line of a Lark ``source`` concerns that
    # request field (a tool grammar's line per tool schema). Not part of the cache key.
    line_fields: tuple[tuple[int, str], ...] = field(default=(), compare=False)

    def key(self) -> bytes:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).digest()


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Bounds on what a tenant may ask to compile, and on the cache."""

    max_source_bytes: int = 64 * 1024
    # Rule references chained (each rule weighing 1 + its bracket nesting) in a Lark grammar,
    # or definitions chained by $ref in a JSON schema. On an 8 MiB stack a Lark chain of
    # 2,500 compiled and 2,800 crashed the process; compiles run on a far larger stack.
    max_depth: int = 1000
    # Bracket nesting of a JSON schema's text (llguidance's JSON reader stops at 128).
    max_json_nesting: int = 100
    max_grammar_size: int = 200_000  # llguidance grammar symbols
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    cache_entries_per_tenant: int = 64

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            verbose_errors=False,  # errors reach the client; keep parser state out of them
        )


class GrammarMatcher:
    """One sequence's position in its grammar. Engine thread only."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    @property
    def raw(self) -> llguidance.LLMatcher:
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar refused it."""
        return self._matcher.consume_token(token_id)

    @property
    def finished(self) -> bool:
        """The grammar is complete: only end-of-sequence may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class CompiledGrammar:
    """A compiled grammar; ``matcher()`` gives each sequence its own state."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What llguidance needs of the model's tokenizer."""

    token_bytes: Sequence[bytes]  # one entry per logits column
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    special_token_ids: tuple[int, ...]
    encode: Callable[[str], list[int]]


class _Wrapper:
    """The duck type ``llguidance.TokenizerWrapper`` reads."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.eos_token_id = vocab.eos_token_ids[0]
        self.bos_token_id = vocab.bos_token_id
        self.tokens = list(vocab.token_bytes)
        self.special_token_ids = list(vocab.special_token_ids)
        self._encode = vocab.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


def build_tokenizer(vocab: Vocabulary) -> llguidance.LLTokenizer:
    """The llguidance view of the vocabulary (about half a second for 49k tokens)."""
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Wrapper(vocab)),
        n_vocab=len(vocab.token_bytes),
        eos_token=list(vocab.eos_token_ids),
    )


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec (cheap; compiling happens in ``LLMatcher``)."""
    if spec.kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=_JSON_OPTIONS)
        except ValueError:
            raise GrammarError("json_schema is not a JSON object") from None
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_JSON_OBJECT, defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


class GrammarCompiler:
    """Compiles specs for one tokenizer and caches the results per tenant (LRU).

    ``compile`` blocks (``submit`` runs it on the compile executor); it is thread-safe. The
    llguidance tokenizer is built on first use, or by ``warm`` (``kvfence serve`` warms it at
    start, so no tenant's first request pays for, or can time, that build).
    """

    def __init__(
        self, vocab: Vocabulary, limits: GrammarLimits, executor: CompileExecutor | None = None
    ) -> None:
        self._vocab = vocab
        self._executor = executor
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._build_lock = threading.Lock()
        self.limits = limits
        self._parser_limits = limits.parser_limits()
        self._caches: dict[str, OrderedDict[bytes, CompiledGrammar]] = {}
        self._lock = threading.Lock()

    def warm(self) -> llguidance.LLTokenizer:
        with self._build_lock:
            if self._tokenizer is None:
                self._tokenizer = build_tokenizer(self._vocab)
            return self._tokenizer

    def check(self, spec: GrammarSpec) -> str | None:
        """A reason to refuse the spec before compiling it, or None."""
        if spec.kind not in GRAMMAR_KINDS:
            return f"unknown kind {spec.kind!r}"
        size = len(spec.source.encode("utf-8"))
        if size > self.limits.max_source_bytes:
            return f"{spec.kind} is {size} bytes; the limit is {self.limits.max_source_bytes}"
        if spec.kind != "json_object" and not spec.source.strip():
            return f"{spec.kind} must not be empty"
        return None

    def check_depth(self, spec: GrammarSpec) -> GrammarError | None:
        """The error refusing a spec that nests deeper than the limits, or None. Linear in
        the source; runs before llguidance, whose walk over the grammar recurses. A Lark
        grammar's embedded ``%json`` schemas are held to the JSON schema limits (the error
        carries the line of the one refused)."""
        limits = self.limits
        if spec.kind == "lark":
            depth = lark_depth(spec.source)
            if depth > limits.max_depth:
                return GrammarError(
                    f"lark grammar rules nest {depth} deep; the limit is {limits.max_depth}"
                )
            for line, schema in lark_json_schemas(spec.source):
                reason = self._schema_depth(schema, "%json schema")
                if reason is not None:
                    return GrammarError(f"at {line}: {reason}", line)
        elif spec.kind == "json_schema":
            reason = self._schema_depth(spec.source, "json_schema")
            if reason is not None:
                return GrammarError(reason)
        return None

    def _schema_depth(self, source: str, name: str) -> str | None:
        limits = self.limits
        nesting = json_nesting(source)
        if nesting > limits.max_json_nesting:
            return f"{name} nests {nesting} levels deep; the limit is {limits.max_json_nesting}"
        schema = parse_schema(source)
        if not isinstance(schema, dict):
            return f"{name} is not a JSON object"
        depth = json_ref_depth(schema)
        if depth > limits.max_depth:
            return f"{name} $refs chain {depth} deep; the limit is {limits.max_depth}"
        return None

    def submit(
        self, tenant: str, spec: GrammarSpec
    ) -> concurrent.futures.Future[CompiledGrammar]:
        """``compile`` on the compile executor (a cache hit answers at once, on no thread).
        Without an executor, the compile runs in the calling thread."""
        hit = self._hit(tenant, spec.key())
        if hit is not None or self._executor is None:
            done: concurrent.futures.Future[CompiledGrammar] = concurrent.futures.Future()
            try:
                done.set_result(hit if hit is not None else self.compile(tenant, spec))
            except GrammarError as err:
                done.set_exception(err)
            return done
        return self._executor.submit(tenant, lambda: self.compile(tenant, spec))

    def _hit(self, tenant: str, key: bytes) -> CompiledGrammar | None:
        with self._lock:
            cache = self._caches.get(tenant)
            hit = cache.get(key) if cache is not None else None
            if hit is not None and cache is not None:
                cache.move_to_end(key)
            return hit

    def compile(self, tenant: str, spec: GrammarSpec) -> CompiledGrammar:
        """The tenant's compiled grammar for ``spec``; raises GrammarError with the reason.
        Blocks: call it on a large-stack thread (``submit``)."""
        reason = self.check(spec)
        if reason is not None:
            raise GrammarError(reason)
        key = spec.key()
        hit = self._hit(tenant, key)
        if hit is not None:
            return hit
        error = self.check_depth(spec)
        if error is not None:
            raise error
        template = llguidance.LLMatcher(
            self.warm(), grammar_text(spec), log_level=0, limits=self._parser_limits
        )
        if not template.is_error():
            # The lexer is built lazily by the first mask: build it here, off the engine thread.
            template.compute_bitmask()
        if template.is_error():
            message = _first_line(template.get_error())
            raise GrammarError(message, _error_line(message))
        compiled = CompiledGrammar(template)
        with self._lock:
            cache = self._caches.setdefault(tenant, OrderedDict())
            cache[key] = compiled
            while len(cache) > self.limits.cache_entries_per_tenant:
                cache.popitem(last=False)
        return compiled

    def cached(self, tenant: str) -> int:
        with self._lock:
            return len(self._caches.get(tenant, ()))

    def shutdown(self) -> None:
        """Stop the compile executor's threads (queued compiles are cancelled)."""
        if self._executor is not None:
            self._executor.shutdown()

    def forget(self, tenant: str) -> None:
        """Drop a tenant's compiled grammars (purge, tenant removed)."""
        with self._lock:
            self._caches.pop(tenant, None)


_AT_LINE = re.compile(r"^at (\d+)\(\d+\):")


def _error_line(message: str) -> int | None:
    """The source line llguidance's error names (``at 4(8): ...``), if it names one."""
    m = _AT_LINE.match(message)
    return int(m.group(1)) if m else None


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "grammar does not compile"
    return line[:300]


def apply_grammar_masks(
    logits: torch.Tensor, constrained: Sequence[tuple[int, GrammarMatcher]]
) -> list[float]:
    """Set to ``-inf`` every logit the row's grammar does not allow (in place); returns the
    seconds each constrained row's mask took to compute (in ``constrained``'s order).

    ``constrained`` pairs a row of ``logits`` with its matcher; other rows are untouched.
    The bitmask is llguidance's: one bit per token, 32 tokens per int32 word.
    NOTE: a mask's cost is the grammar's, so the tenant's: an ambiguous 37-byte grammar
    took ~170 ms a token. The times go to the scheduler, which charges and budgets them.
    """
    if not constrained:
        return []
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = np.zeros((len(constrained), words), dtype=np.int32)
    seconds: list[float] = []
    for i, (_, matcher) in enumerate(constrained):
        began = time.perf_counter()
        matcher.raw.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, words * 4)
        seconds.append(time.perf_counter() - began)
    # NOTE: the masks themselves take microseconds; unpacking them took most of the cost of
    # constrained decoding when it was done with tensor shifts (a [rows, words, 32] int32
    # tensor and three copies of it). Word j's bit b is token 32j + b, which on a
    # little-endian layout is byte 4j + b // 8, bit b % 8: numpy unpacks that in one C pass.
    little = bitmask.astype("<i4", copy=False).view(np.uint8)
    bits = np.unpackbits(little, axis=1, count=vocab, bitorder="little")
    banned = torch.from_numpy(bits).to(device=logits.device) == 0
    rows = [r for r, _ in constrained]
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(banned, float("-inf"))
        return seconds
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(banned, float("-inf"))
    return seconds
