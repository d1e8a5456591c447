"""Config keys read through one object, so what a family did not read can be refused by name.

A family reads every key it honours through :class:`ConfigKeys`. After it has built its
:class:`~service.model.model_config.ModelConfig`, :func:`refuse_unread_hf` (config.json) or
:func:`refuse_unread_gguf` (GGUF metadata) refuses the checkpoint in one line naming each
key that changes the arithmetic and was left unread: the decoder would otherwise compute
something other than what the checkpoint was trained to compute.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from service.model.load_error import ModelLoadError

# config.json keys that change what a decoder computes, with the values that change nothing.
# A key here that a family does not read must be absent or hold one of these values.
HF_ARITHMETIC: Mapping[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "hidden_activation": (None,),
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    "rope_scaling": (None,),
    "partial_rotary_factor": (None, 1.0),
    "rotary_pct": (None, 1.0),
    "sliding_window": (None,),
    "use_sliding_window": (False, None),
    "layer_types": (None,),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
    "quantization_config": (None,),
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
    "n_routed_experts": (None, 0),
    "num_experts_per_tok": (None, 0),
    "moe_intermediate_size": (None, 0),
    "shared_expert_intermediate_size": (None, 0),
    "embedding_multiplier": (None, 1.0),
    "logits_scaling": (None, 1.0),
    "residual_multiplier": (None, 1.0),
    "attention_multiplier": (None,),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "no_rope_layers": (None,),
    "attention_chunk_size": (None,),
    "use_parallel_residual": (None, False),
    "layer_norm_eps": (None,),
    "norm_type": (None, "rms_norm"),
}


class ConfigKeys:
    """A config mapping (``source`` names it in errors) that records each key read."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source
        self._read: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        self._read.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        self._read.add(key)
        if self.raw.get(key) is None:
            raise ModelLoadError(f"{self.source} has no {key}")
        return self.raw[key]

    @property
    def read(self) -> frozenset[str]:
        return frozenset(self._read)


def _short(value: Any) -> str:
    if isinstance(value, dict):  # a nested config: name it by what it is
        for kind in ("quant_method", "rope_type", "type"):
            if kind in value:
                return f"{{{kind}: {value[kind]!r}}}"
        return "{...}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def refuse_unread_hf(keys: ConfigKeys, family: str) -> None:
    """Refuse a config.json whose arithmetic keys (:data:`HF_ARITHMETIC`) the family did not
    read and that hold a value other than a neutral one."""
    unread = [
        f"{k}={_short(v)}"
        for k, neutral in HF_ARITHMETIC.items()
        if k in keys.raw and k not in keys.read and (v := keys.raw[k]) not in neutral
    ]
    if unread:
        raise ModelLoadError(
            f"{keys.source}: the {family} family does not compute with {', '.join(unread)}"
        )


def refuse_unread_gguf(keys: ConfigKeys, arch: str, harmless: Collection[str]) -> None:
    """Refuse GGUF metadata with an ``{arch}.*`` key the family neither read nor lists as
    ``harmless`` (names relative to ``{arch}.``): llama.cpp writes a key there only for
    something the graph computes with."""
    prefix = f"{arch}."
    unread = sorted(
        f"{k}={_short(v)}"
        for k, v in keys.raw.items()
        if k.startswith(prefix) and k not in keys.read and k[len(prefix) :] not in harmless
    )
    if unread:
        raise ModelLoadError(
            f"{keys.source}: the {arch} family does not compute with {', '.join(unread)}"
        )
