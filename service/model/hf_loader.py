"""Read a Hugging Face model directory: config.json, safetensors (sharded or not), tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer as HFTokenizer

from service.model.config import ModelConfig, RopeScaling
from service.model.errors import ModelLoadError
from service.model.tokenizer import Tokenizer

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
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


@dataclass(slots=True)
class HFCheckpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]
    files: dict[str, Path]  # tensor name -> shard
    _open: dict[Path, Any] = field(default_factory=dict)

    def int4_codes(self, name: str) -> None:
        """safetensors hold no 4-bit blocks; ``--weights int4`` quantizes the dense tensor."""
        return None

    def get(self, name: str) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            raise ModelLoadError(f"missing tensor {name}")
        try:
            handle = self._open.get(path)
            if handle is None:
                handle = self._open[path] = safe_open(str(path), framework="pt")
            return handle.get_tensor(name)  # type: ignore[no-any-return]
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{path.name}: corrupt or truncated safetensors ({e})") from None


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
    return HFCheckpoint(
        config=_config(raw, bos, tuple(eos)),
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


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return theta, None
    if kind != "llama3":
        raise ModelLoadError(f"unsupported rope scaling {kind!r}")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _config(raw: dict[str, Any], bos: int | None, eos: tuple[int, ...]) -> ModelConfig:
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    if raw.get("mlp_bias") or raw.get("use_sliding_window"):
        raise ModelLoadError("unsupported config: mlp_bias / sliding window attention")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported activation {raw.get('hidden_act')!r}")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        theta, scaling = _rope(raw)
        return ModelConfig(
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json is missing or has a bad field ({e})") from None
