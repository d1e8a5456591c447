"""PEFT LoRA adapters on a tiny random Llama: kvfence's tokens equal transformers + peft's
merged model in float32, the base is unchanged, and what cannot be served is refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache.dense import DenseAttention
from service.model import LoadedModel
from service.model.lora import LoraError, load_lora
from service.model.lora_batch import LoraBatch
from service.model.lora_stack import LoraStacks
from tests.fixtures.tiny_lora import edit_adapter_config, greedy_with_adapter, write_random_lora
from tools.parity.checks import greedy_ours, hf_agrees_with_greedy, logits_hf

PROMPT = [5, 17, 42, 99, 7, 230, 11, 64, 3, 150, 77, 8]
TOKENS = 24


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("lora-base"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> LoadedModel:
    from service.model import load_model

    return load_model(tiny_dir, dtype="float32", progress=False)


def _hf(tiny_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize(("rank", "rslora"), [(8, False), (64, False), (8, True)])
def test_adapter_tokens_equal_the_peft_merged_model(
    tiny: LoadedModel, tiny_dir: Path, tmp_path: Path, rank: int, rslora: bool
) -> None:
    merged = write_random_lora(
        _hf(tiny_dir), tmp_path, rank=rank, seed=rank, std=0.08, use_rslora=rslora
    )
    adapter = load_lora("a", tmp_path, tiny.model.config, torch.float32, max_rank=64)
    assert set(adapter.groups) == {"qkv", "o", "gate_up", "down"}
    ours = greedy_with_adapter(tiny.model, adapter, PROMPT, TOKENS)
    assert ours != greedy_ours(tiny.model, PROMPT, TOKENS)  # the adapter changes the output
    assert hf_agrees_with_greedy(merged, PROMPT, ours)
    # and the logits themselves, not just their argmax
    attn = DenseAttention(tiny.model.config.num_layers)
    lora = LoraBatch.of_rows([adapter] * len(PROMPT), torch.device("cpu"))
    logits = tiny.model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), attn, None, lora)
    assert torch.allclose(logits, logits_hf(merged, PROMPT), atol=1e-4)


def _write(tiny_dir: Path, directory: Path, **kwargs: Any) -> Path:
    write_random_lora(_hf(tiny_dir), directory, seed=1, std=0.05, **kwargs)
    return directory


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"use_dora": True}, "DoRA (use_dora) is not served"),
        ({"peft_type": "IA3"}, "PEFT type 'IA3' is not served (only LORA)"),
        ({"bias": "all"}, "bias = 'all' is not served"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save = ['lm_head'] is not served"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern = {'q_proj': 4} is not served"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target modules ['embed_tokens']"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(
    tiny: LoadedModel, tiny_dir: Path, tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    path = _write(tiny_dir, tmp_path, rank=8)
    edit_adapter_config(path, **change)
    with pytest.raises(LoraError) as err:
        load_lora("a", path, tiny.model.config, torch.float32, max_rank=64)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_rank_above_the_maximum_is_refused(
    tiny: LoadedModel, tiny_dir: Path, tmp_path: Path
) -> None:
    path = _write(tiny_dir, tmp_path, rank=16)
    with pytest.raises(LoraError, match="rank 16 is above the maximum 8"):
        load_lora("a", path, tiny.model.config, torch.float32, max_rank=8)
    assert load_lora("a", path, tiny.model.config, torch.float32, max_rank=16).rank == 16


def test_an_adapter_for_another_base_shape_is_refused(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    from tests.fixtures.tiny_models import write_tiny_qwen3

    other = write_tiny_qwen3(tmp_path / "qwen3")  # head_dim 32: k_proj is [64, 64], not [32, 64]
    from transformers import Qwen3ForCausalLM

    base = Qwen3ForCausalLM.from_pretrained(str(other), dtype=torch.float32)
    write_random_lora(base, tmp_path / "a", rank=4, seed=0, std=0.05)
    shape = r"layers\.0\.self_attn\.k_proj\.lora_B\.weight' has shape \(64, 4\); the base needs \(32, 4\)"
    with pytest.raises(LoraError, match=shape):
        load_lora("a", tmp_path / "a", tiny.model.config, torch.float32, max_rank=64)


def test_a_changed_file_changes_the_identity(
    tiny: LoadedModel, tiny_dir: Path, tmp_path: Path
) -> None:
    path = _write(tiny_dir, tmp_path, rank=8)
    first = load_lora("a", path, tiny.model.config, torch.float32, max_rank=64)
    again = load_lora("a", path, tiny.model.config, torch.float32, max_rank=64)
    assert first.identity == again.identity
    edit_adapter_config(path, lora_alpha=3)
    changed = load_lora("a", path, tiny.model.config, torch.float32, max_rank=64)
    assert changed.identity != first.identity and changed.identity.startswith("a@")


def test_a_mixed_step_adds_each_rows_own_adapter_delta_and_none_to_base_rows(
    tiny: LoadedModel, tiny_dir: Path, tmp_path: Path
) -> None:
    config = tiny.model.config
    first = load_lora("x", _write(tiny_dir, tmp_path / "x", rank=8), config, torch.float32, 64)
    second = load_lora("y", _write(tiny_dir, tmp_path / "y", rank=4), config, torch.float32, 64)
    rows = [first, None, second, first, None, second, second]
    x = torch.randn(len(rows), config.hidden_size, generator=torch.Generator().manual_seed(0))
    width = config.q_size + 2 * config.kv_size
    cpu = torch.device("cpu")
    # the segment loop, the stacked masked matmuls, and the segment loop again where the
    # stacked copy does not fit its bound
    choices = ((None, False), (LoraStacks(), True), (LoraStacks(max_bytes=first.nbytes), False))
    for stacks, stacked in choices:
        batch = LoraBatch.of_rows(rows, cpu, stacks)
        assert batch is not None
        assert (batch.plans["qkv"].stack is not None) == stacked
        out = torch.zeros(len(rows), width)
        batch.add(1, "qkv", x, out)
        for i, adapter in enumerate(rows):
            if adapter is None:
                assert torch.equal(out[i], torch.zeros(width))
            else:
                g = adapter.groups["qkv"]
                want = ((x[i] @ g.a[1].float().T) * g.scale) @ g.b[1].float()
                assert torch.allclose(out[i], want, atol=1e-6)
    assert LoraBatch.of_rows([None, None], cpu) is None


def test_decode_steps_of_the_same_rows_reuse_one_plan_until_a_base_only_step(
    tiny: LoadedModel, tiny_dir: Path, tmp_path: Path
) -> None:
    """The plan of a step (its masks and native table with it) is kept for the next step
    with the same rows' adapters; other rows get a new plan, and a base-only step lets go of
    the kept one (so an unloaded adapter is not held by it)."""
    config = tiny.model.config
    first = load_lora("x", _write(tiny_dir, tmp_path / "x", rank=8), config, torch.float32, 64)
    second = load_lora("y", _write(tiny_dir, tmp_path / "y", rank=4), config, torch.float32, 64)
    cpu, stacks = torch.device("cpu"), LoraStacks()
    kept = LoraBatch.of_rows([first, None, second], cpu, stacks)
    assert kept is not None
    assert LoraBatch.of_rows([first, None, second], cpu, stacks) is kept
    other = LoraBatch.of_rows([second, None, first], cpu, stacks)
    assert other is not None and other is not kept
    assert LoraBatch.of_rows([second, None, first], cpu, stacks) is other
    assert LoraBatch.of_rows([None, None, None], cpu, stacks) is None
    again = LoraBatch.of_rows([second, None, first], cpu, stacks)
    assert again is not None and again is not other


_POOL_PROBE = """
import os, sys, time, torch
from pathlib import Path
from service.model import load_model
from service.model.lora import load_lora
torch.set_num_threads(2)
model = load_model(sys.argv[1], progress=False).model
before = len(os.listdir("/proc/self/task"))
load_lora("a", Path(sys.argv[2]), model.config, model.dtype, max_rank=64)
# a finished pool's workers leave asynchronously: wait for the count to settle
deadline = time.monotonic() + 10.0
while len(os.listdir("/proc/self/task")) > before and time.monotonic() < deadline:
    time.sleep(0.05)
print(before, len(os.listdir("/proc/self/task")))
"""


def test_loading_an_adapter_leaves_no_openmp_pool_behind(
    default_model_path: Path, served_model: LoadedModel, tmp_path: Path
) -> None:
    """The engine thread is the process's only long-lived thread with an OpenMP pool
    (service.model.threads): an adapter read on the caller's thread (a server's event loop or
    executor) would leave one there, and libgomp then cuts every worker's spin-wait."""
    from bench.lora import write_random_adapter

    adapter = write_random_adapter(tmp_path / "a", served_model.model.config, 16, 0)
    out = subprocess.run(
        [sys.executable, "-c", _POOL_PROBE, str(default_model_path), str(adapter)],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2],
    ).stdout.split()
    before, after = int(out[-2]), int(out[-1])
    assert after == before
