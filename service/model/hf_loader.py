"""Read a Hugging Face model directory: config.json, safetensors (sharded or not), tokenizer."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer as HFTokenizer

from service.model.families import ConfigKeys, Family, Source, Tokens, hf_family
from service.model.families.keys import refuse_unread_hf
from service.model.load_error import ModelLoadError
from service.model.model_config import ModelConfig
from service.model.tokenizer import Tokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"missing file {path.name}") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path.name} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name} is not a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# Buffers older checkpoints saved that the config fully determines (RoPE's frequencies):
# recomputed from the config, never read.
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# Stored narrower than any dense dtype the decoder computes in: such a tensor is a
# quantized code that needs its scales (quantization_config), which are not served.
_CODE_DTYPES = {
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "uint8")
    if hasattr(torch, n)
}


@dataclass(slots=True)
class HFCheckpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]
    files: dict[str, Path]  # tensor name in the file -> shard
    family: Family
    _open: dict[Path, Any] = field(default_factory=dict)

    @property
    def file_tensors(self) -> frozenset[str]:
        """Every tensor in the checkpoint that carries weights."""
        return frozenset(n for n in self.files if not _DERIVED.fullmatch(n))

    def source(self, name: str) -> Source:
        return self.family.source(self.config, name)

    def file_name(self, name: str) -> str:
        """The name of the file tensor decoder tensor ``name`` comes from."""
        return self.source(name).name

    def file_blocks(self, name: str) -> None:
        """safetensors hold no quantized blocks; ``--weights int4`` quantizes the dense tensor."""
        return None

    def get(self, name: str) -> torch.Tensor:
        """The decoder tensor ``name`` (HF name): the file's tensor, or its rows where the
        family fuses it with others."""
        src = self.source(name)
        path = self.files.get(src.name)
        if path is None:
            raise ModelLoadError(f"missing tensor {src.name}")
        try:
            handle = self._open.get(path)
            if handle is None:
                handle = self._open[path] = safe_open(str(path), framework="pt")
            t: torch.Tensor = handle.get_tensor(src.name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{path.name}: corrupt or truncated safetensors ({e})") from None
        if t.dtype in _CODE_DTYPES:
            raise ModelLoadError(
                f"tensor {src.name} is stored as {str(t.dtype).removeprefix('torch.')}: "
                "quantized safetensors are not served (use a dense or GGUF checkpoint)"
            )
        if src.stop:
            if src.stop > t.shape[0]:
                raise ModelLoadError(
                    f"tensor {src.name} has {t.shape[0]} rows, expected {src.stop}"
                )
            t = t[src.start : src.stop]
        return t


def read_hf_dir(path: Path) -> HFCheckpoint:
    raw = _read_json(path / "config.json")
    tok_config = (
        _read_json(path / "tokenizer_config.json")
        if (path / "tokenizer_config.json").exists()
        else {}
    )
    gen_config = (
        _read_json(path / "generation_config.json")
        if (path / "generation_config.json").exists()
        else {}
    )
    backend = _load_tokenizer_json(path / "tokenizer.json")
    specials = {n: t for n in _SPECIAL_NAMES if (t := _token_text(tok_config.get(n))) is not None}
    eos: list[int] = []
    for i in _ids(raw.get("eos_token_id")) + _ids(gen_config.get("eos_token_id")):
        if i not in eos:
            eos.append(i)
    if (
        "eos_token" in specials
        and (eos_id := backend.token_to_id(specials["eos_token"])) is not None
        and eos_id not in eos
    ):
        eos.append(eos_id)
    bos = raw.get("bos_token_id")
    if bos is None and "bos_token" in specials:
        bos = backend.token_to_id(specials["bos_token"])
    tokenizer = Tokenizer(backend, bos_token_id=bos, eos_token_ids=tuple(eos))
    family = hf_family(raw.get("model_type"))
    keys = ConfigKeys(raw, "config.json")
    config = family.hf_config(keys, Tokens(None if bos is None else int(bos), tuple(eos)))
    refuse_unread_hf(keys, family.name)
    return HFCheckpoint(
        config=config,
        family=family,
        tokenizer=tokenizer,
        chat_template=_chat_template(path, tok_config),
        special_tokens=specials,
        files=_index_tensors(path),
    )


def _load_tokenizer_json(path: Path) -> HFTokenizer:
    if not path.exists():
        raise ModelLoadError(f"missing file {path.name}")
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses on bad files
        raise ModelLoadError(f"{path.name} is not a valid tokenizer ({e})") from None


def _chat_template(path: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _index_tensors(path: Path) -> dict[str, Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index.name} has no weight_map")
        files = {name: path / str(shard) for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not shard.exists():
                raise ModelLoadError(f"missing file {shard.name}")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError("no *.safetensors files")
    files = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                files.update(dict.fromkeys(f.keys(), shard))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{shard.name}: corrupt or truncated safetensors ({e})") from None
    return files
