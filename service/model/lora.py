"""A PEFT LoRA directory read, checked against the base model, and fused for the decoder.

The directory holds ``adapter_config.json`` and ``adapter_model.safetensors``. The adapter is
served exactly or refused in one line naming what cannot be honoured: another PEFT type,
a NaN or infinite weight or scaling, DoRA, trained biases, saved base modules, per-module
rank or alpha patterns, a target outside the seven Llama projections, a shape that does not
fit the base, a rank above the configured maximum, or a tensor this reader does not know.

Each layer's deltas are fused the way the decoder's projections are (``q|k|v`` and
``gate|up``): the A matrices of a fused projection are stacked along the rank axis and the
B matrices, transposed to rank-major, placed block-diagonally, so one fused projection's
delta is two matmuls. The scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` under
``use_rslora``) is kept beside them and applied to ``x @ A.T``, so the weights are held as
the file gives them.

On a float32 base an adapter whose every value is a bfloat16 (a bfloat16 file, or any file
whose values all are) is held in bfloat16, and one whose every value is a float16 (a float16
file) in float16; either is widened to float32 where it is read: the same float32 arithmetic
on the same values, at half the bytes a token reads. Any other adapter is held in float32.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from service.model.model_config import ModelConfig
from service.model.threads import on_fresh_thread

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The decoder's fused projections, in the order their rows are stacked.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)
# Config keys that, set to anything but these values, change the arithmetic in a way this
# reader does not compute.
_MUST_BE: dict[str, tuple[object, ...]] = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "megatron_config": (None,),
    "layer_replication": (None,),
    "use_qalora": (False, None),
    "lora_bias": (False, None),
    "trainable_token_indices": (None,),
    "target_parameters": (None, []),
}


class LoraError(Exception):
    """An adapter that cannot be served exactly; the message is one readable line."""


@dataclass(frozen=True, slots=True, eq=False)
class LoraGroup:
    """One fused projection's delta for every layer: ``out += ((x @ a[i].T) * scale) @ b[i]``,
    in the compute dtype (float32 also from bfloat16- or float16-held weights)."""

    a: torch.Tensor  # [L, R, in]
    b: torch.Tensor  # [L, R, out], rank-major (each rank's outputs contiguous)
    scale: float  # lora_alpha / r (or / sqrt(r))


@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    """A loaded adapter. ``identity`` (name and content digest) keys the prefix cache, so a
    changed file never reuses the KV its previous content produced. Compared and hashed by
    identity of the object (its tensors have no cheap equality)."""

    name: str
    digest: str  # sha256 of the config and weights files
    rank: int
    groups: Mapping[str, LoraGroup]  # "qkv" | "o" | "gate_up" | "down"; absent = no delta
    nbytes: int

    @property
    def identity(self) -> str:
        return f"{self.name}@{self.digest}"


def file_digest(path: Path) -> str:
    """sha256 over the adapter's two files (what decides its arithmetic)."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            data = (path / name).read_bytes()
        except OSError as exc:
            raise LoraError(f"adapter {path}: cannot read {name} ({exc.strerror})") from None
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()[:32]


def read_config(path: Path, max_rank: int) -> tuple[int, float]:
    """``(r, scaling)`` from ``adapter_config.json``; raises LoraError naming what is refused."""
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"adapter {path}: cannot read {CONFIG_FILE} ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"adapter {path}: {CONFIG_FILE} is not a JSON object")
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise LoraError(f"adapter {path}: PEFT type {kind!r} is not served (only LORA)")
    if cfg.get("use_dora"):
        raise LoraError(f"adapter {path}: DoRA (use_dora) is not served")
    for key, allowed in _MUST_BE.items():
        if key in cfg and cfg[key] not in allowed:
            raise LoraError(f"adapter {path}: {key} = {cfg[key]!r} is not served")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"adapter {path}: r must be a positive integer")
    if r > max_rank:
        raise LoraError(f"adapter {path}: rank {r} is above the maximum {max_rank} (--max-lora-rank)")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraError(f"adapter {path}: lora_alpha must be a finite number")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise LoraError(
                f"adapter {path}: target modules {unknown} are not served "
                f"(only {', '.join(TARGETS)})"
            )
    scaling = float(alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r)
    if not math.isfinite(scaling):
        raise LoraError(f"adapter {path}: its scaling lora_alpha / r is not a finite number")
    return r, scaling


def _shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection of the base."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


def _read_tensors(path: Path, config: ModelConfig, r: int) -> dict[tuple[int, str, str], torch.Tensor]:
    """Every ``(layer, module, "A"|"B")`` tensor, shape-checked against the base."""
    shapes = _shapes(config)
    out: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                m = _KEY_RE.match(key)
                if m is None:
                    raise LoraError(f"adapter {path}: tensor {key!r} is not served")
                layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
                if layer >= config.num_layers:
                    raise LoraError(
                        f"adapter {path}: {key!r} names layer {layer}; the base has "
                        f"{config.num_layers}"
                    )
                t = f.get_tensor(key)
                o, i = shapes[module]
                want = (r, i) if ab == "A" else (o, r)
                if tuple(t.shape) != want:
                    raise LoraError(
                        f"adapter {path}: {key!r} has shape {tuple(t.shape)}; the base needs {want}"
                    )
                if not t.is_floating_point():
                    raise LoraError(f"adapter {path}: {key!r} is not a float tensor")
                if not bool(torch.isfinite(t).all()):
                    raise LoraError(f"adapter {path}: {key!r} holds NaN or infinite values")
                out[(layer, module, ab)] = t
    except (OSError, SafetensorError) as exc:
        raise LoraError(f"adapter {path}: cannot read {WEIGHTS_FILE} ({exc})") from None
    for layer, module, ab in out:
        if (layer, module, "B" if ab == "A" else "A") not in out:
            raise LoraError(f"adapter {path}: layer {layer} {module} has lora_{ab} without its pair")
    if not out:
        raise LoraError(f"adapter {path}: {WEIGHTS_FILE} holds no LoRA tensors")
    return out


def _group(
    config: ModelConfig,
    tensors: Mapping[tuple[int, str, str], torch.Tensor],
    modules: tuple[str, ...],
    r: int,
    scaling: float,
    dtype: torch.dtype,
) -> LoraGroup | None:
    """Stack A along the rank axis and place B block-diagonally, layer by layer, held in
    ``dtype``."""
    if not any(m == mod for _, m, _ in tensors for mod in modules):
        return None
    shapes = _shapes(config)
    n, rank = config.num_layers, r * len(modules)
    a = torch.zeros(n, rank, shapes[modules[0]][1], dtype=torch.float32)
    b = torch.zeros(n, rank, sum(shapes[m][0] for m in modules), dtype=torch.float32)
    for layer in range(n):
        row = 0
        for j, module in enumerate(modules):
            rows = shapes[module][0]
            if (layer, module, "A") in tensors:
                a[layer, j * r : (j + 1) * r] = tensors[(layer, module, "A")].float()
                b[layer, j * r : (j + 1) * r, row : row + rows] = tensors[(layer, module, "B")].T
            row += rows
    return LoraGroup(a.to(dtype).contiguous(), b.to(dtype).contiguous(), scaling)


def held_dtype(tensors: Mapping[tuple[int, str, str], torch.Tensor], dtype: torch.dtype) -> torch.dtype:
    """What an adapter's weights are held in on a base computing in ``dtype``: on a float32
    base, bfloat16 when every value is one, else float16 when every value is one (widening
    them back is exact); else ``dtype``."""
    if dtype != torch.float32:
        return dtype
    for half in (torch.bfloat16, torch.float16):
        if all(t.dtype == half or torch.equal(t.to(half).to(t.dtype), t) for t in tensors.values()):
            return half
    return dtype


def load_lora(
    name: str, path: Path, config: ModelConfig, dtype: torch.dtype, max_rank: int
) -> LoraAdapter:
    """Read and check the adapter at ``path`` for a base of ``config`` computing in ``dtype``.
    Raises LoraError (one line) where it cannot be served exactly. The tensor work runs on a
    thread that exits when done (:func:`~service.model.threads.on_fresh_thread`), so the
    caller's thread, a server's event loop or its executor, never holds an OpenMP pool beside
    the engine's.
    NOTE: measured on 2 cores: with four adapters loaded on the main thread, one base stream
    decoded at 175-195 tok/s against 261-270 with none (libgomp's spin-wait cut, see
    service.model.threads)."""
    return on_fresh_thread(
        lambda: _load_lora(name, path, config, dtype, max_rank), name="kvfence-lora"
    )


def _load_lora(
    name: str, path: Path, config: ModelConfig, dtype: torch.dtype, max_rank: int
) -> LoraAdapter:
    if not config.plain_layers:
        raise LoraError(f"adapter {path}: adapters are served on plain Llama-layer bases only")
    digest = file_digest(path)
    r, scaling = read_config(path, max_rank)
    tensors = _read_tensors(path, config, r)
    held = held_dtype(tensors, dtype)
    groups = {
        key: g
        for key, modules in GROUPS.items()
        if (g := _group(config, tensors, modules, r, scaling, held)) is not None
    }
    nbytes = sum(g.a.numel() * g.a.element_size() + g.b.numel() * g.b.element_size()
                 for g in groups.values())
    return LoraAdapter(name, digest, r, groups, nbytes)
