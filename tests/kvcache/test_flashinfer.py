"""FlashInfer backend == torch backend: prefill chunks, decodes and mixed steps, page sizes 1
and 16, GQA 4:1; every plan happens in ``begin_step``, after the fence.

Each test runs twice: on CPU against ``fake_flashinfer`` (FlashInfer's documented plan/run
contract in torch, float32, tight tolerance), and, marked ``cuda``, on a GPU against the real
library in bf16 (tolerance 2e-2 absolute and relative: bf16 keeps 8 mantissa bits, and the two
backends sum in different orders).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvcache import CacheConfig, FenceViolation, KVCacheManager, PagePool, PageRef, StepEntry
from kvcache.backends.flashinfer_backend import FlashInferBackend, HeadShape
from kvcache.backends.torch_backend import TorchBackend

from .fake_flashinfer import ReferenceWrapper
from .helpers import SECRET, FakeClock

HQ, HKV, D, LAYERS = 8, 2, 128, 2
SCENARIOS = {
    # per sequence, the new tokens of each step (0 = not in that step)
    "prefill": {"s0": [40, 23], "s1": [100, 60], "s2": [17, 5]},
    "decode": {"s0": [40, 1, 1, 1], "s1": [3, 1, 1, 1], "s2": [100, 1, 1, 1]},
    "mixed": {
        "s0": [40, 1, 1, 23, 1],
        "s1": [1, 1, 1, 1, 1],
        "s2": [100, 60, 1, 1, 1],
        "s3": [17, 1, 1, 1, 1],
    },
}
TARGETS = [
    pytest.param("cpu", id="cpu-contract"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


def _setup(device: str, page_size: int) -> tuple[KVCacheManager, FlashInferBackend, float]:
    if device == "cuda":
        pytest.importorskip("flashinfer")
        dtype, tol, wrappers = torch.bfloat16, 2e-2, None
    else:
        dtype, tol, wrappers = torch.float32, 1e-5, ReferenceWrapper
    pool = PagePool(LAYERS, 2048 // page_size + 64, page_size, HKV, D, dtype, device)
    backend = FlashInferBackend(HeadShape(HQ, HKV, D, page_size, dtype), device, wrappers)
    mgr = KVCacheManager(
        pool, CacheConfig(page_size=page_size, secret=SECRET), FakeClock(), backend
    )
    return mgr, backend, tol


def _count_plans(backend: FlashInferBackend) -> list[int]:
    """Wraps both wrappers' ``plan`` (fake or real) with a counter; returns [decode, prefill]."""
    counts = [0, 0]
    for i, wrapper in enumerate((backend.decode, backend.prefill)):
        inner = wrapper.plan

        def plan(*args: Any, _i: int = i, _inner: Any = inner, **kwargs: Any) -> None:
            counts[_i] += 1
            _inner(*args, **kwargs)

        wrapper.plan = plan
    return counts


@pytest.mark.parametrize("device", TARGETS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_matches_torch(device: str, scenario: str, page_size: int) -> None:
    mgr, backend, tol = _setup(device, page_size)
    plans = _count_plans(backend)
    pool = mgr.pool
    steps = SCENARIOS[scenario]
    rng = random.Random(page_size)
    torch.manual_seed(page_size)
    for s, plan in steps.items():
        mgr.open(s, "t", list(range(sum(plan))), use_prefix_cache=False)
    done = dict.fromkeys(steps, 0)
    reference_backend = TorchBackend()
    for step_no in range(len(next(iter(steps.values())))):
        entries = []
        for s in rng.sample(sorted(steps), len(steps)):
            mgr.allocate_slots(s, steps[s][step_no])
            entries.append(StepEntry(s, done[s], steps[s][step_no]))
        t = sum(e.num_new for e in entries)
        has_decode = any(e.num_new == 1 for e in entries)
        has_prefill = any(e.num_new != 1 for e in entries)
        before = list(plans)
        step = mgr.begin_step(entries)
        # Planned in begin_step, once per kind present, before any layer runs.
        assert plans == [before[0] + has_decode, before[1] + has_prefill]
        reference = reference_backend.prepare(step.metadata)
        for layer in range(LAYERS):
            q = torch.randn(t, HQ, D, device=device, dtype=pool.dtype)
            k = torch.randn(t, HKV, D, device=device, dtype=pool.dtype)
            v = torch.randn(t, HKV, D, device=device, dtype=pool.dtype)
            got = step(layer, q, k, v)  # writes k/v, runs flashinfer
            want = reference(q, pool.layer(layer))
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert plans == [before[0] + has_decode, before[1] + has_prefill]  # layers reuse it
        for e in entries:
            done[e.seq_id] += e.num_new
            mgr.commit(e.seq_id, done[e.seq_id])


@pytest.mark.parametrize("device", TARGETS)
def test_stale_generation_is_refused_before_any_plan(device: str) -> None:
    mgr, backend, _ = _setup(device, 16)
    plans = _count_plans(backend)
    mgr.open("a", "t", list(range(20)), use_prefix_cache=False)
    mgr.allocate_slots("a", 20)
    ref = mgr.sequence_pages("a")[1]
    mgr.inject_page_ref("a", 1, PageRef(ref.page_id, ref.generation - 1))  # an earlier life
    with pytest.raises(FenceViolation, match="stale generation"):
        mgr.begin_step([StepEntry("a", 0, 20)])
    assert plans == [0, 0]
    mgr.inject_page_ref("a", 1, ref)
    mgr.begin_step([StepEntry("a", 0, 20)])
    assert plans == [0, 1]  # the same step, fenced, does plan: the counter can see plans


def test_backend_refuses_a_cpu_device_without_injected_wrappers() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        FlashInferBackend(HeadShape(HQ, HKV, D, 16, torch.bfloat16), "cpu")


@pytest.mark.cuda
def test_scrubbing_zeroes_pages_on_the_gpu() -> None:
    pool = PagePool(LAYERS, 1, 16, HKV, D, torch.bfloat16, "cuda")
    mgr = KVCacheManager(pool, CacheConfig(page_size=16, secret=SECRET), FakeClock())
    mgr.open("a", "tenant-a", list(range(16)), use_prefix_cache=False)
    mgr.allocate_slots("a", 16)
    step = mgr.begin_step([StepEntry("a", 0, 16)])
    for layer in range(LAYERS):
        ones = torch.ones(16, HKV, D, device="cuda", dtype=torch.bfloat16)
        step(layer, torch.ones(16, HQ, D, device="cuda", dtype=torch.bfloat16), ones, ones)
    assert bool(pool.kv.ne(0).all())
    mgr.free("a")
    mgr.open("b", "tenant-b", [1], use_prefix_cache=False)
    mgr.allocate_slots("b", 1)
    assert mgr.sequence_pages("b")[0].page_id == 0
    assert bool(pool.kv.eq(0).all())
    assert mgr.stats().scrubs == 1
