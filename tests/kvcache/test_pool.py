"""PagePool layout and sizing."""

from __future__ import annotations

import pytest
import torch

from kvcache import PagePool, pages_for_budget, pages_for_fraction
from kvcache.pool import page_bytes

SHAPE = {"num_layers": 30, "page_size": 16, "num_kv_heads": 3, "head_dim": 64}


def test_layout_is_flashinfer_nhd() -> None:
    pool = PagePool(2, 5, 16, 3, 8, torch.bfloat16)
    assert pool.kv.shape == (2, 5, 2, 16, 3, 8)
    assert pool.layer(1).shape == (5, 2, 16, 3, 8)
    assert pool.layer(1).data_ptr() == pool.kv[1].data_ptr()
    assert pool.page_bytes == 2 * 2 * 16 * 3 * 8 * 2
    assert torch.all(pool.kv == 0)


def test_pages_for_budget() -> None:
    per_page = page_bytes(30, 16, 3, 64, torch.bfloat16)
    assert per_page == 368640
    assert pages_for_budget(per_page * 10 + per_page - 1, dtype=torch.bfloat16, **SHAPE) == 10
    assert pages_for_budget(0, dtype=torch.float32, **SHAPE) == 0
    with pytest.raises(ValueError):
        pages_for_budget(-1, dtype=torch.float32, **SHAPE)


def test_pages_for_fraction() -> None:
    small = pages_for_fraction(0.01, dtype=torch.float32, **SHAPE)
    big = pages_for_fraction(0.02, dtype=torch.float32, **SHAPE)
    assert 0 < small <= big
    with pytest.raises(ValueError):
        pages_for_fraction(0.0, dtype=torch.float32, **SHAPE)


def test_zero_pages_touches_only_those_pages() -> None:
    pool = PagePool(2, 4, 2, 1, 2)
    pool.kv.fill_(1.0)
    pool.zero_pages([1, 3])
    assert torch.all(pool.kv[:, [1, 3]] == 0)
    assert torch.all(pool.kv[:, [0, 2]] == 1)


def test_bad_shape_raises() -> None:
    with pytest.raises(ValueError):
        PagePool(1, 0, 16, 1, 8)
