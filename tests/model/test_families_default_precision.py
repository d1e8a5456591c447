"""Every family loads and decodes at the served defaults (``--dtype auto --weights auto``),
whatever dense dtype this CPU picks: bf16 dense weights where it has AVX512-BF16 or AMX
(prepacked for oneDNN), float32 elsewhere. The exactness tests run in float32; this is the
precision a server runs in."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from service.model import load_model
from service.model.layers import _prepacks, dense
from tests.fixtures import tiny_families as tf
from tests.model.test_families_gemma_moe import CHECKPOINTS
from tests.model.test_native_gemv import _greedy_alone

WRITERS: dict[str, Callable[[Path], Path]] = {
    "qwen2_windowed": tf.write_qwen2_windowed,
    "phi3": tf.write_phi3,
    **{name: (lambda d, n=name: tf.write_tiny(d, n, **CHECKPOINTS[n])) for name in CHECKPOINTS},
}


def test_an_empty_dense_weight_is_never_prepacked() -> None:
    """A mixture-of-experts layer has no dense MLP: its ``[0, H]`` weight stays a plain matmul
    (oneDNN has no primitive for it) and answers ``[T, 0]``."""
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    assert not _prepacks(empty)
    assert dense(empty, torch.float32)(torch.ones(3, 64)).shape == (3, 0)


@pytest.mark.parametrize("name", list(WRITERS))
def test_each_family_decodes_at_the_served_defaults(name: str, tmp_path: Path) -> None:
    lm = load_model(WRITERS[name](tmp_path / name), progress=False)
    got = _greedy_alone(lm, 0, 5, 12, 6)
    assert len(got) == 6
    assert all(0 <= t < lm.model.config.vocab_size and math.isfinite(lp) for t, lp in got)
