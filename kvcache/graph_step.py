"""GraphDecodeAttention: the AttentionFn a captured CUDA graph of a decode step calls.

A CUDA graph replays fixed kernels on fixed addresses, so everything a decode step reads
that changes from step to step (which KV rows to write, which pages to attend over) lives in
static buffers here, and :meth:`GraphDecodeAttention.update` refills them *outside* the graph,
before each replay. ``update`` takes a :class:`~kvcache.step.StepAttention`, which only
``KVCacheManager.begin_step`` builds after the fence, so no replay runs on unfenced pages.

A graph serves a fixed batch size (its bucket). Smaller batches are padded by repeating the
batch's first sequence: padded rows read that sequence's own pages and write the same K/V to
its own current slot as the real row does, so padding never touches another sequence's,
let alone another tenant's, memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvcache.backends.base import AttentionBackend
from kvcache.backends.flashinfer_backend import FlashInferBackend, FlashInferGraphDecode
from kvcache.backends.torch_graph import TorchGraphDecode
from kvcache.metadata import AttentionMetadata, SeqSpan, build_metadata, kv_rows, write_kv_rows
from kvcache.pool import PagePool
from kvcache.step import StepAttention


class GraphDecodeKernel(Protocol):
    """Decode attention over static buffers for ``batch_size`` one-token rows."""

    batch_size: int

    def update(self, meta: AttentionMetadata) -> None:
        """Refill the static buffers from ``meta`` (``batch_size`` decode rows). Outside
        the graph."""
        ...

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """``q`` ``[batch_size, Hq, D]`` -> ``[batch_size, Hq, D]``; capturable."""
        ...


def pad_decode(meta: AttentionMetadata, batch_size: int) -> AttentionMetadata:
    """``meta`` (decode rows only) padded to ``batch_size`` rows with copies of row 0."""
    if any(n != 1 for n in meta.qo_lens):
        raise ValueError("only decode steps (one new token per sequence) can be padded")
    if not 1 <= meta.batch_size <= batch_size:
        raise ValueError(f"batch of {meta.batch_size} does not fit a graph of {batch_size}")
    ps = meta.page_size
    spans = []
    for i in range(meta.batch_size):
        pos, pages = meta.q_starts[i], meta.page_ids[i]
        spans.append(SeqSpan(pos, 1, pages, (pages[pos // ps] * ps + pos % ps,)))
    spans.extend([spans[0]] * (batch_size - meta.batch_size))
    return build_metadata(spans, ps, meta.slot_mapping.device)


class GraphDecodeAttention:
    """Implements :class:`~kvcache.attention.AttentionFn` for a captured decode step."""

    def __init__(self, pool: PagePool, kernel: GraphDecodeKernel) -> None:
        if pool.windows:
            # The static kernels read every key of a sequence; a windowed layer would not
            # be honoured, so a windowed pool runs eager steps only.
            raise ValueError("a captured decode step cannot serve a pool with sliding windows")
        if pool.softcaps:
            # The static kernels take no softcap either: a softcapped pool runs eager steps.
            raise ValueError("a captured decode step cannot serve a pool with logit softcaps")
        self._pool = pool
        self._kernel = kernel
        self.batch_size = kernel.batch_size
        # Rows (K, then V) of each padded token's slot; see kvcache.metadata.kv_rows.
        self._rows = torch.zeros((2, self.batch_size), dtype=torch.long, device=pool.device)
        self.num_tokens = 0  # real (unpadded) rows of the last update

    def update(self, step: StepAttention) -> None:
        """Point the static buffers at ``step``'s pages (a fenced decode step)."""
        meta = pad_decode(step.metadata, self.batch_size)
        self._rows.copy_(kv_rows(meta.slot_mapping, self._pool.page_size))
        self._kernel.update(meta)
        self.num_tokens = step.metadata.num_tokens

    def point_at_scratch(self) -> None:
        """Aim every row at slot 0 of page 0, to warm up and capture on. Only while no
        sequence holds a page; :meth:`release_scratch` afterwards."""
        meta = scratch_metadata(self.batch_size, self._pool.page_size, self._pool.device)
        self._rows.copy_(kv_rows(meta.slot_mapping, self._pool.page_size))
        self._kernel.update(meta)
        self.num_tokens = 0

    def release_scratch(self) -> None:
        """Zero page 0 again: the warm-up forwards wrote K/V of dummy tokens into it."""
        self._pool.zero_pages([0])

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        kv_layer = self._pool.layer(layer)
        write_kv_rows(kv_layer, k, v, self._rows)
        return self._kernel(q, kv_layer)


class FusedGraphDecodeKernel(GraphDecodeKernel, Protocol):
    """A graph kernel that writes the step's K/V rows and attends in one opaque call."""

    def write_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """Store ``k``/``v`` at ``rows`` of layer ``layer`` of the whole pool tensor ``kv``,
        then attend ``q`` over the static pages."""
        ...


class FusedDecodeAttention(GraphDecodeAttention):
    """:class:`GraphDecodeAttention` for a compiled step: the KV write and the attention
    are the kernel's one call (``write_attend``), so the compiler never traces KV memory."""

    def __init__(self, pool: PagePool, kernel: FusedGraphDecodeKernel) -> None:
        super().__init__(pool, kernel)
        self._fused = kernel

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self._fused.write_attend(q, k, v, self._pool.kv, layer, self._rows)


def scratch_metadata(batch_size: int, page_size: int, device: torch.device) -> AttentionMetadata:
    """A decode batch whose every row writes and reads slot 0 of page 0: what the graphs are
    warmed up and captured on, before any page is handed out (see :meth:`release_scratch`)."""
    span = SeqSpan(0, 1, (0,), (0,))
    return build_metadata([span] * batch_size, page_size, device)


def graph_kernels(
    backend: AttentionBackend, pool: PagePool, max_kv_len: int
) -> Callable[[int], GraphDecodeKernel]:
    """For a batch size, the graph-safe decode kernel matching ``backend``: FlashInfer's
    CUDA-graph decode wrapper, or the static torch kernel sized for ``max_kv_len`` keys."""

    def make(batch_size: int) -> GraphDecodeKernel:
        if isinstance(backend, FlashInferBackend):
            max_pages = batch_size * -(-max_kv_len // pool.page_size)
            return FlashInferGraphDecode(backend.shape, batch_size, max_pages, pool.device)
        return TorchGraphDecode(batch_size, pool.num_kv_heads, max_kv_len, pool.device)

    return make
