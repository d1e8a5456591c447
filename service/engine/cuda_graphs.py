"""CUDA graphs for decode-only steps, one per batch-size bucket.

On a GPU a decode step is hundreds of small kernels, and launching them from Python costs
more than running them at small batch sizes. A captured graph replays the whole forward
with one launch. Graphs need fixed shapes and fixed addresses, so:

- decode batches are padded up to the next bucket (by repeating the first sequence, see
  ``kvcache.graph_step``), and each bucket has its own graph and static inputs;
- everything that changes per step is copied into static buffers *before* the replay and
  outside the graph: the token ids and positions here, the KV rows and attention plan by
  ``GraphDecodeAttention.update``, which takes the step's ``StepAttention`` and so runs only
  after ``begin_step`` has fenced every page;
- steps with any prefill row, or more sequences than the largest bucket, run eagerly.

Capture happens once, at start-up, while no page is handed out (the warm-up forwards write
into page 0, which is zeroed again afterwards). The recorder is injected: ``cuda_recorder``
captures real graphs; ``eager_recorder`` replays the same static-buffer forward without a
graph, which is how the bucket, padding and buffer logic is tested on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.graph_step import GraphDecodeAttention, GraphDecodeKernel
from kvcache.pool import PagePool
from kvcache.step import StepAttention
from service.engine.runner import BatchInputs, ForwardModel

Forward = Callable[[], torch.Tensor]
# Runs a forward on static buffers once or more and returns (replay, the static output).
Recorder = Callable[[Forward], tuple[Callable[[], None], torch.Tensor]]


def cuda_available(device: torch.device) -> bool:
    """Whether graphs can be captured on ``device``."""
    return device.type == "cuda" and torch.cuda.is_available()


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch`` (and ``max_batch``)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {1, 2, 4, 8, *range(16, max_batch + 1, 16), max_batch}
    return tuple(sorted(s for s in sizes if s <= max_batch))


def pick_bucket(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` sequences, or None."""
    fits = [b for b in buckets if b >= num_seqs]
    return min(fits) if num_seqs >= 1 and fits else None


def pad_rows(values: torch.Tensor, out: torch.Tensor) -> None:
    """Copy ``values`` ``[n]`` into ``out`` ``[B]``, the last ``B - n`` rows repeating row 0."""
    n = values.shape[0]
    out[:n].copy_(values)
    out[n:].copy_(values[:1].expand(out.shape[0] - n))


def cuda_recorder(pool: Any) -> Recorder:
    """Captures with ``torch.cuda.graph`` into the shared memory ``pool``
    (``torch.cuda.graph_pool_handle()``), after warm-up runs on a side stream."""

    def record(forward: Forward) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # NOTE: lazy inits (cuBLAS handles, JIT loads) happen here
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return graph.replay, out

    return record


def eager_recorder(forward: Forward) -> tuple[Callable[[], None], torch.Tensor]:
    """Same contract without a graph: each replay reruns the forward into one static output."""
    out = forward().clone()

    def replay() -> None:
        out.copy_(forward())

    return replay, out


@dataclass(slots=True)
class _Graph:
    attn: GraphDecodeAttention
    input_ids: torch.Tensor  # [B] static
    positions: torch.Tensor  # [B] static
    replay: Callable[[], None]
    logits: torch.Tensor  # [B, vocab] static, written by replay


class DecodeGraphs:
    """One captured decode forward per bucket; :meth:`run` replays the right one."""

    def __init__(
        self,
        model: ForwardModel,
        pool: PagePool,
        kernel_for: Callable[[int], GraphDecodeKernel],
        buckets: Sequence[int],
        recorder: Recorder,
        attention: Callable[[PagePool, Any], GraphDecodeAttention] = GraphDecodeAttention,
    ) -> None:
        """``attention(pool, kernel)`` is the AttentionFn each bucket's forward calls:
        :class:`GraphDecodeAttention`, or ``FusedDecodeAttention`` for a compiled step."""
        if not buckets:
            raise ValueError("need at least one bucket")
        self.buckets = tuple(sorted(set(buckets)))
        self._graphs: dict[int, _Graph] = {}
        self.replays = 0  # decode steps served by a graph (for tests and stats)
        # NOTE: largest first, so smaller graphs reuse the memory pool's blocks.
        for size in reversed(self.buckets):
            attn = attention(pool, kernel_for(size))
            self._graphs[size] = self._record(model, pool, attn, recorder)

    @staticmethod
    def _record(
        model: ForwardModel, pool: PagePool, attn: GraphDecodeAttention, recorder: Recorder
    ) -> _Graph:
        size = attn.batch_size
        ids = torch.zeros(size, dtype=torch.long, device=pool.device)
        positions = torch.zeros(size, dtype=torch.long, device=pool.device)
        attn.point_at_scratch()

        def forward() -> torch.Tensor:
            with torch.inference_mode():
                return model(ids, positions, attn, None)

        replay, logits = recorder(forward)
        attn.release_scratch()
        return _Graph(attn, ids, positions, replay, logits)

    def bucket_for(self, step: StepAttention) -> int | None:
        """The bucket that serves ``step``, or None if it must run eagerly."""
        meta = step.metadata
        if any(n != 1 for n in meta.qo_lens):
            return None
        return pick_bucket(meta.batch_size, self.buckets)

    def run(self, inputs: BatchInputs, step: StepAttention) -> torch.Tensor | None:
        """Logits ``[N, vocab]`` for ``inputs.logits_indices`` by replaying a graph, or None
        when the step has a prefill row or no bucket fits (then run it eagerly)."""
        size = self.bucket_for(step)
        if size is None:
            return None
        g = self._graphs[size]
        g.attn.update(step)  # fenced step -> static KV rows and attention plan
        pad_rows(inputs.input_ids, g.input_ids)
        pad_rows(inputs.positions, g.positions)
        g.replay()
        self.replays += 1
        return g.logits.index_select(0, inputs.logits_indices)
