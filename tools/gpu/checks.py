"""Steps 1, 2 and 4 of the GPU check: the CUDA test suite, greedy equality end to end, and
the isolation checks that touch device memory."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

from kvcache import CacheConfig, KVCacheManager, PagePool, PageRef, StepEntry
from kvcache.backends import AttentionBackend
from kvcache.backends.base import StepKernel
from kvcache.metadata import AttentionMetadata
from service.engine.cuda_graphs import decode_buckets
from service.model import load_model
from tools.gpu.greedy import (
    LOGIT_ERROR_BOUND,
    NEAR_TIE_FLOOR,
    compare,
    hf_greedy,
    hf_teacher_logits,
)
from tools.gpu.loop import generate
from tools.gpu.models import write_tiny
from tools.gpu.plan import Plan
from tools.gpu.setup import make_backend, make_cache, make_graphs

ROOT = Path(__file__).resolve().parents[2]


def pytest_check(plan: Plan, junit: Path) -> dict[str, Any]:
    """``pytest -m cuda`` over the CUDA tests, counted from its JUnit report."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *plan.pytest_paths,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    return {**counts, "returncode": proc.returncode, "tail": proc.stdout[-2000:]}


def _prompts(plan: Plan, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab) for _ in range(plan.greedy_prompt_len)]
        for _ in range(plan.greedy_prompts)
    ]


def greedy_check(plan: Plan, workdir: Path) -> list[dict[str, Any]]:
    """Every (arch, run): kvfence's greedy tokens and logits against transformers float32."""
    from transformers import AutoModelForCausalLM

    device = torch.device(plan.device)
    n = plan.greedy_new_tokens
    out = []
    for seed, arch in enumerate(plan.archs):
        path = write_tiny(workdir / arch, arch, plan.tiny, seed)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        prompts = _prompts(plan, hf.config.vocab_size, seed)
        refs = [hf_greedy(hf, p, n) for p in prompts]
        for run in plan.greedy_runs:
            dtype_name = str(run.dtype).removeprefix("torch.")
            model = load_model(path, dtype=dtype_name, device=plan.device, progress=False).model
            pages = plan.greedy_prompts * -(-(plan.greedy_prompt_len + n) // plan.page_size) + 1
            cache, backend = make_cache(model, run.backend, plan.page_size, pages)
            graphs = None
            if run.graphed:
                buckets = decode_buckets(plan.greedy_prompts)
                graphs = make_graphs(model, cache, backend, buckets, plan.greedy_prompt_len + n)
            gen = generate(model, cache, prompts, n, graphs, keep_logits=True)
            assert gen.logits is not None
            error = max(
                (gen.logits[:, i] - hf_teacher_logits(hf, p, ours)).abs().max().item()
                for i, (p, ours) in enumerate(zip(prompts, gen.tokens, strict=True))
            )
            tol = max(NEAR_TIE_FLOOR, 2 * error)
            verdicts = [
                compare(ref, gaps, ours, tol)
                for (ref, gaps), ours in zip(refs, gen.tokens, strict=True)
            ]
            out.append(
                {
                    "arch": arch,
                    "run": run.name,
                    "sequences": len(verdicts),
                    "identical": sum(v.identical for v in verdicts),
                    "near_ties": sum(v.near_tie_at is not None for v in verdicts),
                    "mismatched_tokens": sum(v.mismatched for v in verdicts),
                    "graph_replays": gen.graph_replays,
                    "max_logit_error": error,
                    "logit_error_bound": LOGIT_ERROR_BOUND[run.dtype],
                    "near_tie_tolerance_nats": tol,
                }
            )
    return out


class _CountingBackend:
    """Wraps a backend and counts the steps it prepared (planned) and the kernels it ran."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.prepared = 0
        self.kernel_calls = 0

    def prepare(self, metadata: AttentionMetadata) -> StepKernel:
        self.prepared += 1
        kernel = self.inner.prepare(metadata)

        def run(
            q: torch.Tensor, kv_layer: torch.Tensor, window: int = 0, softcap: float = 0.0
        ) -> torch.Tensor:
            self.kernel_calls += 1
            return kernel(q, kv_layer, window, softcap)

        return run


def isolation_check(plan: Plan) -> dict[str, Any]:
    """On the device's memory: a page passed from tenant a to tenant b reads zeros, and a
    stale generation is refused before any plan or kernel."""
    device = torch.device(plan.device)
    s, dtype, ps = plan.tiny, plan.big_dtype, plan.page_size
    backend = _CountingBackend(
        make_backend(plan.throughput_backend, s.heads, s.kv_heads, s.head_dim, ps, dtype, device)
    )
    pool = PagePool(2, 1, ps, s.kv_heads, s.head_dim, dtype, device)
    mgr = KVCacheManager(pool, CacheConfig(page_size=ps, secret=b"iso" * 11), lambda: 0.0, backend)

    def run_step(seq: str, tokens: list[int], done: int, new: int) -> None:
        step = mgr.begin_step([StepEntry(seq, done, new)]).attn
        assert step is not None, "the fence refused a clean step"
        for layer in range(2):
            q = torch.randn(new, s.heads, s.head_dim, device=device, dtype=dtype)
            k = torch.randn(new, s.kv_heads, s.head_dim, device=device, dtype=dtype).abs() + 1
            v = torch.randn(new, s.kv_heads, s.head_dim, device=device, dtype=dtype).abs() + 1
            step(layer, q, k, v)
        mgr.commit(seq, tokens, done + new)

    mgr.open("a1", "a", list(range(3, 3 + ps)), use_prefix_cache=False)
    mgr.allocate_slots("a1", ps)
    run_step("a1", list(range(3, 3 + ps)), 0, ps)
    page = mgr.sequence_pages("a1")[0].page_id
    written_by_a = bool(pool.kv[:, page].ne(0).all().item())
    mgr.free("a1")
    mgr.open("b1", "b", [5], use_prefix_cache=False)
    mgr.allocate_slots("b1", 1)
    reused = mgr.sequence_pages("b1")[0].page_id == page
    zero_when_handed = bool(pool.kv[:, page].eq(0).all().item())
    run_step("b1", [5], 0, 1)
    rest_zero = bool(pool.kv[:, page, :, 1:].eq(0).all().item())

    # A stale generation spliced into b's table (a freed page's old life): refused first.
    mgr.allocate_slots("b1", 2)
    ref = mgr.sequence_pages("b1")[0]
    mgr.inject_page_ref("b1", 0, PageRef(ref.page_id, ref.generation - 1))  # the test hook
    prepared, calls, before = backend.prepared, backend.kernel_calls, pool.kv.clone()
    refused = bool(mgr.begin_step([StepEntry("b1", 1, 1)]).refused)
    mgr.inject_page_ref("b1", 0, ref)
    return {
        "backend": plan.throughput_backend,
        "device": plan.device,
        "page_written_by_a_nonzero": written_by_a,
        "page_reused_by_b": reused,
        "zero_when_handed_to_b": zero_when_handed,
        "rest_of_page_zero_after_b_step": rest_zero,
        "scrubs": mgr.stats().scrubs,
        "stale_generation_refused": refused,
        "plans_after_refusal": backend.prepared - prepared,
        "kernels_after_refusal": backend.kernel_calls - calls,
        "kv_unchanged_by_refusal": bool(torch.equal(before, pool.kv)),
    }
