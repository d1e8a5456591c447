"""Attention-logit softcapping (Gemma 2): every attention path takes each scaled score ``s``
as ``cap * tanh(s / cap)`` before the softmax, on every layer that has a cap.

The pool's layers both carry a cap of 2 (the second a window of 5 as well) and q, k are drawn
large, so most scores exceed the cap: each path's output is checked against the dense oracle
with the same caps, and the oracle without them is far away (a path that ignored the cap
fails).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcache import KVCacheManager, PagePool
from kvcache.attention import LayerAttention
from kvcache.backends import cpu_decode
from kvcache.backends.flashinfer_backend import FlashInferBackend, HeadShape
from kvcache.backends.torch_backend import softcapped_attention
from kvcache.dense import DenseAttention, causal_attention
from kvcache.errors import KernelRefused

from .fake_flashinfer import ReferenceWrapper
from .layer_steps import HKV, HQ, PAGE, D, manager, pick_decode_backend, run_steps

CAP, WINDOW = 2.0, 5
WINDOWS, CAPS = (0, WINDOW), (CAP, CAP)
SCALE = 2.0  # q and k drawn times this: scaled scores of several units, past the cap


def _manager(dtype: torch.dtype, backend: Any = None) -> KVCacheManager:
    layers = tuple(LayerAttention(window=w, softcap=c) for w, c in zip(WINDOWS, CAPS, strict=True))
    return manager(dtype, layers, backend)


def _run(mgr: KVCacheManager, native: bool = False) -> tuple[float, float]:
    return run_steps(
        mgr,
        lambda: DenseAttention(2, WINDOWS, CAPS),
        lambda: DenseAttention(2, WINDOWS),
        native,
        SCALE,
    )


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_backend_caps_each_layers_scores(
    monkeypatch: pytest.MonkeyPatch, kernel: bool, dtype: torch.dtype
) -> None:
    pick_decode_backend(monkeypatch, kernel)
    worst, far = _run(_manager(dtype))
    assert worst <= (1e-5 if dtype == torch.float32 else 3e-2)
    assert far > 0.1  # the uncapped oracle is far: the cap is what matched


def test_native_model_code_gets_each_layers_softcap_through_the_step_context() -> None:
    if cpu_decode.kernel() is None:
        pytest.skip("no C compiler for the decode kernel")
    worst, far = _run(_manager(torch.float32), native=True)
    assert worst <= 1e-5 and far > 0.1


def test_flashinfer_plans_each_softcap_with_its_logits_soft_cap() -> None:
    """FlashInfer (the CPU reference of its plan/run contract): one pair of wrappers per
    (window, softcap), each planned with ``logits_soft_cap``; outputs equal the oracle's."""
    made: list[ReferenceWrapper] = []

    def wrappers(kind: str) -> ReferenceWrapper:
        made.append(ReferenceWrapper(kind))
        return made[-1]

    backend = FlashInferBackend(HeadShape(HQ, HKV, D, PAGE, torch.float32), "cpu", wrappers)
    worst, far = _run(_manager(torch.float32, backend))
    assert worst <= 1e-5 and far > 0.1
    planned = made[2:]  # the first pair is the plain layers', made with the backend
    assert len(planned) == 4 and all(w.plans > 0 for w in planned)
    assert {(w.window_left, w.soft_cap) for w in planned} == {(-1, CAP), (WINDOW - 1, CAP)}


def test_the_c_kernel_caps_scores_and_refuses_a_cap_below_zero_or_not_finite() -> None:
    kernel = cpu_decode.kernel()
    if kernel is None:
        pytest.skip("no C compiler for the decode kernel")
    gen = torch.Generator().manual_seed(5)
    layer = torch.randn(3, 2, PAGE, HKV, D, generator=gen) * SCALE
    q = torch.randn(1, HQ, D, generator=gen) * SCALE
    meta = (
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([10], dtype=torch.int32),
    )
    k = layer[:, 0].reshape(-1, HKV, D)[:10]
    v = layer[:, 1].reshape(-1, HKV, D)[:10]
    want = causal_attention(q, k, v, 9, softcap=CAP)
    assert torch.allclose(kernel.run(q, layer, *meta, 0, CAP), want, atol=1e-5)
    assert not torch.allclose(kernel.run(q, layer, *meta), want, atol=1e-2)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(KernelRefused, match="softcap"):
            kernel.run(q, layer, *meta, 0, bad)


def test_the_explicit_path_is_sdpa_where_the_cap_is_far_above_every_score() -> None:
    """Its masks, causal alignment and GQA are SDPA's: with a cap no score comes near
    (tanh(s / cap) * cap == s to float32 precision), outputs agree."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, HQ, 7, D, generator=gen)
    k, v = (torch.randn(1, HKV, 7, D, generator=gen) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    got = softcapped_attention(q, k, v, None, True, 1e6)
    assert torch.allclose(got, want, atol=1e-5)
    mask = torch.rand(7, 7, generator=gen) > 0.3
    mask[:, 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True
    )
    assert torch.allclose(softcapped_attention(q, k, v, mask, False, 1e6), want, atol=1e-5)


def test_a_softcap_is_layer_data_checked_at_construction() -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            LayerAttention(softcap=bad)
    pool = PagePool(2, 4, PAGE, HKV, D, attention=(LayerAttention(softcap=CAP), LayerAttention()))
    assert pool.softcaps == (CAP, 0.0) and pool.windows == ()
    assert (
        PagePool(2, 4, PAGE, HKV, D, attention=(LayerAttention(), LayerAttention())).softcaps == ()
    )
