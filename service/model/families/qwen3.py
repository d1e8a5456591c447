"""Qwen3 (dense): per-head q/k RMSNorm, ``head_dim`` of its own; q/k/v/o biases with
``attention_bias``; sliding-window layers as Qwen2."""

from __future__ import annotations

from collections.abc import Mapping

from service.model.families.base import Family, Tokens
from service.model.families.common import gguf_decoder, hf_decoder, hf_windows
from service.model.families.keys import ConfigKeys
from service.model.model_config import ModelConfig


def hf_config(keys: ConfigKeys, tokens: Tokens) -> ModelConfig:
    layers = int(keys.need("num_hidden_layers"))
    bias = bool(keys.get("attention_bias", False))
    return hf_decoder(
        keys,
        "qwen3",
        tokens,
        attention_bias=bias,
        o_bias=bias,
        qk_norm=True,
        layer_windows=hf_windows(keys, layers, every_layer=False),
    )


def gguf_config(
    keys: ConfigKeys, shapes: Mapping[str, tuple[int, ...]], tokens: Tokens
) -> ModelConfig:
    return gguf_decoder(keys, "qwen3", "qwen3", shapes, tokens)


FAMILY = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_config=hf_config,
    gguf_archs=("qwen3",),
    gguf_config=gguf_config,
)
