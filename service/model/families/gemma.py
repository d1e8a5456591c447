"""Gemma 2 and Gemma 3 (text): embeddings times sqrt(hidden), (1 + w) RMSNorms, a norm before
and after both attention and the MLP, GeGLU (tanh GELU), q scaled by
``query_pre_attn_scalar``, local sliding-window layers beside global ones, final-logit
softcapping; Gemma 3 adds q/k norms and a RoPE base of its own for the local layers.

Gemma 2's attention-logit softcapping (``attn_logit_softcapping``) travels to kvcache as
each layer's ``LayerAttention.softcap``; every attention backend caps the scores.

GGUF (``gemma3``): llama.cpp's converter stores the norms with the 1 already added, every
6th layer global, the local layers' RoPE base 10000 and a query scale of head_dim**-0.5
(hidden/heads for the 62-layer 27B), as llama.cpp computes them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from service.model.families.base import Family, Source, Tokens
from service.model.families.common import gguf_decoder, hf_decoder
from service.model.families.keys import ConfigKeys
from service.model.load_error import ModelLoadError
from service.model.model_config import ModelConfig

_LOCAL, _GLOBAL = "sliding_attention", "full_attention"


def _activation(keys: ConfigKeys) -> str:
    act = keys.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{keys.source}: the gemma family does not compute with {act!r}")
    return "gelu_tanh"


def _rope_bases(keys: ConfigKeys, types: list[str]) -> tuple[float, float]:
    """``(global base, local base)``; a RoPE scaling rule on either is refused."""
    params: Mapping[str, Any] = keys.get("rope_parameters") or {}
    nested = isinstance(params.get(_GLOBAL), Mapping)
    full = params.get(_GLOBAL) if nested else params
    local = params.get(_LOCAL) if nested else {}
    if keys.get("rope_scaling") is not None:
        raise ModelLoadError(f"{keys.source}: rope_scaling on a gemma model is not served")
    for rule in (full, local):
        kind = (rule or {}).get("rope_type", "default")
        if kind not in ("default", None):
            raise ModelLoadError(f"{keys.source}: rope scaling {kind!r} on gemma is not served")
    theta = float((full or {}).get("rope_theta", keys.get("rope_theta", 10000.0)))
    local_theta = float(
        (local or {}).get("rope_theta", keys.get("rope_local_base_freq", theta))
    )
    return theta, local_theta


def _softcap(keys: ConfigKeys, key: str) -> float:
    """A softcap from config.json (null: none); one that is not a finite positive number is
    refused."""
    value = keys.get(key)
    if value is None:
        return 0.0
    cap = float(value)
    if not math.isfinite(cap) or cap <= 0:
        raise ModelLoadError(f"{keys.source}: {key}={value!r} is not a positive softcap")
    return cap


def _layer_types(keys: ConfigKeys, layers: int, gemma3: bool) -> list[str]:
    types = keys.get("layer_types")
    if types is None:
        if gemma3:
            pattern = int(keys.get("sliding_window_pattern", 6))
            types = [_GLOBAL if (i + 1) % pattern == 0 else _LOCAL for i in range(layers)]
        else:  # Gemma 2 alternates, local first
            types = [_LOCAL if i % 2 == 0 else _GLOBAL for i in range(layers)]
    if len(types) != layers or set(types) - {_LOCAL, _GLOBAL}:
        raise ModelLoadError(f"{keys.source}: layer_types {types!r} is not served")
    return list(types)


def hf_config(keys: ConfigKeys, tokens: Tokens) -> ModelConfig:
    gemma3 = keys.get("model_type") == "gemma3_text"
    layers = int(keys.need("num_hidden_layers"))
    hidden = int(keys.need("hidden_size"))
    heads = int(keys.need("num_attention_heads"))
    head_dim = int(keys.get("head_dim") or hidden // heads)
    if keys.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{keys.source}: use_bidirectional_attention is not served")
    if keys.get("attention_bias"):
        raise ModelLoadError(f"{keys.source}: attention_bias on gemma is not served")
    types = _layer_types(keys, layers, gemma3)
    window = int(keys.get("sliding_window") or 0)
    if _LOCAL in types and not window:
        raise ModelLoadError(f"{keys.source}: sliding_attention layers without sliding_window")
    theta, local_theta = _rope_bases(keys, types)
    scalar = float(keys.get("query_pre_attn_scalar", head_dim))
    return hf_decoder(
        keys,
        "gemma3" if gemma3 else "gemma2",
        tokens,
        qk_norm=gemma3,
        rope_theta=theta,
        layer_windows=tuple(window if t == _LOCAL else 0 for t in types),
        embed_scale=math.sqrt(hidden),
        sandwich_norms=True,
        activation=_activation(keys),
        query_scale=math.sqrt(head_dim / scalar),
        layer_rope_thetas=tuple(local_theta if t == _LOCAL else theta for t in types),
        final_softcap=_softcap(keys, "final_logit_softcapping"),
        attn_softcap=_softcap(keys, "attn_logit_softcapping"),
        norm_offset=1.0,
        tie_word_embeddings=bool(keys.get("tie_word_embeddings", True)),
    )


def gguf_config(
    keys: ConfigKeys, shapes: Mapping[str, tuple[int, ...]], tokens: Tokens
) -> ModelConfig:
    layers = int(keys.need("gemma3.block_count"))
    hidden = int(keys.need("gemma3.embedding_length"))
    heads = int(keys.need("gemma3.attention.head_count"))
    window = int(keys.need("gemma3.attention.sliding_window"))
    pattern = int(keys.get("gemma3.attention.sliding_window_pattern", 6))
    theta = float(keys.get("gemma3.rope.freq_base", 1_000_000.0))
    local_theta = float(keys.get("gemma3.rope.freq_base_swa", 10000.0))
    final_cap = float(keys.get("gemma3.final_logit_softcapping", 0.0))
    if keys.get("gemma3.attn_logit_softcapping"):
        raise ModelLoadError("GGUF metadata: gemma3.attn_logit_softcapping is not served")
    local = [(i + 1) % pattern != 0 for i in range(layers)]
    config = gguf_decoder(keys, "gemma3", "gemma3", shapes, tokens)
    scale_dim = hidden / heads if layers == 62 else config.head_dim  # llama.cpp's 27B rule
    return dataclasses.replace(
        config,
        layer_windows=tuple(window if lo else 0 for lo in local),
        embed_scale=math.sqrt(hidden),
        sandwich_norms=True,
        activation="gelu_tanh",
        query_scale=math.sqrt(config.head_dim / scale_dim),
        layer_rope_thetas=tuple(local_theta if lo else theta for lo in local),
        final_softcap=final_cap,
    )


# decoder norm name -> the file's (HF) name: Gemma's "post_attention_layernorm" is the norm on
# the attention output; the MLP's input norm is "pre_feedforward_layernorm".
_NORMS = {
    "post_attention_layernorm.weight": "pre_feedforward_layernorm.weight",
    "attn_out_norm.weight": "post_attention_layernorm.weight",
    "mlp_out_norm.weight": "post_feedforward_layernorm.weight",
}


def source(config: ModelConfig, name: str) -> Source:
    prefix, _, leaf = name.partition(".layers.")
    if not leaf:
        return Source(name)
    layer, _, rest = leaf.partition(".")
    return Source(f"{prefix}.layers.{layer}.{_NORMS.get(rest, rest)}")


_GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}

GEMMA2 = Family(
    name="gemma2", hf_model_types=("gemma2",), hf_config=hf_config, source=source
)
GEMMA3 = Family(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    hf_config=hf_config,
    gguf_archs=("gemma3",),
    gguf_config=gguf_config,
    source=source,
    gguf_layer_names=_GGUF_NAMES,
    gguf_harmless=frozenset(
        {"context_length", "vocab_size", "attention.value_length", "rope.scaling.finetuned"}
    ),
)
