"""The protocol a paged-attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from kvcache.attention import NativeAttend
from kvcache.metadata import AttentionMetadata


class StepKernel(Protocol):
    """Attention for one step, prepared once and called per layer.

    ``q`` ``[T, Hq, D]``; ``kv_layer`` the layer's ``[num_pages, 2, page_size, Hkv, D]``
    view with this step's K/V already written. Reads only ``metadata``'s pages. ``window``
    is the layer's (``metadata.windows``): > 0, each query reads only its last ``window``
    keys (its own included). ``softcap`` is the layer's (``metadata.softcaps``): > 0, each
    scaled score ``s`` is ``softcap * tanh(s / softcap)`` before the softmax.
    """

    def __call__(
        self, q: torch.Tensor, kv_layer: torch.Tensor, window: int = 0, softcap: float = 0.0
    ) -> torch.Tensor: ...


class WriteAttend(Protocol):
    """A step kernel's optional ``write_attend(q, k, v, kv_layer, rows, window, softcap)``:
    store the step's K/V at ``rows`` (:func:`kvcache.metadata.kv_rows`) and attend (within
    ``window``, scores capped by ``softcap``, as :class:`StepKernel`), in one call; None when
    it cannot for this step (then nothing was written)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        rows: torch.Tensor,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor | None: ...


class NativeAttendOf(Protocol):
    """A step kernel's optional ``native_attend(q_heads, kv, rows, every_chunk)``: the
    step's attention over the pool ``kv`` for native model code
    (:class:`kvcache.attention.NativeAttend`), storing K/V at ``rows``; None when it has
    none for this step. With ``every_chunk`` prefill chunks of any length are offered too
    (each token a decode-kernel row: batch-invariant attention)."""

    def __call__(
        self, q_heads: int, kv: torch.Tensor, rows: torch.Tensor, every_chunk: bool = False
    ) -> NativeAttend | None: ...


class AttentionBackend(Protocol):
    def prepare(self, metadata: AttentionMetadata) -> StepKernel:
        """Plan one step (index tensors, kernel plans) for reuse across layers."""
        ...
