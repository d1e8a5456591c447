"""Read a GGUF file (llama.cpp's format): config, dequantized weights, tokenizer, chat template."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from service.model.config import ModelConfig
from service.model.errors import ModelLoadError
from service.model.gguf_tokenizer import GGUFVocab, build_gguf_tokenizer
from service.model.quant import Int4Codes, from_q4_0, from_q4_1, from_q8_0
from service.model.tokenizer import Tokenizer

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

# llama.cpp counts these as end-of-generation when the file marks them as control tokens.
_EOG_TEXTS = frozenset(
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>"]
)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The HF-style name of a GGUF tensor, or None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


def _inverse_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's converter interleaves the two rotary halves of each head's rows for llama
    # models (its "normal" RoPE); the HF layout we run keeps them as halves.
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@dataclass(slots=True)
class GGUFCheckpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]  # bos_token/eos_token/... strings for the chat template
    tensors: dict[str, ReaderTensor]  # HF name -> raw tensor
    rope_freq_factors: torch.Tensor | None

    def get(self, name: str) -> torch.Tensor:
        raw = self.tensors.get(name)
        if raw is None:
            raise ModelLoadError(f"missing tensor {name}")
        w = _dequantize(raw)
        if self.config.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.num_heads if "q_proj" in name else self.config.num_kv_heads
            w = _inverse_permute(w, heads)
        return w

    def int4_codes(self, name: str) -> Int4Codes | None:
        """The tensor's own blocks as exact int4 codes, or None when its type has no exact
        int4 mapping (see service/model/quant.py)."""
        raw = self.tensors.get(name)
        if raw is None:
            raise ModelLoadError(f"missing tensor {name}")
        unpack = _INT4_EXACT.get(GGMLQuantizationType(raw.tensor_type))
        if unpack is None or len(raw.shape) != 2 or int(raw.shape[0]) % 32:
            return None
        rows = int(raw.shape[1])
        try:
            codes = unpack(raw.data, rows)
        except ValueError as e:
            raise ModelLoadError(f"tensor {raw.name} is corrupt ({e})") from None
        if self.config.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.num_heads if "q_proj" in name else self.config.num_kv_heads
            order = _inverse_permute(torch.arange(rows)[:, None], heads)[:, 0]
            codes = codes.rows(order)
        return codes


_INT4_EXACT = {
    GGMLQuantizationType.Q4_0: from_q4_0,
    GGMLQuantizationType.Q4_1: from_q4_1,
    GGMLQuantizationType.Q8_0: from_q8_0,
}


def _dequantize(raw: ReaderTensor) -> torch.Tensor:
    kind = GGMLQuantizationType(raw.tensor_type)
    try:
        arr = dequantize(raw.data, kind)
        shape = tuple(int(n) for n in reversed(raw.shape.tolist()))
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    except NotImplementedError:
        raise ModelLoadError(f"tensor {raw.name} has unsupported tensor type {kind.name}") from None
    except ValueError as e:
        raise ModelLoadError(f"tensor {raw.name} is corrupt ({e})") from None
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr)


class _Meta:
    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        if key not in self._fields:
            raise ModelLoadError(f"missing metadata key {key}")
        return self._fields[key].contents()


def read_gguf(path: Path) -> GGUFCheckpoint:
    """Parse metadata and map tensors; weights are dequantized lazily by :meth:`GGUFCheckpoint.get`."""
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # GGUFReader parses untrusted bytes: any failure means a bad file
        raise ModelLoadError(f"not a valid GGUF file (corrupt or truncated: {e})") from None
    meta = _Meta(reader)
    arch = meta.need("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    raw = {t.name: t for t in reader.tensors}
    tensors = {name: t for gguf_name, t in raw.items() if (name := hf_name(gguf_name)) is not None}
    tokenizer, specials = _tokenizer(meta)
    config = _config(meta, arch, tensors, tokenizer)
    freq_factors = _dequantize(raw["rope_freqs.weight"]) if "rope_freqs.weight" in raw else None
    return GGUFCheckpoint(
        config=config,
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens=specials,
        tensors=tensors,
        rope_freq_factors=freq_factors,
    )


def _config(
    meta: _Meta, arch: str, tensors: dict[str, ReaderTensor], tok: Tokenizer
) -> ModelConfig:
    def key(name: str) -> str:
        return f"{arch}.{name}"

    scaling = meta.get(key("rope.scaling.type"), "none")
    if scaling not in ("none", None):
        raise ModelLoadError(f"unsupported rope scaling {scaling!r}")
    hidden = int(meta.need(key("embedding_length")))
    heads = int(meta.need(key("attention.head_count")))
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelLoadError("missing tensor token_embd.weight")
    return ModelConfig(
        arch=arch,
        vocab_size=int(embed.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(meta.need(key("feed_forward_length"))),
        num_layers=int(meta.need(key("block_count"))),
        num_heads=heads,
        num_kv_heads=int(meta.get(key("attention.head_count_kv"), heads)),
        head_dim=int(meta.get(key("attention.key_length"), hidden // heads)),
        rms_norm_eps=float(meta.need(key("attention.layer_norm_rms_epsilon"))),
        rope_theta=float(meta.get(key("rope.freq_base"), 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(meta.get(key("context_length"), 4096)),
        tie_word_embeddings="lm_head.weight" not in tensors,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in tensors,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
    )


def _tokenizer(meta: _Meta) -> tuple[Tokenizer, dict[str, str]]:
    tokens: list[str] = list(meta.need("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", []))
    ids = {
        name: meta.get(f"tokenizer.ggml.{key}")
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    named = {name: int(i) for name, i in ids.items() if i is not None}
    if any(not 0 <= i < len(tokens) for i in named.values()):
        raise ModelLoadError("special token id out of vocabulary range")
    bos = named.get("bos_token")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix")
    backend = build_gguf_tokenizer(
        GGUFVocab(
            model=meta.need("tokenizer.ggml.model"),
            pre=meta.get("tokenizer.ggml.pre"),
            tokens=tokens,
            token_types=types,
            scores=list(meta.get("tokenizer.ggml.scores", [])),
            merges=list(meta.get("tokenizer.ggml.merges", [])),
            special_token_ids=sorted(set(named.values())),
            bos_token_id=bos,
            eos_token_id=named.get("eos_token"),
            unk_token_id=named.get("unk_token"),
            add_bos_token=None if add_bos is None else bool(add_bos),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=None if add_prefix is None else bool(add_prefix),
        )
    )
    eos: list[int] = []
    for k in ("eos_token_id", "eot_token_id", "eom_token_id"):
        if (i := meta.get(f"tokenizer.ggml.{k}")) is not None and int(i) not in eos:
            eos.append(int(i))
    eos += [
        i
        for i, (t, kind) in enumerate(zip(tokens, types, strict=False))
        if kind == 3 and t in _EOG_TEXTS and i not in eos
    ]
    specials = {name: tokens[i] for name, i in named.items()}
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=tuple(eos)), specials
