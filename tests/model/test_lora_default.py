"""A random PEFT LoRA on the default model (SmolLM2-135M, dense float32): kvfence's greedy
tokens equal transformers + peft's merged model, at rank 8 and 64, all seven projections."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from service.model import LoadedModel
from service.model.lora import load_lora
from tests.fixtures.tiny_lora import greedy_with_adapter, write_random_lora
from tools.parity.checks import greedy_ours, hf_agrees_with_greedy
from tools.parity.corpus import PROMPTS

# Loading the transformers oracle of the default model takes minutes on 2 busy cores.
pytestmark = pytest.mark.slow

TOKENS = 16


@pytest.mark.parametrize(("rank", "std"), [(8, 0.03), (64, 0.02)])
def test_default_model_adapter_tokens_equal_the_peft_merged_model(
    default_model: LoadedModel,
    hf_oracle: tuple[Any, Any],
    tmp_path: Path,
    rank: int,
    std: float,
) -> None:
    merged = write_random_lora(copy.deepcopy(hf_oracle[0]), tmp_path, rank=rank, seed=rank, std=std)
    model = default_model.model
    adapter = load_lora("a", tmp_path, model.config, torch.float32, max_rank=64)
    assert set(adapter.groups) == {"qkv", "o", "gate_up", "down"}
    ids = default_model.tokenizer.encode(PROMPTS[0])
    ours = greedy_with_adapter(model, adapter, ids, TOKENS)
    assert ours != greedy_ours(model, ids, TOKENS)  # the adapter changes the output
    assert hf_agrees_with_greedy(merged, ids, ours)
    assert greedy_with_adapter(model, None, ids, TOKENS) == greedy_ours(model, ids, TOKENS)
