"""Sliding-window layers: every attention path reads only each query's last ``window`` keys.

A pool whose second layer has a window of 5 (page size 4, so windows start mid-page) runs
prefill chunks longer than the window, a chunk continuing a prefix, decodes, and a short
sequence beside them; each path's output is checked against the dense oracle with the same
windows, and the oracle without them is far away (so a path that ignored the window fails).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcache import KVCacheManager, PagePool
from kvcache.attention import LayerAttention
from kvcache.backends import cpu_decode
from kvcache.backends.flashinfer_backend import FlashInferBackend, HeadShape
from kvcache.dense import DenseAttention

from .fake_flashinfer import ReferenceWrapper
from .layer_steps import HKV, HQ, PAGE, D, manager, pick_decode_backend, run_steps

WINDOW = 5
WINDOWS = (0, WINDOW)


def _manager(dtype: torch.dtype, backend: Any = None) -> KVCacheManager:
    return manager(dtype, tuple(LayerAttention(window=w) for w in WINDOWS), backend)


def _run(mgr: KVCacheManager, native: bool = False) -> tuple[float, float]:
    """The steps through the pool: the largest difference from the windowed dense oracle,
    and the smallest largest-difference from the full one."""
    return run_steps(mgr, lambda: DenseAttention(2, WINDOWS), lambda: DenseAttention(2), native)


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_backend_honours_each_layers_window(
    monkeypatch: pytest.MonkeyPatch, kernel: bool, dtype: torch.dtype
) -> None:
    pick_decode_backend(monkeypatch, kernel)
    worst, far = _run(_manager(dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert worst <= tol
    assert far > 0.05  # the full-attention oracle is far: the window is what matched


def test_native_model_code_gets_each_layers_window_through_the_step_context() -> None:
    if cpu_decode.kernel() is None:
        pytest.skip("no C compiler for the decode kernel")
    worst, far = _run(_manager(torch.float32), native=True)
    assert worst <= 1e-5 and far > 0.05


def test_the_c_kernel_reads_only_the_window_from_mid_page() -> None:
    """One decode row at 10 keys over pages of 4 with window 5: keys 5..9 (from offset 1
    of the second page); poisoning keys 0..4 with huge values changes nothing."""
    kernel = cpu_decode.kernel()
    if kernel is None:
        pytest.skip("no C compiler for the decode kernel")
    gen = torch.Generator().manual_seed(3)
    layer = torch.randn(3, 2, PAGE, HKV, D, generator=gen)
    q = torch.randn(1, HQ, D, generator=gen)
    meta = (
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([10], dtype=torch.int32),
    )
    out = kernel.run(q, layer, *meta, WINDOW)
    poisoned = layer.clone()
    poisoned.view(-1, 2, PAGE, HKV, D)[0, :, :] = 1e4  # keys 0..3
    poisoned[1, :, 0] = 1e4  # key 4
    assert torch.allclose(kernel.run(q, poisoned, *meta, WINDOW), out, atol=1e-6)
    assert not torch.allclose(kernel.run(q, poisoned, *meta), out, atol=1e-2)


def test_flashinfer_plans_each_window_with_its_window_left() -> None:
    """FlashInfer (the CPU reference of its plan/run contract): one pair of wrappers per
    window, planned with ``window_left = window - 1`` (-1 for full layers), outputs equal to
    the windowed oracle."""
    made: list[ReferenceWrapper] = []

    def wrappers(kind: str) -> ReferenceWrapper:
        made.append(ReferenceWrapper(kind))
        return made[-1]

    backend = FlashInferBackend(HeadShape(HQ, HKV, D, PAGE, torch.float32), "cpu", wrappers)
    worst, far = _run(_manager(torch.float32, backend))
    assert worst <= 1e-5 and far > 0.05
    assert len(made) == 4  # decode and prefill, for window 0 and for window 5
    assert sorted(w.window_left for w in made) == [-1, -1, WINDOW - 1, WINDOW - 1]
    assert all(w.plans > 0 for w in made)


def test_a_pool_refuses_a_window_count_that_is_not_one_per_layer() -> None:
    with pytest.raises(ValueError, match="layer attentions"):
        PagePool(2, 4, PAGE, HKV, D, torch.float32, "cpu", (LayerAttention(window=4),))
    with pytest.raises(ValueError, match="window"):
        LayerAttention(window=-1)
    assert PagePool(2, 4, PAGE, HKV, D, attention=(LayerAttention(), LayerAttention())).windows == ()
