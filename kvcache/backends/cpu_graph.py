"""Paged decode attention over static buffers for a compiled (``torch.compile``) CPU step.

The CPU sibling of :mod:`kvcache.backends.torch_graph`: a compiled decode forward has fixed
shapes and reads its per-step inputs from buffers that :meth:`CpuGraphDecode.update`
refills before each call, from a fenced step's metadata. The attention itself stays the
paged kernel of :mod:`kvcache.backends.cpu_decode`, reached through one opaque custom op
(``kvfence::paged_decode``) that writes the step's K/V rows and attends in one C call
(``DecodeKernel.write_run``: the rows are :func:`kvcache.metadata.kv_rows`' from the fenced
step, checked against the layer in C), so the compiler fuses everything around it and never
traces KV memory:

- the op takes the whole pool tensor and a layer index, not a layer view: the pool is an
  inference tensor, and a view of one cannot be taken inside a traced graph;
- it declares no mutation. Declared, the op is functionalized and inductor copies the
  pool around it (measured: 16 ms a one-stream step against 11.9 undeclared). Undeclared is
  sound here because the op is the only reader and writer of KV memory in the graph, every
  call's inputs depend on the previous layer's output (so no call is reordered), and its
  output is used (so none is dropped).

The step's CSR page list (``kv_indptr``, ``kv_indices``) is copied into the front of
``indices`` (room for ``max_pages`` per sequence); the kernel reads only
``indices[indptr[b]:indptr[b + 1]]``, the sequence's own pages, so what a longer earlier
step left past the end is never read. Implements
:class:`~kvcache.graph_step.GraphDecodeKernel` and ``write_attend`` (see
:class:`~kvcache.graph_step.FusedDecodeAttention`).
"""

from __future__ import annotations

import torch

from kvcache.backends import cpu_decode
from kvcache.metadata import AttentionMetadata


@torch.library.custom_op("kvfence::paged_decode", mutates_args=())
def paged_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """Write ``k``/``v`` ``[B, Hkv, D]`` at ``rows`` of layer ``layer`` of ``kv`` (the
    pool's ``[L, pages, 2, page_size, Hkv, D]``), then attend ``q`` ``[B, Hq, D]`` over each
    sequence's pages (``cpu_decode.DecodeKernel.run``)."""
    kernel = cpu_decode.kernel()
    if kernel is None:
        raise RuntimeError("the CPU decode kernel is not available")
    return kernel.write_run(q, k, v, kv, layer, rows, indptr, indices, lens)


@paged_decode.register_fake
def _paged_decode_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def available(q_heads: int, kv_layer: torch.Tensor) -> bool:
    """Whether the paged kernel is built and takes a layer of this shape and dtype."""
    kernel = cpu_decode.kernel()
    return kernel is not None and kernel.supports(q_heads, kv_layer)


class CpuGraphDecode:
    """Static-shape paged decode for ``batch_size`` sequences of up to ``max_pages`` pages."""

    def __init__(self, batch_size: int, max_pages: int, device: torch.device) -> None:
        if min(batch_size, max_pages) < 1:
            raise ValueError("batch_size and max_pages must be >= 1")
        self.batch_size = batch_size
        self.max_pages = max_pages
        self._indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
        self._indices = torch.zeros(batch_size * max_pages, dtype=torch.int32, device=device)
        self._lens = torch.ones(batch_size, dtype=torch.int32, device=device)

    def update(self, meta: AttentionMetadata) -> None:
        if meta.batch_size != self.batch_size or any(n != 1 for n in meta.qo_lens):
            raise ValueError(f"expected {self.batch_size} decode rows")
        longest = max(len(p) for p in meta.page_ids)
        if longest > self.max_pages:
            raise ValueError(f"sequence of {longest} pages > graph capacity {self.max_pages}")
        nnz = meta.kv_indices.numel()
        self._indptr.copy_(meta.kv_indptr)
        self._indices[:nnz].copy_(meta.kv_indices)
        self._lens.copy_(torch.tensor(meta.kv_lens, dtype=torch.int32))

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """Attention alone over one layer view (eager callers; the compiled step uses
        :meth:`write_attend`)."""
        kernel = cpu_decode.kernel()
        if kernel is None:
            raise RuntimeError("the CPU decode kernel is not available")
        return kernel.run(q, kv_layer, self._indptr, self._indices, self._lens)

    def write_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        out: torch.Tensor = paged_decode(
            q, k, v, kv, layer, rows, self._indptr, self._indices, self._lens
        )
        return out
