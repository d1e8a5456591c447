"""Batch-invariant projections: one kernel and one reduction order per row, any batch."""

from __future__ import annotations

import dataclasses

from service.model.native_gemv import Q4Linear
from service.model.packed import Linear, PackedLinears


def invariant_linear(lin: Q4Linear) -> Q4Linear:
    """``lin`` for batch-invariant steps: weights whose rows fill panels of 16 in the panel
    layout where the kernel runs it on SIMD (one exact integer per block and one float
    chain per output in block order, the same bits for any row count); the others on the
    int16 GEMV with the tile unit off (its one-row loop and 4-row tiles do the same
    arithmetic)."""
    return dataclasses.replace(lin.in_panels(), tiles=False)


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
