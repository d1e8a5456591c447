"""Paged attention in pure torch (CPU and GPU).

Each sequence's K/V is gathered with ``index_select`` over *its own* page ids only, once
per layer. Consecutive one-token (decode) rows are batched into SDPA calls; within such a
batch, shorter page lists are padded with the sequence's own first page and the padding is
masked out, so no sequence ever reads a page outside its table. Prefill chunks run one
SDPA each with a causal mask aligned to the chunk's start position. GQA via
``enable_gqa``; softmax scale ``head_dim ** -0.5``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.metadata import AttentionMetadata

# NOTE: on CPU, decode attention is memory bound. Gathering a few sequences at a time keeps
# the gathered K/V in cache while SDPA reads it back, which measured ~2x faster than one
# gather for the whole batch. On GPUs one big batch is better (fewer kernel launches).
_CPU_GATHER_BYTES = 2 * 1024 * 1024
_GPU_GATHER_BYTES = 1024 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _Chunk:
    """Query rows ``[start, end)`` of q, from ``batch`` sequences attending to their pages."""

    start: int
    end: int
    batch: int  # sequences in the chunk; each has (end - start) // batch query rows
    page_index: torch.Tensor  # [batch * pages_each] own pages (decode: padded with own page 0)
    kv_len: int  # keys per sequence after slicing the gathered pages
    mask: torch.Tensor | None  # broadcastable to [batch, 1, Tq, kv_len]; True = attend
    causal: bool  # plain top-left causal mask (prefill from position 0)


class TorchStep:
    """A prepared step; see :class:`~kvcache.backends.base.StepKernel`."""

    def __init__(self, metadata: AttentionMetadata) -> None:
        device = metadata.slot_mapping.device
        self._device = device
        self._meta = metadata
        self._chunks: list[_Chunk] = []
        self._budget = _CPU_GATHER_BYTES if device.type == "cpu" else _GPU_GATHER_BYTES
        self._pending: list[int] = []  # consecutive decode sequences not yet chunked
        self._offsets = [0]
        for n in metadata.qo_lens:
            self._offsets.append(self._offsets[-1] + n)
        self._bytes_per_page = 0  # set on first call, when the pool layout is known
        self._built = False

    def _build(self, kv_layer: torch.Tensor) -> None:
        meta = self._meta
        self._bytes_per_page = kv_layer[0].numel() * kv_layer.element_size()
        for i, n in enumerate(meta.qo_lens):
            if n == 1:
                pages = len(meta.page_ids[i])
                biggest = max([pages, *(len(meta.page_ids[j]) for j in self._pending)])
                if (
                    self._pending
                    and (len(self._pending) + 1) * biggest * self._bytes_per_page > self._budget
                ):
                    self._flush_decodes()
                self._pending.append(i)
                continue
            self._flush_decodes()
            self._chunks.append(self._prefill_chunk(i))
        self._flush_decodes()
        self._built = True

    def _flush_decodes(self) -> None:
        if not self._pending:
            return
        meta, device = self._meta, self._device
        seqs, self._pending = self._pending, []
        pages_each = max(len(meta.page_ids[i]) for i in seqs)
        index: list[int] = []
        for i in seqs:
            pages = meta.page_ids[i]
            index.extend(pages + (pages[0],) * (pages_each - len(pages)))
        lens = [meta.kv_lens[i] for i in seqs]
        kv_len = max(lens)
        mask = None
        if min(lens) != kv_len:
            lens_t = torch.tensor(lens, device=device)
            mask = (torch.arange(kv_len, device=device)[None, :] < lens_t[:, None])[:, None, None]
        start = self._offsets[seqs[0]]
        self._chunks.append(
            _Chunk(
                start=start,
                end=start + len(seqs),
                batch=len(seqs),
                page_index=torch.tensor(index, dtype=torch.long, device=device),
                kv_len=kv_len,
                mask=mask,
                causal=False,
            )
        )

    def _prefill_chunk(self, i: int) -> _Chunk:
        meta, device = self._meta, self._device
        n, q_start, kv_len = meta.qo_lens[i], meta.q_starts[i], meta.kv_lens[i]
        mask = None
        if q_start != 0:
            q_pos = torch.arange(q_start, q_start + n, device=device)[:, None]
            mask = torch.arange(kv_len, device=device)[None, :] <= q_pos
        return _Chunk(
            start=self._offsets[i],
            end=self._offsets[i + 1],
            batch=1,
            page_index=torch.tensor(meta.page_ids[i], dtype=torch.long, device=device),
            kv_len=kv_len,
            mask=mask,
            causal=mask is None and n > 1,
        )

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        if not self._built:
            self._build(kv_layer)
        if len(self._chunks) == 1:
            return self._run(q, kv_layer, self._chunks[0])
        out = torch.empty_like(q)
        for c in self._chunks:
            out[c.start : c.end] = self._run(q[c.start : c.end], kv_layer, c)
        return out

    @staticmethod
    def _run(q: torch.Tensor, kv_layer: torch.Tensor, c: _Chunk) -> torch.Tensor:
        _, hq, d = q.shape
        hkv = kv_layer.shape[-2]
        # [B, pages * page_size, Hkv, D] -> [B, Hkv, kv_len, D] (a view; SDPA takes strides)
        k = kv_layer[:, 0].index_select(0, c.page_index).view(c.batch, -1, hkv, d)
        v = kv_layer[:, 1].index_select(0, c.page_index).view(c.batch, -1, hkv, d)
        k = k[:, : c.kv_len].transpose(1, 2).to(q.dtype)
        v = v[:, : c.kv_len].transpose(1, 2).to(q.dtype)
        qb = q.view(c.batch, -1, hq, d).transpose(1, 2)  # [B, Hq, Tq, D]
        out = F.scaled_dot_product_attention(
            qb, k, v, attn_mask=c.mask, is_causal=c.causal, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(-1, hq, d)


class TorchBackend:
    """The default backend: works on any device torch supports."""

    def prepare(self, metadata: AttentionMetadata) -> TorchStep:
        return TorchStep(metadata)
