"""FlashInfer backend == torch backend on GPU (bf16, GQA 3:1, prefill chunks + decodes)."""

from __future__ import annotations

import random

import pytest
import torch

from kvcache import CacheConfig, KVCacheManager, PagePool, StepEntry
from kvcache.backends.torch_backend import TorchBackend

from .helpers import SECRET, FakeClock, attn_of, grow

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_matches_torch(page_size: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    from kvcache.backends.flashinfer_backend import FlashInferBackend

    rng = random.Random(page_size)
    torch.manual_seed(page_size)
    hq, hkv, d, layers = 9, 3, 64, 2
    pool = PagePool(layers, 2048 // page_size + 64, page_size, hkv, d, torch.bfloat16, "cuda")
    fi = FlashInferBackend("cuda")
    mgr = KVCacheManager(pool, CacheConfig(page_size=page_size, secret=SECRET), FakeClock(), fi)
    plans = {
        "s0": [40, 1, 1, 23, 1],
        "s1": [1, 1, 1, 1, 1],
        "s2": [100, 60, 1, 1, 1],
        "s3": [17, 1, 1, 1, 1],
    }
    for s, plan in plans.items():
        mgr.open(s, "t", list(range(sum(plan))), use_prefix_cache=False)
    done = dict.fromkeys(plans, 0)
    torch_backend = TorchBackend()
    for step_no in range(5):
        order = rng.sample(sorted(plans), len(plans))
        entries = []
        for s in order:
            grow(mgr, s, done[s] + plans[s][step_no])
            entries.append(StepEntry(s, done[s], plans[s][step_no]))
        t = sum(e.num_new for e in entries)
        step = attn_of(mgr, entries)
        reference = torch_backend.prepare(step.metadata)
        for layer in range(layers):
            q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
            got = step(layer, q, k, v)  # writes k/v, runs flashinfer
            want = reference(q, pool.layer(layer))
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        for e in entries:
            done[e.seq_id] += e.num_new
            mgr.commit(e.seq_id, range(sum(plans[e.seq_id])), done[e.seq_id])
