"""Steps through a pool whose layers carry attention facts (windows, softcaps), checked
against the dense oracle: a long prefill, a chunk continuing a prefix, decodes, and a short
sequence beside them (pages of 4, so windows start mid-page)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from kvcache import CacheConfig, KVCacheManager, PagePool, StepEntry
from kvcache.attention import LayerAttention
from kvcache.backends import cpu_decode
from kvcache.dense import DenseAttention

from .helpers import SECRET, FakeClock, attn_of, grow

HQ, HKV, D, PAGE = 4, 2, 32, 4
# per sequence, new tokens in each step (0: not in it): long prefill, a continuing chunk,
# decodes; "b" stays short
STEPS = {"a": [11, 6, 1, 1, 1], "b": [3, 1, 1, 1, 0]}
ATTEND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 4)


def manager(
    dtype: torch.dtype, attention: Sequence[LayerAttention], backend: Any = None
) -> KVCacheManager:
    """A two-layer pool of 64 pages with ``attention`` per layer."""
    pool = PagePool(2, 64, PAGE, HKV, D, dtype, "cpu", tuple(attention))
    return KVCacheManager(pool, CacheConfig(page_size=PAGE, secret=SECRET), FakeClock(), backend)


def run_steps(
    mgr: KVCacheManager,
    oracle: Callable[[], DenseAttention],
    other: Callable[[], DenseAttention],
    native: bool = False,
    scale: float = 1.0,
) -> tuple[float, float]:
    """Every step of STEPS through the pool (through the step context's C function for
    native model code with ``native``); returns the largest difference from ``oracle`` and
    the smallest largest-difference from ``other`` (layer 1 of "a" after its first step).
    q and k are drawn times ``scale`` (large scores for a softcap to act on)."""
    dense = {s: oracle() for s in STEPS}
    far_oracle = {s: other() for s in STEPS}
    done = dict.fromkeys(STEPS, 0)
    for s, plan in STEPS.items():
        mgr.open(s, "t", list(range(sum(plan))), use_prefix_cache=False)
    worst, far = 0.0, float("inf")
    gen = torch.Generator().manual_seed(0)
    for step_no in range(len(STEPS["a"])):
        entries = []
        for s, plan in STEPS.items():
            if plan[step_no]:
                grow(mgr, s, done[s] + plan[step_no])
                entries.append(StepEntry(s, done[s], plan[step_no]))
        step = attn_of(mgr, entries)
        t = step.metadata.num_tokens
        attend = step.native_attend(HQ) if native else None
        for layer in range(2):
            q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
            q, k = q * scale, k * scale
            q, k, v = (x.to(mgr.pool.dtype) if attend is None else x for x in (q, k, v))
            if attend is not None:
                out = torch.empty_like(q)
                status = ATTEND(attend.fn)(
                    attend.ctx, layer, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
                )
                assert status == 0
            else:
                out = step(layer, q, k, v)
            row = 0
            for e in entries:
                rows = slice(row, row + e.num_new)
                want = dense[e.seq_id](layer, q[rows], k[rows], v[rows]).float()
                away = far_oracle[e.seq_id](layer, q[rows], k[rows], v[rows]).float()
                worst = max(worst, (out[rows].float() - want).abs().max().item())
                if layer == 1 and e.seq_id == "a" and step_no > 0:
                    far = min(far, (out[rows].float() - away).abs().max().item())
                row += e.num_new
        for e in entries:
            done[e.seq_id] += e.num_new
    return worst, far


def pick_decode_backend(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> None:
    """Run the torch backend's attention on the C decode kernel (skipped where it cannot be
    built) or, with ``kernel`` False, on torch alone."""
    if kernel and cpu_decode.kernel() is None:
        pytest.skip("no C compiler for the decode kernel")
    if not kernel:
        monkeypatch.setattr(cpu_decode, "kernel", lambda: None)
