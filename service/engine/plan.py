"""One step's plan, as the scheduler hands it to the engine core: the fenced batch, its
attention, and what left the batch (admitted, preempted, rejected, refused)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.attention import AttentionFn
from kvcache.errors import FenceViolation
from service.engine.cost_model import StepShape
from service.engine.request import SeqState
from service.engine.types import RequestTooLarge


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: SeqState
    num_new: int  # tokens computed this step, from seq.num_computed

    @property
    def samples(self) -> bool:
        """The step brings the sequence level with its tokens, so it samples the next one."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan: the fenced batch and its attention, plus what left the batch."""

    entries: tuple[ScheduledSeq, ...]  # passed the fence; run this step
    attn: AttentionFn | None  # None when no entry runs
    admitted: tuple[SeqState, ...]  # first admissions and re-admissions after preemption
    preempted: tuple[SeqState, ...]
    rejected: tuple[tuple[SeqState, RequestTooLarge], ...]
    refused: tuple[tuple[SeqState, FenceViolation], ...]  # the fence refused their pages

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new for e in self.entries)

    def shape(self) -> StepShape:
        """What the step's cost depends on; read it before ``update`` advances the entries."""
        rows = keys = 0
        chunks: list[tuple[int, int]] = []
        for e in self.entries:
            if e.num_new == 1 and e.samples:  # a decode row (or a prompt's last token)
                rows += 1
                keys += e.seq.num_computed + 1
            else:
                chunks.append((e.seq.num_computed, e.num_new))
        return StepShape(rows, keys, tuple(chunks))
