"""The compiled decode step reads every key of a sequence, so a pool with sliding-window
layers is not given to it: ``--compile auto`` keeps the eager step (which honours windows)
and ``--compile on`` is refused with the reason, as are captured decode graphs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvcache import LayerAttention, PagePool
from kvcache.graph_step import GraphDecodeAttention
from service.engine.compiled import unavailable_reason


def _model() -> Any:
    # everything else the compiled step asks of a model, so only the pool can stop it
    return SimpleNamespace(
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        max_packed_rows=4,
        config=SimpleNamespace(num_heads=4),
    )


def test_a_windowed_pool_is_not_given_to_the_compiled_decode_step() -> None:
    windows = (LayerAttention(window=8), LayerAttention())
    windowed = PagePool(2, 4, 16, 1, 16, torch.bfloat16, "cpu", windows)
    plain = PagePool(2, 4, 16, 1, 16, torch.bfloat16, "cpu")
    reason = unavailable_reason(_model(), windowed)
    assert reason is not None and "sliding window" in reason
    assert "sliding window" not in (unavailable_reason(_model(), plain) or "")
    with pytest.raises(ValueError, match="sliding windows"):
        GraphDecodeAttention(windowed, SimpleNamespace(batch_size=1))  # type: ignore[arg-type]
