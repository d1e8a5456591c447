"""Qwen2 / Qwen2.5: q/k/v biases (no o bias); sliding-window layers from ``layer_types``
(or ``use_sliding_window`` with ``max_window_layers``)."""

from __future__ import annotations

from collections.abc import Mapping

from service.model.families.base import Family, Tokens
from service.model.families.common import gguf_decoder, hf_decoder, hf_windows
from service.model.families.keys import ConfigKeys
from service.model.model_config import ModelConfig


def hf_config(keys: ConfigKeys, tokens: Tokens) -> ModelConfig:
    layers = int(keys.need("num_hidden_layers"))
    return hf_decoder(
        keys,
        "qwen2",
        tokens,
        attention_bias=True,
        layer_windows=hf_windows(keys, layers, every_layer=False),
    )


def gguf_config(
    keys: ConfigKeys, shapes: Mapping[str, tuple[int, ...]], tokens: Tokens
) -> ModelConfig:
    return gguf_decoder(keys, "qwen2", "qwen2", shapes, tokens)


FAMILY = Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    hf_config=hf_config,
    gguf_archs=("qwen2",),
    gguf_config=gguf_config,
)
