"""Mixture-of-experts families on the shared decoder (:mod:`service.model.moe` computes the
experts): Mixtral (Llama attention, sliding window when set, top-k renormalised always) and
Qwen3-MoE (Qwen3 attention with q/k norms, every layer sparse, top-k renormalised only with
``norm_topk_prob``).

GGUF, as llama.cpp's converter writes them: Mixtral is ``general.architecture = llama``
with ``llama.expert_count`` / ``llama.expert_used_count`` (the llama family reads them through
:func:`gguf_experts`); Qwen3-MoE is ``qwen3moe`` with the experts' width in
``qwen3moe.expert_feed_forward_length``. Both stack each projection of every expert of a
layer into one tensor (``blk.N.ffn_{gate,up,down}_exps``) beside the router
(``blk.N.ffn_gate_inp``). The files carry no renormalisation flag: llama.cpp renormalises the
top-k weights for both architectures, and so does kvfence (a Qwen3-MoE trained with
``norm_topk_prob: false`` computes otherwise from its HF directory than from its GGUF, in
llama.cpp as here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from service.model.families.base import Family, Source, Tokens
from service.model.families.common import gguf_decoder, hf_decoder, hf_windows
from service.model.families.keys import ConfigKeys
from service.model.load_error import ModelLoadError
from service.model.model_config import ModelConfig


def _experts(keys: ConfigKeys, count_key: str) -> tuple[int, int]:
    # transformers writes Qwen3-MoE's count as num_local_experts too
    experts = int(keys.get(count_key) or keys.need("num_local_experts"))
    top_k = int(keys.need("num_experts_per_tok"))
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"{keys.source}: num_experts_per_tok={top_k} with {experts} experts")
    return experts, top_k


def mixtral_config(keys: ConfigKeys, tokens: Tokens) -> ModelConfig:
    layers = int(keys.need("num_hidden_layers"))
    experts, top_k = _experts(keys, "num_local_experts")
    return hf_decoder(
        keys,
        "mixtral",
        tokens,
        layer_windows=hf_windows(keys, layers, every_layer=True),
        num_experts=experts,
        experts_per_token=top_k,
        normalize_top_k=True,
    )


def qwen3_moe_config(keys: ConfigKeys, tokens: Tokens) -> ModelConfig:
    layers = int(keys.need("num_hidden_layers"))
    experts, top_k = _experts(keys, "num_experts")
    if int(keys.get("decoder_sparse_step", 1)) != 1 or keys.get("mlp_only_layers"):
        raise ModelLoadError(
            f"{keys.source}: dense layers between sparse ones (decoder_sparse_step / "
            "mlp_only_layers) are not served"
        )
    bias = bool(keys.get("attention_bias", False))
    config = hf_decoder(
        keys,
        "qwen3_moe",
        tokens,
        attention_bias=bias,
        o_bias=bias,
        qk_norm=True,
        layer_windows=hf_windows(keys, layers, every_layer=False),
        num_experts=experts,
        experts_per_token=top_k,
        normalize_top_k=bool(keys.get("norm_topk_prob", False)),
    )
    # The experts' width is moe_intermediate_size; intermediate_size sizes no tensor here.
    return _with_width(config, int(keys.need("moe_intermediate_size")))


def _with_width(config: ModelConfig, width: int) -> ModelConfig:
    return dataclasses.replace(config, intermediate_size=width)


def gguf_experts(
    keys: ConfigKeys, arch: str, config: ModelConfig, width: int | None = None
) -> ModelConfig:
    """``config`` with the experts ``{arch}.expert_count`` and ``{arch}.expert_used_count``
    name (top-k renormalised, as llama.cpp computes both MoE architectures), each of
    ``width`` rows (None: the dense ``feed_forward_length``); unchanged without experts."""
    experts = int(keys.get(f"{arch}.expert_count", 0))
    if not experts:
        return config
    top_k = int(keys.need(f"{arch}.expert_used_count"))
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"{keys.source}: {arch}.expert_used_count={top_k} of {experts}")
    return dataclasses.replace(
        config,
        num_experts=experts,
        experts_per_token=top_k,
        normalize_top_k=True,
        intermediate_size=config.intermediate_size if width is None else width,
    )


def qwen3_moe_gguf_config(
    keys: ConfigKeys, shapes: Mapping[str, tuple[int, ...]], tokens: Tokens
) -> ModelConfig:
    config = gguf_decoder(keys, "qwen3moe", "qwen3_moe", shapes, tokens)
    width = int(keys.need("qwen3moe.expert_feed_forward_length"))
    config = gguf_experts(keys, "qwen3moe", config, width)
    if not config.num_experts:
        raise ModelLoadError(f"{keys.source}: a qwen3moe file without qwen3moe.expert_count")
    return config


_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def mixtral_source(config: ModelConfig, name: str) -> Source:
    """``mlp.gate`` and ``mlp.experts.E.{gate,up,down}_proj`` live under ``block_sparse_moe``
    as ``gate`` and ``experts.E.{w1,w3,w2}``."""
    if ".mlp." not in name:
        return Source(name)
    head, _, rest = name.partition(".mlp.")
    parts = rest.split(".")
    if parts[0] == "experts":
        parts[2] = _MIXTRAL_EXPERT[parts[2]]
    return Source(f"{head}.block_sparse_moe.{'.'.join(parts)}")


MIXTRAL = Family(
    name="mixtral", hf_model_types=("mixtral",), hf_config=mixtral_config, source=mixtral_source
)
QWEN3_MOE = Family(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    hf_config=qwen3_moe_config,
    gguf_archs=("qwen3moe",),
    gguf_config=qwen3_moe_gguf_config,
)
