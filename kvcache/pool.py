"""The page pool: one tensor holding every layer's KV in FlashInfer's paged NHD layout.

Shape ``[num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]``; ``layer(i)`` is the
``[num_pages, 2, page_size, H, D]`` view FlashInfer's paged wrappers take directly
(index 0 along dim 2 is K, 1 is V). A KV slot is ``page_id * page_size + offset``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kvcache.attention import LayerAttention


def page_bytes(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one page occupies across all layers (K and V)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * page_size * num_kv_heads * head_dim * itemsize


def pages_for_budget(
    budget_bytes: int,
    *,
    num_layers: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """How many whole pages fit in ``budget_bytes``."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return budget_bytes // page_bytes(num_layers, page_size, num_kv_heads, head_dim, dtype)


def free_device_bytes(device: torch.device | str) -> int:
    """Free memory on ``device``: CUDA free memory, or available host RAM for CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pages_for_fraction(
    fraction: float,
    *,
    num_layers: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> int:
    """How many pages fit in ``fraction`` of the device's currently free memory."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    budget = int(free_device_bytes(device) * fraction)
    return pages_for_budget(
        budget,
        num_layers=num_layers,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )


def size_pool(
    *,
    kv_pages: int | None = None,
    kv_bytes: int | None = None,
    kv_fraction: float | None = None,
    num_layers: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> int:
    """The one rule that sizes the KV pool: exactly one of a page count, a byte budget or a
    fraction of free device memory. Raises ValueError unless at least one page results."""
    if sum(x is not None for x in (kv_pages, kv_bytes, kv_fraction)) != 1:
        raise ValueError("give exactly one of kv_pages, kv_bytes or kv_fraction")
    geometry = {
        "num_layers": num_layers,
        "page_size": page_size,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype": dtype,
    }
    if kv_bytes is not None:
        kv_pages = pages_for_budget(kv_bytes, **geometry)  # type: ignore[arg-type]
    elif kv_fraction is not None:
        kv_pages = pages_for_fraction(kv_fraction, device=device, **geometry)  # type: ignore[arg-type]
    assert kv_pages is not None
    if kv_pages < 1:
        raise ValueError("the KV budget holds no page")
    return kv_pages


class PagePool:
    """Owns the KV tensor. Knows nothing of tenants; the allocator decides who uses a page."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention: Sequence[LayerAttention] = (),
    ) -> None:
        """``attention``: one :class:`LayerAttention` per layer (empty: plain causal
        attention on every layer)."""
        if attention and len(attention) != num_layers:
            raise ValueError(f"{len(attention)} layer attentions for {num_layers} layers")
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # Each layer's window (0: every earlier key); empty where no layer has one.
        self.windows: tuple[int, ...] = (
            tuple(a.window for a in attention) if any(a.window for a in attention) else ()
        )
        # Each layer's attention-logit softcap (0: none); empty where no layer has one.
        self.softcaps: tuple[float, ...] = (
            tuple(a.softcap for a in attention) if any(a.softcap for a in attention) else ()
        )
        # NOTE: zero-initialised so a page never handed out before holds no stale bytes.
        self.kv = torch.zeros(
            (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=self.device,
        )
        # One view per layer, made once: a step asks for each layer's view every step.
        self._layers = tuple(self.kv.unbind(0))

    @property
    def page_bytes(self) -> int:
        return page_bytes(
            self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    def layer(self, layer: int) -> torch.Tensor:
        """The ``[num_pages, 2, page_size, H, D]`` view of one layer."""
        return self._layers[layer]

    def page_data(self, page_id: int) -> bytes:
        """One page's K and V in every layer, as bytes on the host (for the KV tier)."""
        page = self.kv[:, page_id].contiguous().cpu()
        return bytes(page.view(torch.uint8).numpy().tobytes())

    def load_page(self, page_id: int, data: bytes) -> None:
        """Overwrite one page, every layer, with what ``page_data`` gave (a KV tier restore).
        The restored page is exactly ``page_bytes`` long or refused."""
        if len(data) != self.page_bytes:
            raise ValueError(f"{len(data)} bytes for a page of {self.page_bytes}")
        page = self.kv[:, page_id]
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        page.copy_(raw.view(self.dtype).view(page.shape))

    def zero_pages(self, page_ids: Sequence[int]) -> None:
        """Zero the given pages in every layer (one kernel for the whole batch)."""
        if not page_ids:
            return
        index = torch.tensor(list(page_ids), dtype=torch.long, device=self.device)
        self.kv.index_fill_(1, index, 0)
