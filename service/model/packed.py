"""Packed integer copies of a decoder's projections, used for small batches (decode).

``--weights`` picks them: ``auto`` keeps the file's own 4-bit/8-bit blocks where they map
exactly onto a CPU kernel (see :mod:`service.model.quant`), ``int4`` does so and quantizes the
rest to 4 bits, ``int8`` quantizes everything to int8 per row, ``bf16`` packs nothing.
The dense weights stay: batches of more than ``max_rows`` tokens (prefill, big decode batches)
run through them, where the dense matmul beats the GEMV kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from service.model.model_config import ModelConfig
from service.model.native import kernels
from service.model.quant import (
    GROUP,
    Int4Codes,
    Int4Linear,
    Int8Linear,
    KBlocks,
    concat_k,
    concat_rows,
    quantize_int4,
)

Linear = Callable[[torch.Tensor], torch.Tensor]
WeightsMode = Literal["auto", "bf16", "int4", "int8"]
WEIGHTS_MODES: tuple[str, ...] = ("auto", "bf16", "int4", "int8")
# NOTE: measured on a 2-core AVX512-BF16 CPU: at M <= 4 rows the packed GEMVs read 3-4x fewer
# bytes and win 2-3x; from M = 8 on the dense bf16 matmul (AMX) is as fast or faster. So too
# for kvfence's float32 GEMV beside bf16 dense weights (--dtype auto on such a CPU): 30 layers'
# projections 10.0 against 13.3 ms at 4 rows, 16.5 against 13.7 at 8 (2-core Xeon, AMX-BF16).
MAX_PACKED_ROWS = 4
# NOTE: kvfence's float32 GEMV (no bf16 compute) beats the dense float32 matmul for longer:
# measured on a 2-core AVX2 EPYC, SmolLM2-135M forward at 16 tokens 49-61 ms against 94-109
# dense, even at 24-32, dense ahead from ~48. Batches up to this many tokens use it.
GEMV_MAX_PACKED_ROWS = 32
# NOTE: on AMX CPUs the kernel's batches run on the tile unit from the 4-bit blocks (bf16 x,
# float32 sums); measured on a 2-core Xeon (AMX-BF16), 30 layers' projections plus the head,
# cache-warm: 8.5 against 11.7 ms dense bf16 at 8 rows, 9.6 against 12.8 at 16, 19.4 against
# 23.2 at 64; from 128 rows the dense weights' oneDNN matmul is ahead (32 against 28 ms).
AMX_MAX_PACKED_ROWS = 64
# NOTE: where the panel layout runs on SIMD (AVX512-VNNI), its one exact integer a block
# for 16 outputs a vector does ~2.5x fewer instructions than the row layout's int16 loop.
# Measured on a 2-core AMX Xeon, SmolLM2-135M's 30 layers' projections plus the head, same
# process: 1 row 3.4-4.5 against 6.4-7.4 ms (row layout), 4 rows 6.9-10.2 against 13.7-16.2,
# 16 rows 17.2-17.5 against 19.1-19.7 (row layout on the tile unit), 32 rows 28-35 against
# 21 (tile unit) and 22 (dense bf16); engine single-stream decode 248 against 160 tok/s.
# So the packs are panels on such CPUs and take batches up to 16 rows.
PANEL_MAX_PACKED_ROWS = 16
# Packs run in these dtypes at speed; fp32 works (parity uses it) but is several times slower.
_FAST_DTYPES = (torch.bfloat16, torch.float16)

# A layer's experts' packs, one per expert.
Experts = tuple[Linear, ...]

# name -> the file's own blocks, exactly (int4 codes, or K-quant blocks with float32
# scales), or None when its storage has no exact mapping.
CodesGetter = Callable[[str], Int4Codes | KBlocks | None]


@dataclass(frozen=True, slots=True)
class PackedLinears:
    """Per-layer packed projections; an entry is None where that weight stays dense. A
    mixture-of-experts model's ``gate_up`` and ``down`` are None (it has no dense MLP) and
    its experts' packs are per layer in ``experts_gate_up`` and ``experts_down`` (None where
    that layer's experts stay dense; both empty without experts)."""

    qkv: tuple[Linear | None, ...]
    o: tuple[Linear | None, ...]
    gate_up: tuple[Linear | None, ...]
    down: tuple[Linear | None, ...]
    lm_head: Linear | None
    max_rows: int = MAX_PACKED_ROWS
    experts_gate_up: tuple[Experts | None, ...] = ()
    experts_down: tuple[Experts | None, ...] = ()

    @property
    def nbytes(self) -> int:
        experts = [
            lin for layer in (*self.experts_gate_up, *self.experts_down) for lin in layer or ()
        ]
        every = [*self.qkv, *self.o, *self.gate_up, *self.down, self.lm_head, *experts]
        return sum(int(getattr(lin, "nbytes", 0)) for lin in every)


def resolve_weights(mode: str, dtype: torch.dtype, device: str) -> str:
    """``auto`` -> ``file`` (keep the file's blocks) on CPU in bf16/fp16, and in float32 where
    kvfence's own GEMV (:mod:`service.model.native.kernels`) builds; else ``bf16`` (dense).

    NOTE: measured on a 2-core AVX2 EPYC (float32), the GEMV decodes one stream 4.4x faster
    than the dense weights. make verify's long-prefill-flood and penalty-rows checks (a
    victim's gap under attack <= 2 x its own gap + 30 ms) sit near their bound there with
    either: of three full runs that day, dense missed both (0.130/0.124 s against 0.116),
    the GEMV missed one (penalty rows 0.092 s against 0.079) and then passed all 75 (0.042
    and 0.061 s against 0.063). The README's "Where the time goes" says why."""
    if mode not in WEIGHTS_MODES:
        raise ValueError(f"unknown weights mode {mode!r}; use {', '.join(WEIGHTS_MODES)}")
    on_cpu = torch.device(device).type == "cpu"
    if mode == "auto":
        if on_cpu and dtype == torch.float32 and kernels.kernel() is not None:
            return "file"
        return "file" if on_cpu and dtype in _FAST_DTYPES else "bf16"
    if mode in ("int4", "int8") and not on_cpu:
        raise ValueError(f"--weights {mode} runs on CPU kernels only (device is {device})")
    return mode


def build_packed(
    config: ModelConfig,
    mode: str,
    codes: CodesGetter,
    dense: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    dense_dtype: torch.dtype | None = None,
) -> PackedLinears | None:
    """Packs for ``mode`` (``resolve_weights``' answer). ``dense(name)`` is the layer's
    dense weight by fused name (``qkv.{i}``, ``o.{i}``, ``gate_up.{i}``, ``down.{i}``,
    ``lm_head``, and expert ``e``'s ``experts_gate_up.{i}.{e}`` and ``experts_down.{i}.{e}``).
    ``dense_dtype`` is the dtype the dense weights will run in (default ``dtype``): it picks
    from how many rows a batch leaves the packs for them."""
    if mode == "bf16":
        return None
    attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    parts = {
        "qkv": [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"],
        "o": [attn + "o_proj.weight"],
        "gate_up": [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
        "down": [mlp + "down_proj.weight"],
    }
    # each expert's, under mlp.experts.{e}.
    expert_parts = {"gate_up": ["gate_proj.weight", "up_proj.weight"], "down": ["down_proj.weight"]}
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    # float32 decode reads 4-bit blocks through kvfence's own kernel (torch's is for bf16).
    kernel = kernels.kernel() if dtype == torch.float32 else None
    # The GEMV's packs serve larger batches; int8 packs are torch's kernel, as are bf16 ones.
    max_rows = MAX_PACKED_ROWS
    # Beside bf16 dense weights the kernel's batches may take the tile unit (bf16 arithmetic,
    # as the dense weights would compute them); float32 dense weights keep float32 batches.
    tiles = kernel is not None and kernel.amx and (dense_dtype or dtype) in _FAST_DTYPES
    # Where the kernel runs the panel layout on SIMD, the packs are in it (Q4Linear.in_panels).
    panels = kernel is not None and kernel.panel_simd
    if kernel is not None and mode != "int8":
        if (dense_dtype or dtype) not in _FAST_DTYPES:
            max_rows = min(GEMV_MAX_PACKED_ROWS, kernel.max_rows)
        elif panels:
            max_rows = min(PANEL_MAX_PACKED_ROWS, kernel.max_rows)
        elif tiles:
            max_rows = min(AMX_MAX_PACKED_ROWS, kernel.max_rows)

    def pack4(w: Int4Codes) -> Linear:
        if kernel is not None:
            packed = kernels.Q4Linear.pack(w, kernel, tiles=tiles)
            return packed.in_panels() if panels else packed
        return Int4Linear.pack(w, dtype)

    def one(fused: str, names: list[str]) -> Linear | None:
        if mode == "int8":
            return Int8Linear.quantize(dense(fused), dtype)
        file_codes = [codes(n) for n in names]
        int4 = [c for c in file_codes if isinstance(c, Int4Codes)]
        if len(int4) == len(names) and len({c.repeat for c in int4}) == 1:
            return pack4(concat_rows(int4))
        k_blocks = [c for c in file_codes if isinstance(c, KBlocks)]
        if len(k_blocks) == len(names) and kernel is not None:
            # K-quants on kvfence's GEMV only, in their wide layouts (float32 scales); parts
            # of one fused projection in different K-quants stay dense
            joined = concat_k(k_blocks)
            if joined is not None:
                return kernels.Q4Linear.pack_k(joined, kernel)
        if mode == "int4":
            return pack4(quantize_int4(dense(fused)))
        return None  # "file": this weight is stored wider than any kernel; it stays dense

    def layers(kind: str) -> tuple[Linear | None, ...]:
        if config.num_experts and kind in ("gate_up", "down"):
            return (None,) * config.num_layers  # no dense MLP: its experts (below)
        return tuple(
            one(f"{kind}.{i}", [n.format(i=i) for n in parts[kind]])
            for i in range(config.num_layers)
        )

    def experts(kind: str) -> tuple[Experts | None, ...]:
        """Each layer's experts packed as the dense MLP's projections are, or None for a
        layer where one of them stays dense (the layer's experts then all do)."""
        if not config.num_experts:
            return ()
        # NOTE: 4-bit packs take inputs of whole blocks of 32 (an expert width of 48 does not)
        if mode != "int8" and (config.hidden_size % GROUP or config.intermediate_size % GROUP):
            return (None,) * config.num_layers
        names = [mlp + "experts.{e}." + n for n in expert_parts[kind]]
        out: list[Experts | None] = []
        for i in range(config.num_layers):
            packs = [
                one(f"experts_{kind}.{i}.{e}", [n.format(i=i, e=e) for n in names])
                for e in range(config.num_experts)
            ]
            out.append(
                None if any(p is None for p in packs) else tuple(p for p in packs if p is not None)
            )
        return tuple(out)

    return PackedLinears(
        qkv=layers("qkv"),
        o=layers("o"),
        gate_up=layers("gate_up"),
        down=layers("down"),
        lm_head=one("lm_head", [head]),
        max_rows=max_rows,
        experts_gate_up=experts("gate_up"),
        experts_down=experts("down"),
    )
