"""Paged attention with FlashInfer (CUDA only; ``flashinfer`` is imported lazily here).

One ``BatchDecodeWithPagedKVCacheWrapper`` for the one-token rows and one
``BatchPrefillWithPagedKVCacheWrapper`` (causal) for the prefill chunks. Each is planned
once per step, on the first layer's call (the plan needs the query head count), and run
for every layer. The pool's per-layer ``[num_pages, 2, page_size, H, D]`` view is
FlashInfer's NHD paged-KV tensor as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcache.metadata import AttentionMetadata

_WORKSPACE_BYTES = 128 * 1024 * 1024


def _csr(
    meta: AttentionMetadata, which: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qo_indptr, kv_indptr, kv_indices, kv_last_page_len) for a subset of the batch."""
    qo, kv = [0], [0]
    idx: list[int] = []
    last: list[int] = []
    for i in which:
        pages = meta.page_ids[i]
        qo.append(qo[-1] + meta.qo_lens[i])
        kv.append(kv[-1] + len(pages))
        idx.extend(pages)
        last.append(meta.kv_lens[i] - (len(pages) - 1) * meta.page_size)

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=device)

    return i32(qo), i32(kv), i32(idx), i32(last)


def _rows(meta: AttentionMetadata, which: Sequence[int], device: torch.device) -> torch.Tensor:
    offsets = [0]
    for n in meta.qo_lens:
        offsets.append(offsets[-1] + n)
    rows = [r for i in which for r in range(offsets[i], offsets[i + 1])]
    return torch.tensor(rows, dtype=torch.long, device=device)


class FlashInferStep:
    """A prepared step; see :class:`~kvcache.backends.base.StepKernel`."""

    def __init__(self, backend: FlashInferBackend, metadata: AttentionMetadata) -> None:
        self._backend = backend
        self._meta = metadata
        self._decode = [i for i, n in enumerate(metadata.qo_lens) if n == 1]
        self._prefill = [i for i, n in enumerate(metadata.qo_lens) if n != 1]
        self._planned = False

    def _plan(self, q: torch.Tensor, kv_layer: torch.Tensor) -> None:
        b, meta, device = self._backend, self._meta, kv_layer.device
        num_kv_heads, head_dim = kv_layer.shape[-2], kv_layer.shape[-1]
        # NOTE: positional up to page_size: the keyword for head_dim was renamed across
        # flashinfer 0.2.x releases, the order was not.
        shape = (q.shape[1], num_kv_heads, head_dim, meta.page_size)
        opts: dict[str, Any] = {
            "pos_encoding_mode": "NONE",
            "q_data_type": kv_layer.dtype,
            "kv_data_type": kv_layer.dtype,
        }
        if self._decode:
            _, kv_indptr, kv_indices, last = _csr(meta, self._decode, device)
            b.decode.plan(kv_indptr, kv_indices, last, *shape, **opts)
        if self._prefill:
            qo_indptr, kv_indptr, kv_indices, last = _csr(meta, self._prefill, device)
            b.prefill.plan(qo_indptr, kv_indptr, kv_indices, last, *shape, causal=True, **opts)
        self._split = bool(self._decode) and bool(self._prefill)
        if self._split:
            self._decode_rows = _rows(meta, self._decode, device)
            self._prefill_rows = _rows(meta, self._prefill, device)
        self._planned = True

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        if not self._planned:
            self._plan(q, kv_layer)
        qx = q.to(kv_layer.dtype)
        b = self._backend
        if not self._split:
            wrapper = b.decode if self._decode else b.prefill
            return wrapper.run(qx, kv_layer).to(q.dtype)  # type: ignore[no-any-return]
        out = torch.empty_like(qx)
        out.index_copy_(
            0, self._decode_rows, b.decode.run(qx.index_select(0, self._decode_rows), kv_layer)
        )
        out.index_copy_(
            0, self._prefill_rows, b.prefill.run(qx.index_select(0, self._prefill_rows), kv_layer)
        )
        return out.to(q.dtype)


class FlashInferBackend:
    """Holds the wrappers and their workspaces; reused across steps."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        import flashinfer  # NOTE: lazy, so kvcache imports without CUDA or flashinfer.

        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError("the flashinfer backend needs a CUDA device")
        # NOTE: separate workspaces: both wrappers are planned before either runs.
        self.decode: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD"
        )
        self.prefill: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD"
        )

    def prepare(self, metadata: AttentionMetadata) -> FlashInferStep:
        return FlashInferStep(self, metadata)
