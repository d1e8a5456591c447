"""Decode attention in pure torch over static buffers, for CUDA-graph capture.

The graph-safe sibling of the torch backend's batched-matmul decode path: every sequence's
keys are gathered as rows of ``D`` values into ``[2, B, Hkv, N, D]`` (each (sequence, kv
head) block contiguous), with ``N`` fixed at construction (the longest sequence a graph
serves). Keys past a sequence's length point at its own first slot and are masked out, so a
gather never names a page outside the sequence's table. Implements
:class:`~kvcache.graph_step.GraphDecodeKernel`.
"""

from __future__ import annotations

import torch

from kvcache.metadata import AttentionMetadata


def gather_rows(
    meta: AttentionMetadata, num_kv_heads: int, max_kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows ``[2 * B * Hkv * N]`` of the layer's ``[-1, D]`` view, padding ``[B, 1, 1, N]``
    with True where a key is past the sequence's length), on the host."""
    ps, hkv, n = meta.page_size, num_kv_heads, max_kv_len
    slots = torch.empty((meta.batch_size, n), dtype=torch.long)
    for i, pages in enumerate(meta.page_ids):
        length = meta.kv_lens[i]
        if length > n:
            raise ValueError(f"sequence of {length} keys > graph capacity {n}")
        own = torch.tensor(pages, dtype=torch.long)[:, None] * ps + torch.arange(ps)
        slots[i, :length] = own.reshape(-1)[:length]
        slots[i, length:] = own[0, 0]
    # Layer rows run [page, k|v, offset, head]: row of (slot, k|v, head).
    base = (slots + torch.div(slots, ps, rounding_mode="floor") * ps) * hkv
    kv = torch.tensor([0, ps * hkv], dtype=torch.long).view(2, 1, 1, 1)
    heads = torch.arange(hkv, dtype=torch.long).view(1, 1, hkv, 1)
    rows = (base[None, :, None, :] + kv + heads).reshape(-1)
    lens = torch.tensor(meta.kv_lens, dtype=torch.long)
    padding = (torch.arange(n)[None, :] >= lens[:, None]).view(meta.batch_size, 1, 1, n)
    return rows, padding


class TorchGraphDecode:
    """Static-shape decode attention for ``batch_size`` sequences of up to ``max_kv_len`` keys."""

    def __init__(
        self, batch_size: int, num_kv_heads: int, max_kv_len: int, device: torch.device
    ) -> None:
        if min(batch_size, num_kv_heads, max_kv_len) < 1:
            raise ValueError("batch_size, num_kv_heads and max_kv_len must be >= 1")
        self.batch_size = batch_size
        self.max_kv_len = max_kv_len
        self._hkv = num_kv_heads
        n = batch_size * num_kv_heads * max_kv_len
        self._rows = torch.zeros(2 * n, dtype=torch.long, device=device)
        self._padding = torch.ones((batch_size, 1, 1, max_kv_len), dtype=torch.bool, device=device)

    def update(self, meta: AttentionMetadata) -> None:
        if meta.batch_size != self.batch_size or any(n != 1 for n in meta.qo_lens):
            raise ValueError(f"expected {self.batch_size} decode rows")
        rows, padding = gather_rows(meta, self._hkv, self.max_kv_len)
        self._rows.copy_(rows)
        self._padding.copy_(padding)

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        b, hq, d = q.shape
        hkv, n = self._hkv, self.max_kv_len
        kv = kv_layer.view(-1, d).index_select(0, self._rows).view(2, b, hkv, n, d)
        k, v = kv[0].to(q.dtype), kv[1].to(q.dtype)
        # GQA without copies: q head h*group + g reads kv head h.
        qg = q.reshape(b, hkv, hq // hkv, d) * (d**-0.5)
        scores = torch.matmul(qg, k.transpose(-1, -2)).float()
        scores.masked_fill_(self._padding, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, v).view(b, hq, d)
