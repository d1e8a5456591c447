"""Per-step attention metadata in FlashInfer's CSR form, and the one KV write path.

For a batch of B sequences and T new tokens: ``qo_indptr`` [B+1] splits the T query rows,
``kv_indptr`` [B+1] splits ``kv_indices`` (the pages each sequence attends over, in order),
``kv_last_page_len`` [B] is how many slots of each last page are valid, and
``slot_mapping`` [T] is the flat slot (``page_id * page_size + offset``) each new token's K/V
is written to. Host copies of the lengths ride along so backends can plan without a sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StepEntry:
    """One sequence in a step: KV for ``[0, num_computed)`` exists; ``num_new`` tokens run."""

    seq_id: str
    num_computed: int
    num_new: int


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """What the metadata needs of one fenced sequence."""

    q_start: int  # position of the first new token (= num_computed)
    num_new: int
    page_ids: tuple[int, ...]  # pages covering [0, q_start + num_new), in order
    slots: tuple[int, ...]  # flat slots of the new tokens


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [nnz_pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [T] int64
    page_size: int
    q_starts: tuple[int, ...]  # host copies of the above, per sequence
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_ids: tuple[tuple[int, ...], ...]
    # Each layer's window (kvcache.attention.LayerAttention); empty: no layer has one.
    windows: tuple[int, ...] = ()
    # Each layer's logit softcap (LayerAttention.softcap); empty: no layer has one.
    softcaps: tuple[float, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.qo_lens)

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)


def _indptr(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def build_metadata(
    spans: Sequence[SeqSpan],
    page_size: int,
    device: torch.device,
    windows: tuple[int, ...] = (),
    softcaps: tuple[float, ...] = (),
) -> AttentionMetadata:
    """CSR metadata for the spans, in batch order; ``windows`` and ``softcaps`` as the
    pool's."""
    qo_lens = tuple(s.num_new for s in spans)
    kv_lens = tuple(s.q_start + s.num_new for s in spans)
    page_ids = tuple(s.page_ids for s in spans)
    last = [n - (len(p) - 1) * page_size for n, p in zip(kv_lens, page_ids, strict=True)]
    flat_pages = [p for s in spans for p in s.page_ids]
    slots = [x for s in spans for x in s.slots]

    def i32(xs: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(xs), dtype=torch.int32, device=device)

    return AttentionMetadata(
        qo_indptr=i32(_indptr(qo_lens)),
        kv_indptr=i32(_indptr([len(p) for p in page_ids])),
        kv_indices=i32(flat_pages),
        kv_last_page_len=i32(last),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        page_size=page_size,
        q_starts=tuple(s.q_start for s in spans),
        qo_lens=qo_lens,
        kv_lens=kv_lens,
        page_ids=page_ids,
        windows=windows,
        softcaps=softcaps,
    )


def kv_rows(slot_mapping: torch.Tensor, page_size: int) -> torch.Tensor:
    """Rows ``[2, T]`` (K, then V) of each slot in a layer's ``[-1, H, D]`` view, whose rows
    run ``[page, k|v, offset]``. Computed once per step and reused by every layer."""
    pages = torch.div(slot_mapping, page_size, rounding_mode="floor")
    k_rows = slot_mapping + pages * page_size
    return torch.stack((k_rows, k_rows + page_size))


def write_kv_rows(
    kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor
) -> None:
    """:func:`write_kv` with the rows from :func:`kv_rows` precomputed. Together with
    :func:`write_kv`, which calls it, the only code that writes KV memory, apart from
    ``DecodeKernel.write_run``/``layer_writer`` (kvcache/backends/cpu_decode.py), the
    one C call a layer of the compiled CPU step and of an eager all-decode CPU step, and
    ``kvf_step_attend_f32`` (``DecodeKernel.step_context``), the same call made by native
    model code through a context kvcache built; all store the same rows. (Outside a step,
    ``PagePool.zero_pages`` scrubs pages and ``PagePool.load_page`` fills a page restored
    from the KV tier.)"""
    flat = kv_layer.view(-1, *kv_layer.shape[-2:])
    # NOTE: index_copy_ on flat rows is one kernel per tensor, a few times cheaper per layer
    # than advanced-index assignment with (page, offset) pairs.
    flat.index_copy_(0, rows[0], k.to(kv_layer.dtype))
    flat.index_copy_(0, rows[1], v.to(kv_layer.dtype))


def write_kv(
    kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k``, ``v`` ``[T, H, D]`` at ``slot_mapping`` ``[T]`` in one layer's
    ``[num_pages, 2, page_size, H, D]`` view. The only code that writes KV memory."""
    write_kv_rows(kv_layer, k, v, kv_rows(slot_mapping, kv_layer.shape[2]))
