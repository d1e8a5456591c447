"""Phi-3 / Phi-3.5: fused ``qkv_proj`` and ``gate_up_proj``, ``sliding_window`` on every
layer, RoPE ``longrope`` (served up to the original context, where its short factors
apply). Phi-4-mini's partial rotary embedding is refused (``partial_rotary_factor``)."""

from __future__ import annotations

from collections.abc import Mapping

from service.model.families.base import (
    GGUF_HARMLESS,
    LLAMA_GGUF_LAYER_NAMES,
    Family,
    Source,
    Tokens,
)
from service.model.families.common import gguf_decoder, hf_decoder, hf_windows
from service.model.families.keys import ConfigKeys
from service.model.model_config import ModelConfig


def hf_config(keys: ConfigKeys, tokens: Tokens) -> ModelConfig:
    layers = int(keys.need("num_hidden_layers"))
    return hf_decoder(
        keys, "phi3", tokens, layer_windows=hf_windows(keys, layers, every_layer=True)
    )


def gguf_config(
    keys: ConfigKeys, shapes: Mapping[str, tuple[int, ...]], tokens: Tokens
) -> ModelConfig:
    layers = int(keys.need("phi3.block_count"))
    window = int(keys.get("phi3.attention.sliding_window", 0))
    return gguf_decoder(
        keys, "phi3", "phi3", shapes, tokens, layer_windows=(window,) * layers if window else ()
    )


def source(config: ModelConfig, name: str) -> Source:
    """q/k/v are row ranges of ``qkv_proj``; gate and up of ``gate_up_proj``."""
    prefix, _, leaf = name.rpartition(".")  # leaf: weight
    prefix, _, proj = prefix.rpartition(".")
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    rows = {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, q + kv),
        "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
        "gate_proj": ("gate_up_proj", 0, inter),
        "up_proj": ("gate_up_proj", inter, 2 * inter),
    }
    if proj not in rows:
        return Source(name)
    fused, start, stop = rows[proj]
    return Source(f"{prefix}.{fused}.{leaf}", start, stop)


_GGUF_NAMES = {
    **{
        k: v
        for k, v in LLAMA_GGUF_LAYER_NAMES.items()
        if not k.startswith(("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"))
    },
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}

FAMILY = Family(
    name="phi3",
    hf_model_types=("phi3",),
    hf_config=hf_config,
    gguf_archs=("phi3",),
    gguf_config=gguf_config,
    source=source,
    gguf_layer_names=_GGUF_NAMES,
    # The original context only describes the file where no LongRoPE factor tensors come
    # with it; those (rope_factors_long/short) are refused as tensors nothing reads.
    gguf_harmless=GGUF_HARMLESS | {"rope.scaling.original_context_length"},
)
