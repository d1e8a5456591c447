"""Every registered family against transformers: tiny random-weight checkpoints, float32,
logits and greedy tokens on prompts shorter and longer than the sliding window."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from service.model import load_model
from service.model.families import FAMILIES
from tests.fixtures import tiny_families as tf
from tests.fixtures.oracles import Tiny, tiny_oracles, weights_of
from tests.fixtures.tiny_gguf import write_gguf_from_hf
from tools.parity import checks as parity

pytestmark = pytest.mark.slow  # loads ten checkpoints and their transformers oracles
SHORT = "Hello!"  # fewer tokens than the window
LONG = "The quick brown fox jumps over the lazy dog. def main(): return 42\n" * 2
WRITERS: dict[str, Callable[[Path], Path]] = {
    "llama_biased": tf.write_llama_biased,
    "llama_yarn": lambda d: tf.write_llama_rope(
        d, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    ),
    "llama_linear": lambda d: tf.write_llama_rope(d, {"rope_type": "linear", "factor": 2.0}),
    "llama_dynamic": lambda d: tf.write_llama_rope(d, {"rope_type": "dynamic", "factor": 2.0}),
    "qwen2_windowed": tf.write_qwen2_windowed,
    "qwen3_biased": lambda d: tf.write_tiny(d, "qwen3", attention_bias=True, head_dim=32),
    "mistral": tf.write_mistral,
    "mistral_no_window": lambda d: tf.write_mistral(d, window=None),
    "phi3": tf.write_phi3,
    "phi3_longrope": lambda d: tf.write_phi3(d, longrope=True),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tiny]:
    return tiny_oracles(tmp_path_factory, WRITERS)


@pytest.mark.parametrize("name", list(WRITERS))
def test_each_family_matches_transformers_shorter_and_longer_than_the_window(
    tiny: dict[str, Tiny], name: str
) -> None:
    _, ours, hf_model = tiny[name]
    texts = (SHORT, LONG)
    assert len(ours.tokenizer.encode(SHORT)) < tf.WINDOW < len(ours.tokenizer.encode(LONG))
    assert parity.max_logit_diff(ours, hf_model, texts) <= 1e-4
    assert parity.greedy_matches(ours, hf_model, texts, n=16) == len(texts)


def test_the_configs_carry_what_each_checkpoint_says(
    tiny: dict[str, Tiny],
) -> None:
    cfg = {name: entry.ours.model.config for name, entry in tiny.items()}
    w = tf.WINDOW
    assert cfg["mistral"].layer_windows == (w, w) and cfg["mistral_no_window"].layer_windows == ()
    assert cfg["qwen2_windowed"].layer_windows == (0, w)
    assert cfg["phi3"].layer_windows == (w, w) and cfg["phi3"].arch == "phi3"
    b = cfg["llama_biased"]
    assert b.attention_bias and b.o_bias and b.mlp_bias
    q3 = cfg["qwen3_biased"]
    assert q3.attention_bias and q3.o_bias and not q3.mlp_bias
    kinds = {n: c.rope_scaling.kind for n, c in cfg.items() if c.rope_scaling is not None}
    assert kinds == {
        "llama_yarn": "yarn",
        "llama_linear": "linear",
        "llama_dynamic": "dynamic",
        "phi3_longrope": "longrope",
    }
    # longrope is served up to its original context, where its short factors hold
    assert cfg["phi3_longrope"].max_position_embeddings == 256


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("mistral", {"layer_windows": ()}),
        ("qwen2_windowed", {"layer_windows": ()}),
        ("llama_biased", {"o_bias": False}),
        ("llama_biased", {"mlp_bias": False}),
        ("llama_yarn", {"rope_scaling": None}),
        ("phi3_longrope", {"rope_scaling": None}),
    ],
)
def test_each_feature_changes_the_output_it_is_matched_on(
    tiny: dict[str, Tiny], name: str, change: dict[str, Any]
) -> None:
    """Guards the parity test: the checkpoint with the feature switched off is far from
    transformers, so matching it means the feature is computed."""
    _, ours, hf_model = tiny[name]
    m = ours.model
    weights = weights_of(m)
    if change.get("o_bias") is False:
        weights = dataclasses.replace(weights, o_bias=None)
    if change.get("mlp_bias") is False:
        weights = dataclasses.replace(weights, gate_up_bias=None, down_bias=None)
    off = type(m)(dataclasses.replace(m.config, **change), weights)
    ids = ours.tokenizer.encode(LONG)
    diff = (parity.logits_ours(off, ids) - parity.logits_hf(hf_model, ids)).abs().max().item()
    assert diff > 1e-2


@pytest.mark.parametrize("name", ["phi3", "qwen2_windowed", "llama_biased", "llama_linear"])
def test_a_llama_cpp_gguf_of_the_family_loads_identically(
    tiny: dict[str, Tiny], tmp_path: Path, name: str
) -> None:
    """llama.cpp's GGUF names (Phi-3's fused attn_qkv and ffn_up included) give the model
    the HF directory gives, windows and all."""
    from_dir = tiny[name].ours
    gguf = write_gguf_from_hf(from_dir.path, tmp_path / "m.gguf")
    from_gguf = load_model(gguf, dtype="float32", progress=False)
    assert from_gguf.model.config.arch == from_dir.model.config.arch
    if name == "phi3":  # llama.cpp writes Phi-3's window; Qwen2's is not in its GGUF keys
        assert from_gguf.model.config.layer_windows == from_dir.model.config.layer_windows
    assert from_gguf.model.config.rope_scaling == from_dir.model.config.rope_scaling
    ids = from_dir.tokenizer.encode(SHORT if name == "qwen2_windowed" else LONG)
    a, b = parity.logits_ours(from_dir.model, ids), parity.logits_ours(from_gguf.model, ids)
    assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_every_family_is_registered_once() -> None:
    types = [t for f in FAMILIES for t in f.hf_model_types]
    archs = [a for f in FAMILIES for a in f.gguf_archs]
    assert len(types) == len(set(types)) and len(archs) == len(set(archs))
    assert {"llama", "qwen2", "qwen3", "mistral", "phi3"} <= set(types)
