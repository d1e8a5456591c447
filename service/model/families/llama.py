"""Llama (and SmolLM, TinyLlama, ...): q/k/v/o biases with ``attention_bias``, gate/up/down
biases with ``mlp_bias``; RoPE default, ``llama3``, ``linear``, ``dynamic`` or ``yarn``.

GGUF ``llama`` is also what llama.cpp's converter writes for Mistral and Mixtral: a file with
``llama.expert_count`` is Mixtral's mixture of experts (:func:`~service.model.families.moe.gguf_experts`)."""

from __future__ import annotations

from collections.abc import Mapping

from service.model.families.base import Family, Tokens
from service.model.families.common import gguf_decoder, hf_decoder
from service.model.families.keys import ConfigKeys
from service.model.families.moe import gguf_experts
from service.model.model_config import ModelConfig


def hf_config(keys: ConfigKeys, tokens: Tokens) -> ModelConfig:
    attention_bias = bool(keys.get("attention_bias", False))
    return hf_decoder(
        keys,
        "llama",
        tokens,
        attention_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(keys.get("mlp_bias", False)),
    )


def gguf_config(
    keys: ConfigKeys, shapes: Mapping[str, tuple[int, ...]], tokens: Tokens
) -> ModelConfig:
    return gguf_experts(keys, "llama", gguf_decoder(keys, "llama", "llama", shapes, tokens))


FAMILY = Family(
    name="llama",
    hf_model_types=("llama",),
    hf_config=hf_config,
    gguf_archs=("llama",),
    gguf_config=gguf_config,
    gguf_permutes_qk=True,
)
