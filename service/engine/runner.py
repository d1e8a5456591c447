"""Model forward for one scheduled batch.

Prefill chunks and decodes run in a single forward over the flattened tokens of the batch.
Inputs are built as Python lists and turned into tensors with one ``torch.tensor`` call
each (one host-to-device copy per input instead of one per sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvcache.attention import AttentionFn
from kvcache.errors import FenceViolation
from kvcache.metadata import StepEntry
from service.engine.cache_api import CacheManager
from service.engine.scheduler import ScheduledSeq


class ForwardModel(Protocol):
    """What the runner needs of ``service.model.LlamaModel``."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] int64: last new token of each sampling sequence


@dataclass(frozen=True, slots=True)
class FencedBatch:
    """The entries that passed the fence, their attention, and the ones that did not."""

    entries: tuple[ScheduledSeq, ...]
    attn: AttentionFn | None  # None when no entry passed
    violations: tuple[tuple[ScheduledSeq, FenceViolation], ...]


def step_entries(entries: Sequence[ScheduledSeq]) -> list[StepEntry]:
    return [StepEntry(e.seq.seq_id, e.seq.num_computed, e.num_new) for e in entries]


def fence(cache: CacheManager, entries: Sequence[ScheduledSeq]) -> FencedBatch:
    """``begin_step`` for the batch. A FenceViolation names a page, not a sequence, so on one
    the entries are fenced one by one to find the culprits; the rest run without them."""
    try:
        return FencedBatch(tuple(entries), cache.begin_step(step_entries(entries)), ())
    except FenceViolation:
        pass
    good: list[ScheduledSeq] = []
    bad: list[tuple[ScheduledSeq, FenceViolation]] = []
    for e in entries:
        try:
            cache.begin_step(step_entries([e]))
            good.append(e)
        except FenceViolation as err:
            bad.append((e, err))
    attn = cache.begin_step(step_entries(good)) if good else None
    return FencedBatch(tuple(good), attn, tuple(bad))


def build_inputs(entries: Sequence[ScheduledSeq], device: torch.device) -> BatchInputs:
    ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    for e in entries:
        start = e.seq.num_computed
        end = start + e.num_new
        ids.extend(e.seq.token_ids[start:end])
        positions.extend(range(start, end))
        if e.samples:
            logits_indices.append(len(ids) - 1)
    return BatchInputs(
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        torch.tensor(logits_indices, dtype=torch.long, device=device),
    )


class ModelRunner:
    """Runs the model over a fenced batch and returns the sampling rows' logits."""

    def __init__(self, model: ForwardModel, device: torch.device) -> None:
        self._model = model
        self.device = device

    @torch.inference_mode()
    def forward(self, inputs: BatchInputs, attn: AttentionFn) -> torch.Tensor:
        """``[N, vocab]`` float32 logits, one row per sampling entry, in batch order."""
        return self._model(inputs.input_ids, inputs.positions, attn, inputs.logits_indices)
