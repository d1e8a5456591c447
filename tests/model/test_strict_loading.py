"""Strict loading: a checkpoint is served exactly or refused in one line naming the cause.

Each kind of checkpoint that could otherwise load and compute something else is here:
biases the decoder would drop, GGUF tensors and metadata nothing reads, FP8 codes read as
weights, and config keys that change the arithmetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from service.model import ModelLoadError, load_model, open_model
from tests.fixtures import tiny_families as tf
from tests.fixtures.tiny_gguf import write_gguf_from_hf
from tests.fixtures.tiny_models import write_tiny_llama
from tools.parity import checks as parity

TEXTS = ("Hello, world! The quick brown fox jumps over the lazy dog.", "def main(): pass\n" * 4)


def _edit_config(path: Path, **changes: Any) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _refused(path: Path, *needles: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        open_model(path)
    line = str(info.value)
    assert "\n" not in line
    for needle in needles:
        assert needle in line
    return line


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_attention_bias_applies_the_o_proj_bias_and_matches_transformers(
    tmp_path: Path, model_type: str
) -> None:
    extra = {"head_dim": 32} if model_type == "qwen3" else {}
    path = tf.write_tiny(tmp_path / model_type, model_type, attention_bias=True, **extra)
    ours = load_model(path, dtype="float32", progress=False)
    assert ours.model.o_bias is not None and ours.model.o_bias.abs().sum() > 0
    hf_model, _ = parity.load_hf_oracle(path)
    assert parity.max_logit_diff(ours, hf_model, TEXTS) <= 1e-4
    assert parity.greedy_matches(ours, hf_model, TEXTS, n=16) == len(TEXTS)


def test_gguf_ffn_and_attn_output_biases_are_served_exactly(tmp_path: Path) -> None:
    hf_dir = tf.write_llama_biased(tmp_path / "hf")
    gguf = write_gguf_from_hf(hf_dir, tmp_path / "m.gguf")
    from_gguf = load_model(gguf, dtype="float32", progress=False)
    from_dir = load_model(hf_dir, dtype="float32", progress=False)
    c = from_gguf.model.config
    assert c.attention_bias and c.o_bias and c.mlp_bias
    for text in TEXTS:
        ids = from_dir.tokenizer.encode(text)
        a = parity.logits_ours(from_dir.model, ids)
        b = parity.logits_ours(from_gguf.model, ids)
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_a_gguf_tensor_no_decoder_tensor_comes_from_is_refused_by_name(tmp_path: Path) -> None:
    hf_dir = write_tiny_llama(tmp_path / "hf")
    extra = {"blk.0.ffn_gate_inp.weight": np.ones((4, 64), dtype=np.float32)}
    gguf = write_gguf_from_hf(hf_dir, tmp_path / "m.gguf", extra_tensors=extra)
    _refused(gguf, "blk.0.ffn_gate_inp.weight", "does not compute with")


def test_a_gguf_metadata_key_that_changes_the_arithmetic_is_refused_by_name(
    tmp_path: Path,
) -> None:
    hf_dir = write_tiny_llama(tmp_path / "hf")
    gguf = write_gguf_from_hf(
        hf_dir, tmp_path / "m.gguf", extra_keys={"llama.attn_logit_softcapping": 50.0}
    )
    _refused(gguf, "llama.attn_logit_softcapping=50.0")


def _fp8(hf_dir: Path, *, scales: bool, config: bool) -> Path:
    """The checkpoint's projections as FP8 codes, each with its per-tensor ``weight_scale``
    (as FP8 checkpoints store them) and the ``quantization_config`` naming the scheme."""
    shard = hf_dir / "model.safetensors"
    tensors = load_file(str(shard))
    out = {}
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            scale = t.abs().max() / 448.0
            out[name] = (t / scale).to(torch.float8_e4m3fn)
            if scales:
                out[name.removesuffix("weight") + "weight_scale"] = scale.reshape(1)
        else:
            out[name] = t
    save_file(out, str(shard))
    if config:
        _edit_config(hf_dir, quantization_config={"quant_method": "fp8", "fmt": "e4m3"})
    return hf_dir


def test_an_fp8_checkpoint_is_refused_naming_its_quantization_config(tmp_path: Path) -> None:
    path = _fp8(write_tiny_llama(tmp_path / "fp8"), scales=True, config=True)
    _refused(path, "quantization_config={quant_method: 'fp8'}")


def test_fp8_scales_without_the_config_are_refused_as_unused_tensors(tmp_path: Path) -> None:
    path = _fp8(write_tiny_llama(tmp_path / "fp8"), scales=True, config=False)
    _refused(path, "weight_scale", "does not compute with")


def test_fp8_codes_alone_are_refused_as_quantized_not_read_as_weights(tmp_path: Path) -> None:
    path = _fp8(write_tiny_llama(tmp_path / "fp8"), scales=False, config=False)
    with pytest.raises(ModelLoadError, match="float8_e4m3fn: quantized safetensors"):
        load_model(path, dtype="float32", progress=False)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"sliding_window": 16}, "sliding_window=16"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"num_local_experts": 8}, "num_local_experts=8"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "short_factor"),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "mscale": 0.7,
                    "mscale_all_dim": 1.0,
                    "rope_theta": 1e4,
                    "original_max_position_embeddings": 64,
                }
            },
            "mscale",
        ),
    ],
)
def test_a_config_key_the_family_does_not_compute_with_is_refused_by_name(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    path = _edit_config(write_tiny_llama(tmp_path / "m"), **change)
    with pytest.raises(ModelLoadError) as info:
        open_model(path)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_neutral_values_of_arithmetic_keys_load(tmp_path: Path) -> None:
    """``sliding_window: null`` (Mistral's and Qwen's unused window) changes nothing."""
    path = _edit_config(tf.write_mistral(tmp_path / "m"), sliding_window=None)
    assert open_model(path).config.layer_windows == ()
    llama = _edit_config(write_tiny_llama(tmp_path / "l"), mlp_bias=False, attention_bias=False)
    assert not open_model(llama).config.o_bias


def test_an_unregistered_architecture_is_refused_naming_the_served_ones(tmp_path: Path) -> None:
    path = _edit_config(write_tiny_llama(tmp_path / "m"), model_type="mixtral_like")
    _refused(path, "'mixtral_like'", "llama", "phi3")
