"""Mistral: Llama's layers without biases; ``sliding_window`` (when not null) on every layer.
llama.cpp's converter writes Mistral GGUFs as ``llama`` (served by that family)."""

from __future__ import annotations

from service.model.families.base import Family, Tokens
from service.model.families.common import hf_decoder, hf_windows
from service.model.families.keys import ConfigKeys
from service.model.model_config import ModelConfig


def hf_config(keys: ConfigKeys, tokens: Tokens) -> ModelConfig:
    layers = int(keys.need("num_hidden_layers"))
    return hf_decoder(
        keys, "mistral", tokens, layer_windows=hf_windows(keys, layers, every_layer=True)
    )


FAMILY = Family(name="mistral", hf_model_types=("mistral",), hf_config=hf_config)
