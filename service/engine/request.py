"""Per-request engine state: one ``SeqState`` from submit to finish.

A sequence's tokens are ``prompt + output``. The scheduler's only rule is that
``num_computed`` (tokens whose KV is in the cache) catches up with ``num_tokens``; a token
is sampled whenever a step brings them level. Preemption resets ``num_computed`` to zero and
keeps the output, so recomputation re-reads prompt + output and streamed tokens are neither
lost nor repeated.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import torch

from service.engine.detokenizer import IncrementalDetokenizer
from service.engine.types import EngineEvent, Request
from service.structured.grammar import GrammarMatcher


class TokenTail(Sequence[int]):
    """``tokens[start:]`` without copying; sees tokens appended later."""

    __slots__ = ("_start", "_tokens")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens = tokens
        self._start = start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            return self._tokens[self._start :][index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._tokens[self._start + index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens[self._start :])


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SeqState:
    request: Request
    sink: Callable[[EngineEvent], None]  # receives this request's events, in order
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    max_tokens: int  # stopping.max_tokens capped by max_model_len
    arrival: float
    token_ids: list[int] = field(init=False)
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    # Set by the scheduler on first admission.
    admitted_at: float | None = None
    cached_tokens: int = 0
    # Set by the scheduler on every admission; the newest running sequence is preempted first.
    admit_order: int = 0
    num_preemptions: int = 0
    announced: bool = False  # Admitted was sent
    in_cache: bool = False  # opened in the KVCacheManager and not freed yet
    first_token_at: float | None = None
    grammar: GrammarMatcher | None = None  # structured output: this sequence's grammar state
    # Set by the engine after each sampled token: what sampling this row costs beyond a plain
    # argmax (its grammar mask, its share of penalties, truncation, logprobs), smoothed.
    sample_s: float = 0.0

    def __post_init__(self) -> None:
        self.token_ids = list(self.request.prompt_ids)

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> Sequence[int]:
        """The generated tokens, as a view (no copy: the sampler reads it every step)."""
        return TokenTail(self.token_ids, self.num_prompt)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt + self.max_tokens

    def banned_ids(self) -> tuple[int, ...]:
        """Stop tokens may not be sampled before ``min_tokens`` outputs exist."""
        if self.num_output < self.request.stopping.min_tokens:
            return tuple(sorted(self.stop_ids))
        return ()
