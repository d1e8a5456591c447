"""Tiny random-weight Llama / Qwen2 / Qwen3 checkpoints vs transformers, plus GGUF conversions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from service.model import load_model
from service.model.decoder import DecoderModel
from tests.fixtures.oracles import Tiny, tiny_oracles, weights_of
from tests.fixtures.tiny_gguf import write_gguf_from_hf
from tests.fixtures.tiny_models import write_tiny_llama, write_tiny_qwen2, write_tiny_qwen3
from tools.parity import checks as parity

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def main():\n    return sum(x * x for x in range(10))\n" * 6,
    "Größe 日本語 🙂🚀 <|im_start|>user\nhi<|im_end|>",
)
WRITERS: dict[str, Callable[[Path], Path]] = {
    "llama": lambda d: write_tiny_llama(d),
    "llama_tied": lambda d: write_tiny_llama(d, tie_word_embeddings=True, seed=5),
    "llama3_rope": lambda d: write_tiny_llama(d, rope_scaling=LLAMA3_ROPE, seed=3),
    "llama_sharded": lambda d: write_tiny_llama(d, shard=True, seed=4),
    "qwen2": lambda d: write_tiny_qwen2(d),
    "qwen3": lambda d: write_tiny_qwen3(d),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tiny]:
    return tiny_oracles(tmp_path_factory, WRITERS)


@pytest.mark.parametrize("name", list(WRITERS))
def test_tiny_logits_and_greedy_match_transformers(
    tiny: dict[str, Tiny], name: str
) -> None:
    _, ours, hf_model = tiny[name]
    assert parity.max_logit_diff(ours, hf_model, TEXTS) <= 1e-4
    assert parity.greedy_matches(ours, hf_model, TEXTS, n=32) == len(TEXTS)


def test_tiny_configs_are_what_the_writers_say(
    tiny: dict[str, Tiny],
) -> None:
    cfg = {name: entry.ours.model.config for name, entry in tiny.items()}
    assert cfg["qwen2"].attention_bias and not cfg["qwen2"].qk_norm
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_dim == 32 and cfg["qwen3"].tie_word_embeddings
    assert cfg["llama3_rope"].rope_scaling is not None
    assert cfg["llama3_rope"].rope_scaling.original_max_position_embeddings == 64
    assert not cfg["llama"].tie_word_embeddings and cfg["llama_tied"].tie_word_embeddings
    assert (tiny["llama_sharded"].path / "model.safetensors.index.json").exists()
    assert len(list(tiny["llama_sharded"].path.glob("*.safetensors"))) > 1


def test_llama3_rope_scaling_changes_logits(tiny: dict[str, Tiny]) -> None:
    """Guards the parity test above: without the scaling the logits would be different."""
    _, ours, _ = tiny["llama3_rope"]
    m = ours.model
    unscaled = DecoderModel(dataclasses.replace(m.config, rope_scaling=None), weights_of(m))
    ids = ours.tokenizer.encode(TEXTS[1])
    diff = (parity.logits_ours(m, ids) - parity.logits_ours(unscaled, ids)).abs().max().item()
    assert diff > 1e-2


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_gguf_conversion_loads_identically(
    tiny: dict[str, Tiny], tmp_path: Path, name: str
) -> None:
    """A llama.cpp-style GGUF (Q/K rows permuted for llama) gives the same model and tokenizer."""
    path, from_dir, _ = tiny[name]
    from_gguf = load_model(
        write_gguf_from_hf(path, tmp_path / "m.gguf"), dtype="float32", progress=False
    )
    # eps goes through float32 in GGUF; eos ids gain llama.cpp's end-of-generation tokens.
    assert dataclasses.replace(
        from_gguf.model.config, rms_norm_eps=0.0, eos_token_ids=()
    ) == dataclasses.replace(from_dir.model.config, rms_norm_eps=0.0, eos_token_ids=())
    for text in TEXTS:
        ids = from_dir.tokenizer.encode(text)
        assert from_gguf.tokenizer.encode(text) == ids
        a, b = parity.logits_ours(from_dir.model, ids), parity.logits_ours(from_gguf.model, ids)
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert from_gguf.chat_template is not None
    assert from_gguf.chat_template.render([{"role": "user", "content": "x"}]).endswith(
        "<|im_start|>assistant\n"
    )
