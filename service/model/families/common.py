"""Config readers every family shares: the decoder's shape, RoPE and windows, from
config.json or GGUF metadata. Each value is read through :class:`ConfigKeys`, so whatever a
family does not read is refused by :mod:`service.model.families.keys`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from service.model.families.base import Tokens
from service.model.families.keys import ConfigKeys
from service.model.load_error import ModelLoadError
from service.model.model_config import ModelConfig, RopeScaling


def hf_decoder(keys: ConfigKeys, family: str, tokens: Tokens, **features: Any) -> ModelConfig:
    """The shape every HF family shares; ``features`` are :class:`ModelConfig` fields the
    family sets itself (biases, q/k norm, windows)."""
    act = keys.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(
            f"{keys.source}: the {family} family does not compute with hidden_act={act!r}"
        )
    try:
        heads = int(keys.need("num_attention_heads"))
        hidden = int(keys.need("hidden_size"))
        head_dim = int(keys.get("head_dim") or hidden // heads)
        max_pos = int(keys.get("max_position_embeddings", 4096))
        try:
            theta, scaling = hf_rope(keys, max_pos)
        except KeyError as e:
            raise ModelLoadError(f"{keys.source}: the rope scaling has no {e.args[0]}") from None
        if scaling is not None and scaling.kind in ("dynamic", "longrope"):
            # Both change the frequencies past the original context: served up to it.
            max_pos = min(max_pos, scaling.original_max_position_embeddings)
        base = ModelConfig(
            arch=family,
            vocab_size=int(keys.need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(keys.need("intermediate_size")),
            num_layers=int(keys.need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(keys.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(keys.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(keys.get("tie_word_embeddings", False)),
            attention_bias=False,
            qk_norm=False,
            bos_token_id=tokens.bos,
            eos_token_ids=tokens.eos,
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{keys.source} has a bad field ({e})") from None
    return dataclasses.replace(base, **features)


def hf_rope(keys: ConfigKeys, max_pos: int) -> tuple[float, RopeScaling | None]:
    """``(theta, scaling)`` from ``rope_parameters`` / ``rope_scaling`` / ``rope_theta``."""
    params: Mapping[str, Any] = keys.get("rope_parameters") or keys.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", keys.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", keys.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ModelLoadError(f"{keys.source}: partial_rotary_factor={partial} is not served")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "su":  # the name Phi-3's first configs gave longrope
        kind = "longrope"
    if kind in ("default", None):
        return theta, None
    original = int(
        params.get("original_max_position_embeddings")
        or keys.get("original_max_position_embeddings")
        or max_pos
    )
    factor = params.get("factor")
    if kind == "llama3":
        return theta, RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    if kind in ("linear", "dynamic"):
        if factor is None:
            raise ModelLoadError(f"{keys.source}: rope scaling {kind!r} has no factor")
        return theta, RopeScaling(
            float(factor), original_max_position_embeddings=original, kind=kind
        )
    if kind == "yarn":
        factor = float(factor if factor is not None else max_pos / original)
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise ModelLoadError(f"{keys.source}: yarn mscale / mscale_all_dim are not served")
        attn = params.get("attention_factor")
        return theta, RopeScaling(
            factor,
            original_max_position_embeddings=original,
            kind="yarn",
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            attention_factor=float(attn if attn is not None else _yarn_mscale(factor)),
            truncate=bool(params.get("truncate", True)),
        )
    if kind == "longrope":
        factor = float(factor if factor is not None else max_pos / original)
        attn = params.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return theta, RopeScaling(
            factor,
            original_max_position_embeddings=original,
            kind="longrope",
            attention_factor=float(attn),
            short_factor=tuple(float(f) for f in params["short_factor"]),
        )
    raise ModelLoadError(f"{keys.source}: rope scaling {kind!r} is not served")


def _yarn_mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def hf_windows(keys: ConfigKeys, num_layers: int, *, every_layer: bool) -> tuple[int, ...]:
    """Per-layer windows. ``every_layer`` (Mistral, Phi-3): ``sliding_window`` applies to
    every layer when set. Else (Qwen2/3): ``layer_types`` (or ``use_sliding_window`` with
    ``max_window_layers``) says which layers slide."""
    window = keys.get("sliding_window")
    if every_layer:
        return () if window is None else (int(window),) * num_layers
    use = bool(keys.get("use_sliding_window", False))
    types = keys.get("layer_types")
    first = int(keys.get("max_window_layers", num_layers))
    if types is None:
        types = [
            "sliding_attention" if use and window is not None and i >= first else "full_attention"
            for i in range(num_layers)
        ]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{keys.source}: layer_types {types!r} is not served")
    if "sliding_attention" not in types:
        return ()
    if window is None or not use:
        raise ModelLoadError(
            f"{keys.source}: sliding layers without use_sliding_window/sliding_window"
        )
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def gguf_decoder(
    keys: ConfigKeys,
    arch: str,
    family: str,
    shapes: Mapping[str, tuple[int, ...]],
    tokens: Tokens,
    **features: Any,
) -> ModelConfig:
    """The shape every GGUF family shares, from ``{arch}.*`` keys and the tensors present
    (biases, q/k norms, the output head)."""

    def key(name: str) -> str:
        return f"{arch}.{name}"

    kind = keys.get(key("rope.scaling.type"), "none")
    rope_scaling = None
    if kind == "linear":  # what llama.cpp's converter writes for rope_type linear
        factor = float(keys.need(key("rope.scaling.factor")))
        context = int(keys.get(key("context_length"), 4096))
        rope_scaling = RopeScaling(factor, original_max_position_embeddings=context, kind="linear")
    elif kind != "none":
        raise ModelLoadError(f"{keys.source}: rope scaling {kind!r} is not served from GGUF")
    hidden = int(keys.need(key("embedding_length")))
    heads = int(keys.need(key("attention.head_count")))
    head_dim = int(keys.get(key("attention.key_length"), hidden // heads))
    value_dim = int(keys.get(key("attention.value_length"), head_dim))
    rotary = int(keys.get(key("rope.dimension_count"), head_dim))
    if value_dim != head_dim or rotary != head_dim:
        raise ModelLoadError(
            f"{keys.source}: {arch}.attention.value_length={value_dim} / "
            f"{arch}.rope.dimension_count={rotary} differ from key_length={head_dim}"
        )
    embed = shapes.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelLoadError("missing tensor token_embd.weight")
    layer0 = "model.layers.0."
    base = ModelConfig(
        arch=family,
        vocab_size=int(embed[0]),
        hidden_size=hidden,
        intermediate_size=int(keys.need(key("feed_forward_length"))),
        num_layers=int(keys.need(key("block_count"))),
        num_heads=heads,
        num_kv_heads=int(keys.get(key("attention.head_count_kv"), heads)),
        head_dim=head_dim,
        rms_norm_eps=float(keys.need(key("attention.layer_norm_rms_epsilon"))),
        rope_theta=float(keys.get(key("rope.freq_base"), 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(keys.get(key("context_length"), 4096)),
        tie_word_embeddings="lm_head.weight" not in shapes,
        attention_bias=layer0 + "self_attn.q_proj.bias" in shapes,
        qk_norm=layer0 + "self_attn.q_norm.weight" in shapes,
        bos_token_id=tokens.bos,
        eos_token_ids=tokens.eos,
        o_bias=layer0 + "self_attn.o_proj.bias" in shapes,
        mlp_bias=layer0 + "mlp.down_proj.bias" in shapes,
    )
    return dataclasses.replace(base, **features)
