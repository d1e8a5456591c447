"""Batch-invariant projections: one kernel and one reduction order per row, any batch."""

from __future__ import annotations

import dataclasses

import torch

from service.model.native_gemv import PANEL, Q4Linear
from service.model.packed import Linear, PackedLinears
from service.model.quant import GROUP


def to_panels(blocks: torch.Tensor, k: int, q8: bool = False) -> torch.Tensor:
    """``blocks`` (:func:`service.model.native_gemv.to_blocks`, or with ``q8``
    :func:`~service.model.native_gemv.q8_blocks`; ``[N, row bytes]``, N a multiple of 16) in
    the kernel's panel layout (:func:`~service.model.native_gemv.panel_row_bytes` a row): per
    panel of 16 output rows and block g, the 16 rows' codes (byte ``[i][n][j]`` is byte
    ``4i + j`` of row n's block), then their 16 fp16 scales, then their 16 fp16 minimums
    (zeros for 8-bit blocks)."""
    n = blocks.shape[0]
    groups = k // GROUP
    padded = groups + (-groups % 8)
    panels = n // PANEL
    width = 32 if q8 else 16  # code bytes of a block
    codes = blocks[:, : groups * width].reshape(panels, PANEL, groups, width // 4, 4)
    codes = codes.permute(0, 2, 3, 1, 4).reshape(panels, groups, 16 * width)
    halves = blocks[:, groups * width :].reshape(panels, PANEL, -1, padded, 2)[:, :, :, :groups]
    halves = halves.permute(0, 3, 2, 1, 4).reshape(panels, groups, -1)
    if q8:  # minimums 0
        halves = torch.cat([halves, torch.zeros_like(halves)], 2)
    return torch.cat([codes, halves], 2).reshape(n, -1).contiguous()


def invariant_linear(lin: Q4Linear) -> Q4Linear:
    """``lin`` for batch-invariant steps: weights whose rows fill panels of 16 in the panel
    layout where the kernel runs it on SIMD (one exact integer per block and one float
    chain per output in block order, the same bits for any row count); the others on the
    int16 GEMV with the tile unit off (its one-row loop and 4-row tiles do the same
    arithmetic)."""
    if (
        lin.kernel.panel_simd
        and not lin.panels
        and lin.repeat == 1
        and lin.blocks.shape[0] % PANEL == 0
    ):
        return dataclasses.replace(
            lin, blocks=to_panels(lin.blocks, lin.k, lin.q8), tiles=False, panels=True
        )
    return dataclasses.replace(lin, tiles=False)


def invariant_packs(packed: PackedLinears | None) -> PackedLinears:
    """``packed`` for batch-invariant steps: every projection and the head on kvfence's
    float32 GEMV (:func:`invariant_linear`) with the tile unit off, for batches of any size
    up to the kernel's row limit. Each row's input is rounded to int16 per block of 32 on
    its own (no look across rows), and its sums run over the blocks in one order whatever
    the batch, so a row's output does not depend on the rows beside it. Raises ValueError
    where a weight is not on that kernel.
    NOTE: measured on a 2-core AMX Xeon (SmolLM2-135M, 30 layers' projections and the
    head, shared machine): the tile unit (bf16) ran 1 row in ~2x the GEMV's time, so one
    kernel for every batch size had to be an integer GEMV for single-stream decode to keep
    its speed."""
    every = () if packed is None else (*packed.qkv, *packed.o, *packed.gate_up, *packed.down)
    if packed is None or not all(isinstance(lin, Q4Linear) for lin in (*every, packed.lm_head)):
        raise ValueError("batch invariance needs every projection on the 4-bit GEMV kernel")

    def plain(lin: Linear | None) -> Q4Linear:
        assert isinstance(lin, Q4Linear)
        return invariant_linear(lin)

    def layer(lins: tuple[Linear | None, ...]) -> tuple[Linear | None, ...]:
        return tuple(plain(lin) for lin in lins)

    head = plain(packed.lm_head)
    return PackedLinears(
        qkv=layer(packed.qkv),
        o=layer(packed.o),
        gate_up=layer(packed.gate_up),
        down=layer(packed.down),
        lm_head=head,
        max_rows=head.kernel.max_rows,
    )
