"""Read a GGUF file (llama.cpp's format): config, dequantized weights, tokenizer, chat template."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from service.model.families import ConfigKeys, Family, Source, Tokens, gguf_family
from service.model.families import llama as _llama
from service.model.families.base import GGUF_GLOBAL_NAMES
from service.model.families.keys import refuse_unread_gguf
from service.model.gguf_tokenizer import GGUFVocab, build_gguf_tokenizer
from service.model.load_error import ModelLoadError
from service.model.model_config import ModelConfig
from service.model.quant import (
    Int4Codes,
    KBlocks,
    from_q4_0,
    from_q4_1,
    from_q4_k,
    from_q5_0,
    from_q6_k,
    from_q8_0,
)
from service.model.tokenizer import Tokenizer

# llama.cpp counts these as end-of-generation when the file marks them as control tokens.
_EOG_TEXTS = frozenset(
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>"]
)
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# A decoder expert tensor, which llama.cpp's converter stacks over the experts of its layer.
_EXPERT_RE = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight")
_ROPE_FREQS = "rope_freqs.weight"
LLAMA = _llama.FAMILY


def hf_name(gguf_name: str, family: Family = LLAMA) -> str | None:
    """The HF-style name of a GGUF tensor in ``family``'s files, or None for a tensor no
    decoder tensor comes from."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    names = family.gguf_layer_names
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}"


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
    tensors: dict[str, ReaderTensor]  # HF-style file name -> raw tensor
    rope_freq_factors: torch.Tensor | None
    family: Family
    unmapped: tuple[str, ...] = ()  # GGUF tensors no decoder tensor comes from

    @property
    def file_tensors(self) -> frozenset[str]:
        """Every tensor in the file that carries weights, by its GGUF name."""
        return frozenset(t.name for t in self.tensors.values()) | frozenset(self.unmapped)

    def file_name(self, name: str) -> str:
        """The GGUF name of the file tensor decoder tensor ``name`` comes from."""
        src = self.source(name).name
        raw = self.tensors.get(src)
        return src if raw is None else str(raw.name)

    def source(self, name: str) -> Source:
        if m := _EXPERT_RE.fullmatch(name):
            return Source(f"{m.group(1)}.{m.group(3)}.weight", expert=int(m.group(2)))
        return self.family.source(self.config, name)

    def _raw(self, name: str) -> tuple[ReaderTensor, Source]:
        src = self.source(name)
        raw = self.tensors.get(src.name)
        if raw is None:
            raise ModelLoadError(f"missing tensor {src.name}")
        if src.stop and src.stop > int(raw.shape[-1]):
            raise ModelLoadError(
                f"tensor {raw.name} has {int(raw.shape[-1])} rows, expected {src.stop}"
            )
        if src.expert >= 0 and (len(raw.shape) != 3 or src.expert >= int(raw.shape[-1])):
            shape = tuple(int(n) for n in reversed(raw.shape.tolist()))
            raise ModelLoadError(
                f"tensor {raw.name} has shape {shape}, without expert {src.expert}"
            )
        return raw, src

    def _permuted(self, name: str) -> int:
        """Heads whose Q/K rows llama.cpp's converter interleaved, or 0."""
        if not self.family.gguf_permutes_qk or not name.endswith(
            ("q_proj.weight", "k_proj.weight")
        ):
            return 0
        return self.config.num_heads if "q_proj" in name else self.config.num_kv_heads

    def get(self, name: str) -> torch.Tensor:
        raw, src = self._raw(name)
        w = _dequantize(raw, src.expert)
        if src.stop:
            w = w[src.start : src.stop]
        if heads := self._permuted(name):
            w = _inverse_permute(w, heads)
        return w

    def file_blocks(self, name: str) -> Int4Codes | KBlocks | None:
        """The tensor's own blocks, exactly: as int4 codes (Q4_0, Q4_1, Q5_0, Q8_0) or as
        K-quant blocks with float32 scales (Q4_K, Q6_K); None for a type with neither
        mapping (see service/model/quant.py). An expert's are its own entry of the stacked
        tensor: the reader's data holds whole rows of blocks, so they unpack alone."""
        raw, src = self._raw(name)
        unpack = _EXACT.get(GGMLQuantizationType(raw.tensor_type))
        dims = 3 if src.expert >= 0 else 2
        if unpack is None or len(raw.shape) != dims or int(raw.shape[0]) % 32:
            return None
        rows = int(raw.shape[1])
        try:
            codes = unpack(raw.data if src.expert < 0 else raw.data[src.expert], rows)
        except ValueError as e:
            raise ModelLoadError(f"tensor {raw.name} is corrupt ({e})") from None
        if src.stop:
            codes = codes.rows(torch.arange(src.start, src.stop))
            rows = src.stop - src.start
        if heads := self._permuted(name):
            order = _inverse_permute(torch.arange(rows)[:, None], heads)[:, 0]
            codes = codes.rows(order)
        return codes


_EXACT: dict[GGMLQuantizationType, Callable[[np.ndarray, int], Int4Codes | KBlocks]] = {
    GGMLQuantizationType.Q4_0: from_q4_0,
    GGMLQuantizationType.Q4_1: from_q4_1,
    GGMLQuantizationType.Q8_0: from_q8_0,
    GGMLQuantizationType.Q5_0: from_q5_0,
    GGMLQuantizationType.Q4_K: from_q4_k,
    GGMLQuantizationType.Q6_K: from_q6_k,
}


def _dequantize(raw: ReaderTensor, expert: int = -1) -> torch.Tensor:
    """The tensor as float32, or (``expert`` >= 0) entry ``expert`` of its first axis: the
    reader's data holds whole rows of blocks, so one expert's bytes dequantize alone."""
    kind = GGMLQuantizationType(raw.tensor_type)
    try:
        shape = tuple(int(n) for n in reversed(raw.shape.tolist()))
        data = raw.data if expert < 0 else raw.data[expert]
        arr = dequantize(data, kind)
        arr = np.asarray(arr, dtype=np.float32).reshape(shape if expert < 0 else shape[1:])
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

    def fields(self) -> dict[str, Any]:
        """Every metadata key with its value (tensor data excluded)."""
        return {k: f.contents() for k, f in self._fields.items() if not k.startswith("tokenizer.")}

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
    family = gguf_family(arch)
    raw = {t.name: t for t in reader.tensors}
    tensors, unmapped = {}, []
    for gguf_name, t in raw.items():
        if gguf_name == _ROPE_FREQS:
            continue  # read below, as the RoPE frequencies' divisors
        if (name := hf_name(gguf_name, family)) is None:
            unmapped.append(gguf_name)
        else:
            tensors[name] = t
    tokenizer, specials = _tokenizer(meta)
    keys = ConfigKeys(meta.fields(), "GGUF metadata")
    if family.gguf_config is None:
        raise ModelLoadError(f"the {family.name} family is not served from GGUF")
    shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in tensors.items()}
    config = family.gguf_config(
        keys, shapes, Tokens(tokenizer.bos_token_id, tokenizer.eos_token_ids)
    )
    refuse_unread_gguf(keys, arch, family.gguf_harmless)
    freq_factors = _dequantize(raw[_ROPE_FREQS]) if _ROPE_FREQS in raw else None
    return GGUFCheckpoint(
        config=config,
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens=specials,
        tensors=tensors,
        rope_freq_factors=freq_factors,
        family=family,
        unmapped=tuple(unmapped),
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
    if meta.get("tokenizer.ggml.remove_extra_whitespaces"):
        raise ModelLoadError("tokenizer.ggml.remove_extra_whitespaces is not served")
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
