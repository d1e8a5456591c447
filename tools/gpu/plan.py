"""What ``gpu_check`` runs: the full plan for an H200, and the dry run's tiny CPU plan that
goes through the same code (torch backend, graphs replayed eagerly, no CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tools.gpu.models import LLAMA_31_8B, Shape


@dataclass(frozen=True, slots=True)
class GreedyRun:
    backend: str  # "torch" | "flashinfer"
    dtype: torch.dtype
    graphed: bool

    @property
    def name(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.backend}/{dtype}/{'graphed' if self.graphed else 'eager'}"


@dataclass(frozen=True, slots=True)
class Plan:
    dry_run: bool
    device: str
    page_size: int
    # step 1
    pytest_paths: tuple[str, ...]
    # step 2
    tiny: Shape  # vocab comes from the tiny tokenizer
    archs: tuple[str, ...]
    greedy_runs: tuple[GreedyRun, ...]
    greedy_prompts: int
    greedy_prompt_len: int
    greedy_new_tokens: int
    # step 3
    big: Shape
    big_dtype: torch.dtype
    throughput_backend: str
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int  # kvfence; the decode steps are new_tokens - 1
    hf_new_tokens: int  # transformers is slower: fewer tokens, same per-step measure
    bandwidth_bytes: int
    # step 4 (isolation) uses the throughput backend on a small pool


GREEDY_ARCHS = ("llama", "qwen2", "qwen3")
CUDA_TESTS = ("tests/kvcache/test_flashinfer.py", "tests/gpu")


def full_plan() -> Plan:
    bf16 = torch.bfloat16
    return Plan(
        dry_run=False,
        device="cuda",
        page_size=16,
        pytest_paths=CUDA_TESTS,
        # NOTE: head_dim 128 as in the 8B model, so FlashInfer JIT-compiles one set of kernels.
        tiny=Shape(
            hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=128, vocab=0
        ),
        archs=GREEDY_ARCHS,
        greedy_runs=(
            GreedyRun("torch", torch.float32, False),
            GreedyRun("torch", torch.float32, True),
            GreedyRun("torch", bf16, True),
            GreedyRun("flashinfer", bf16, False),
            GreedyRun("flashinfer", bf16, True),
        ),
        greedy_prompts=4,
        greedy_prompt_len=24,
        greedy_new_tokens=32,
        big=LLAMA_31_8B,
        big_dtype=bf16,
        throughput_backend="flashinfer",
        batches=(1, 8, 64, 256),
        prompt_len=128,
        new_tokens=128,
        hf_new_tokens=32,
        bandwidth_bytes=4 << 30,
    )


def dry_run_plan() -> Plan:
    f32 = torch.float32
    return Plan(
        dry_run=True,
        device="cpu",
        page_size=4,
        pytest_paths=CUDA_TESTS,
        tiny=Shape(
            hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=0
        ),
        archs=GREEDY_ARCHS,
        greedy_runs=(GreedyRun("torch", f32, False), GreedyRun("torch", f32, True)),
        greedy_prompts=3,
        greedy_prompt_len=10,
        greedy_new_tokens=8,
        big=Shape(
            hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=512
        ),
        big_dtype=f32,
        throughput_backend="torch",
        batches=(1, 4),
        prompt_len=8,
        new_tokens=6,
        hf_new_tokens=4,
        bandwidth_bytes=16 << 20,
    )
