"""Batch-invariant projections: one kernel and one reduction order per row, any batch."""

from __future__ import annotations

import dataclasses

from service.model.native.kernels import Q4Linear
from service.model.packed import Experts, Linear, PackedLinears


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
    the batch, so a row's output does not depend on the rows beside it. A mixture-of-experts
    model's experts' packs take the dense MLP's place. Raises ValueError where a weight is
    not on that kernel.
    NOTE: measured on a 2-core AMX Xeon (SmolLM2-135M, 30 layers' projections and the
    head, shared machine): the tile unit (bf16) ran 1 row in ~2x the GEMV's time, so one
    kernel for every batch size had to be an integer GEMV for single-stream decode to keep
    its speed."""
    if packed is None:
        raise ValueError("batch invariance needs every projection on the 4-bit GEMV kernel")
    experts = (*packed.experts_gate_up, *packed.experts_down)
    # a mixture-of-experts model has no dense MLP: its experts' packs stand for it
    mlp = (
        tuple(lin for layer in experts for lin in layer or (None,))
        if experts
        else (*packed.gate_up, *packed.down)
    )
    every = (*packed.qkv, *packed.o, *mlp, packed.lm_head)
    if not all(isinstance(lin, Q4Linear) for lin in every):
        raise ValueError("batch invariance needs every projection on the 4-bit GEMV kernel")

    def plain(lin: Linear | None) -> Q4Linear:
        assert isinstance(lin, Q4Linear)
        return invariant_linear(lin)

    def layer(lins: tuple[Linear | None, ...]) -> tuple[Linear | None, ...]:
        return tuple(None if experts and lin is None else plain(lin) for lin in lins)

    def each(layers: tuple[Experts | None, ...]) -> tuple[Experts | None, ...]:
        return tuple(None if e is None else tuple(plain(lin) for lin in e) for e in layers)

    head = plain(packed.lm_head)
    return PackedLinears(
        qkv=layer(packed.qkv),
        o=layer(packed.o),
        gate_up=layer(packed.gate_up),
        down=layer(packed.down),
        lm_head=head,
        max_rows=head.kernel.max_rows,
        experts_gate_up=each(packed.experts_gate_up),
        experts_down=each(packed.experts_down),
    )
