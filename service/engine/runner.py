"""Model forward for one scheduled batch.

Prefill chunks and decodes run in a single forward over the flattened tokens of the batch.
Inputs are built as Python lists and turned into tensors with one ``torch.tensor`` call
each (one host-to-device copy per input instead of one per sequence). Rows of sequences
that name a LoRA adapter travel as a ``LoraBatch`` (service/model/lora_batch.py): the step
stays one forward whatever mix of adapters and base it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvcache.attention import AttentionFn
from kvcache.step import StepAttention
from service.engine.plan import ScheduledSeq
from service.model.lora import LoraAdapter
from service.model.lora_batch import LoraBatch
from service.model.lora_stack import LoraStacks


class ForwardModel(Protocol):
    """What the runner needs of ``service.model.DecoderModel``."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        logits_indices: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] int64: last new token of each sampling sequence
    lora: LoraBatch | None = None  # the adapter rows; None = every row on the base


def build_inputs(
    entries: Sequence[ScheduledSeq], device: torch.device, stacks: LoraStacks | None = None
) -> BatchInputs:
    """The step's flattened inputs; ``stacks`` keeps mixed steps' stacked adapter weights."""
    ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    adapters: list[LoraAdapter | None] = []
    for e in entries:
        start = e.seq.num_computed
        end = start + e.num_new
        ids.extend(e.seq.token_ids[start:end])
        adapters.extend([e.seq.request.adapter] * e.num_new)
        positions.extend(range(start, end))
        if e.samples:
            logits_indices.append(len(ids) - 1)
    return BatchInputs(
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        torch.tensor(logits_indices, dtype=torch.long, device=device),
        LoraBatch.of_rows(adapters, device, stacks),
    )


class GraphReplay(Protocol):
    """What the runner needs of ``service.engine.cuda_graphs.DecodeGraphs``."""

    @property
    def buckets(self) -> tuple[int, ...]:
        """The batch sizes captured: a decode step runs padded to the smallest that holds it."""
        ...

    def run(self, inputs: BatchInputs, step: StepAttention) -> torch.Tensor | None: ...


class ModelRunner:
    """Runs the model over a fenced batch and returns the sampling rows' logits.

    With ``graphs``, decode-only steps replay a captured CUDA graph (``DecodeGraphs.run``
    refills its buffers from the already-fenced step first); other steps run eagerly.
    """

    def __init__(
        self, model: ForwardModel, device: torch.device, graphs: GraphReplay | None = None
    ) -> None:
        self.model = model
        self.device = device
        self._graphs = graphs
        self.lora_stacks = LoraStacks()  # mixed adapter steps' stacked weights, across steps

    @torch.inference_mode()
    def forward(self, inputs: BatchInputs, attn: AttentionFn) -> torch.Tensor:
        """``[N, vocab]`` float32 logits, one row per sampling entry, in batch order."""
        if inputs.lora is not None:
            # NOTE: captured graphs and compiled forwards are the base model's alone.
            return self.model(
                inputs.input_ids, inputs.positions, attn, inputs.logits_indices, inputs.lora
            )
        if self._graphs is not None and isinstance(attn, StepAttention):
            logits = self._graphs.run(inputs, attn)
            if logits is not None:
                return logits
        return self.model(inputs.input_ids, inputs.positions, attn, inputs.logits_indices)
