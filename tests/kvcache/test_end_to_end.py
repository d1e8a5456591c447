"""Greedy generation with the default model through paged KV matches transformers.

Two tenants' sequences run batched together: prefill in chunks, then decode in one step
per token. A third sequence of the first tenant reuses the prefix cache. Page sizes 16 and
1. The oracle is transformers' own greedy loop, token for token.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcache import CacheConfig, KVCacheManager, PagePool, StepEntry
from service.model import LoadedModel

from .helpers import FakeClock, attn_of, grow

# Loads transformers beside the default model (about 20 s on 2 cores): the slow tier.
pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPTS = {
    "a": "The capital of France is Paris. The capital of Germany is",
    "b": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
}
TENANTS = {"a": "tenant-a", "b": "tenant-b", "a2": "tenant-a"}


def hf_greedy(hf_model: Any, ids: list[int], n: int) -> list[int]:
    """transformers' own forward with its own KV cache, argmax each step."""
    from transformers import DynamicCache

    out: list[int] = []
    cache = DynamicCache()
    inputs = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            result = hf_model(input_ids=inputs, cache=cache, use_cache=True)
            out.append(int(result.logits[0, -1].argmax()))
            inputs = torch.tensor([[out[-1]]])
    return out


def paged_greedy(
    loaded: LoadedModel,
    mgr: KVCacheManager,
    prompts: dict[str, list[int]],
    chunk: int,
    new_tokens: int = NEW_TOKENS,
) -> dict[str, list[int]]:
    """Batched chunked prefill + batched decode through KVCacheManager."""
    model = loaded.model
    tokens = {s: list(ids) for s, ids in prompts.items()}
    computed = {s: mgr.open(s, TENANTS[s], ids) for s, ids in prompts.items()}
    out: dict[str, list[int]] = {s: [] for s in prompts}
    while any(len(o) < new_tokens for o in out.values()):
        entries, ids, positions, sample_rows, sampled = [], [], [], [], []
        for s in prompts:
            if len(out[s]) == new_tokens:
                continue
            n = min(chunk, len(tokens[s]) - computed[s])
            grow(mgr, s, computed[s] + n)
            entries.append(StepEntry(s, computed[s], n))
            ids.extend(tokens[s][computed[s] : computed[s] + n])
            positions.extend(range(computed[s], computed[s] + n))
            if computed[s] + n == len(tokens[s]):
                sample_rows.append(len(ids) - 1)
                sampled.append(s)
        attn = attn_of(mgr, entries)
        rows = torch.tensor(sample_rows, dtype=torch.long)
        logits = model(torch.tensor(ids), torch.tensor(positions), attn, rows)
        for e in entries:
            computed[e.seq_id] += e.num_new
            mgr.commit(e.seq_id, tokens[e.seq_id], computed[e.seq_id])
        for s, row in zip(sampled, logits, strict=True):
            token = int(row.argmax())
            out[s].append(token)
            tokens[s].append(token)  # the caller owns the tokens; the cache reads them at commit
    for s in prompts:
        mgr.free(s)
    return out


@pytest.fixture(scope="module")
def prompts(default_model: LoadedModel) -> dict[str, list[int]]:
    return {s: default_model.tokenizer.encode(p) for s, p in PROMPTS.items()}


@pytest.fixture(scope="module")
def expected(hf_oracle: tuple[Any, Any], prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return {s: hf_greedy(hf_oracle[0], ids, NEW_TOKENS) for s, ids in prompts.items()}


@pytest.mark.parametrize(("page_size", "chunk"), [(16, 13), (1, 7)])
def test_paged_greedy_matches_transformers(
    default_model: LoadedModel,
    prompts: dict[str, list[int]],
    expected: dict[str, list[int]],
    page_size: int,
    chunk: int,
) -> None:
    cfg = default_model.model.config
    pool = PagePool(
        cfg.num_layers, 512 // page_size + 16, page_size, cfg.num_kv_heads, cfg.head_dim
    )
    mgr = KVCacheManager(pool, CacheConfig(page_size=page_size), FakeClock())

    assert paged_greedy(default_model, mgr, prompts, chunk) == expected
    # tenant a continues its own text: the prompt and generated pages come from the cache
    half = NEW_TOKENS // 2
    resumed = prompts["a"] + expected["a"][:half]
    again = paged_greedy(default_model, mgr, {"a2": resumed}, chunk, half)
    assert again == {"a2": expected["a"][half:]}
    hit = (len(resumed) - 1) // page_size * page_size
    assert hit >= 16 and mgr.usage("tenant-a").hit_tokens == hit
    assert mgr.usage("tenant-b").hit_tokens == 0
