"""What a family is: how its checkpoints' configs and tensors map onto the shared decoder."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from service.model.families.keys import ConfigKeys
from service.model.load_error import ModelLoadError
from service.model.model_config import ModelConfig


class Source(NamedTuple):
    """Where a decoder tensor (HF name, see ``service.model.weights.tensor_names``) lives in
    the checkpoint: the file's tensor ``name``, and rows ``[start, stop)`` of it when the file
    fuses several decoder tensors into one (``stop`` 0: the whole tensor), or entry
    ``expert`` of its first axis when the file stacks every expert's tensor into one (GGUF's
    ``ffn_*_exps``; -1: not stacked)."""

    name: str
    start: int = 0
    stop: int = 0
    expert: int = -1


def direct(config: ModelConfig, name: str) -> Source:
    """The decoder tensor is the file's tensor of the same name."""
    return Source(name)


@dataclass(frozen=True, slots=True)
class Tokens:
    """The special token ids a family's config builder needs (read with the tokenizer)."""

    bos: int | None
    eos: tuple[int, ...]


# HF: (config.json keys, tokens) -> config. GGUF: (metadata keys, tensor shapes by HF name,
# tokens) -> config. Each reads what it honours through the keys object.
HFConfigFn = Callable[[ConfigKeys, Tokens], ModelConfig]
GGUFConfigFn = Callable[[ConfigKeys, Mapping[str, tuple[int, ...]], Tokens], ModelConfig]

# GGUF per-layer tensor suffix -> HF per-layer suffix, as llama.cpp's converter names them.
LLAMA_GGUF_LAYER_NAMES: Mapping[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
    # Mixture of experts: the router, and each projection of every expert stacked into one
    # [experts, rows, cols] tensor (named here without an expert index; see Source.expert).
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
GGUF_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# {arch}.* GGUF keys every family may leave unread: they size or describe, never compute.
GGUF_HARMLESS: frozenset[str] = frozenset(
    {"context_length", "vocab_size", "rope.scaling.finetuned", "attention.value_length"}
)


@dataclass(frozen=True, slots=True)
class Family:
    """One model family: the keys that select it and how its checkpoints become a
    :class:`ModelConfig` plus the decoder's tensors. See :mod:`service.model.families`."""

    name: str
    hf_model_types: tuple[str, ...]  # config.json ``model_type`` values
    hf_config: HFConfigFn
    gguf_archs: tuple[str, ...] = ()  # GGUF ``general.architecture`` values
    gguf_config: GGUFConfigFn | None = None
    source: Callable[[ModelConfig, str], Source] = direct
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYER_NAMES)
    gguf_harmless: Collection[str] = GGUF_HARMLESS
    # llama.cpp's converter interleaves the rotary halves of Q/K rows for this GGUF arch.
    gguf_permutes_qk: bool = False


def refuse_unused(
    family: str, present: Collection[str], needed: Collection[str], where: str
) -> None:
    """The one strict-loading rule for tensors: every tensor in the file is one the decoder
    computes with, and every one it computes with is in the file; else refuse in one line."""
    unused = sorted(set(present) - set(needed))
    missing = sorted(set(needed) - set(present))
    if unused:
        shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise ModelLoadError(
            f"{where} has tensors the {family} family does not compute with: {shown}"
        )
    if missing:
        shown = ", ".join(missing[:6]) + (
            f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        )
        raise ModelLoadError(f"{where} lacks tensors the {family} family needs: {shown}")
