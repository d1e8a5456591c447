"""Several adapters' weights stacked along the rank axis, so a step mixing them adds every
row's delta with one matmul pair per fused projection, whatever the mix.

Row ``i`` of a step computes ``u = x @ A_all.T`` over the stacked ranks of every adapter in
the step, keeps only its own adapter's columns (a 0/1 mask; base rows keep none) and adds
``u @ B_all.T``. The extra work (every row through every adapter's A) is small beside the
base projections at LoRA ranks; what it saves is the per-adapter gather, matmuls and scatter
of a segment loop, each a separate parallel op.

The stacked copies are kept for the last few mixes (a step's mix changes only as streams
start and end), bounded in bytes; a mix past the bound runs the segment loop instead. The
last step's plan is kept too, keyed by its rows' adapters: decode steps of the same streams
reuse it, masks and native table included.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from service.model.lora import LoraAdapter, LoraGroup

if TYPE_CHECKING:
    from service.model.lora_batch import LoraBatch

MAX_STACK_BYTES = 512 << 20  # stacked copies held at once, over every cached mix
_MIXES = 4


class LoraStacks:
    """Stacked weights of recent mixes of adapters, per fused projection."""

    def __init__(self, max_bytes: int = MAX_STACK_BYTES) -> None:
        self._max_bytes = max_bytes
        self._mixes: OrderedDict[tuple[str, ...], dict[str, LoraGroup]] = OrderedDict()
        self._last: tuple[tuple[LoraAdapter | None, ...], LoraBatch] | None = None

    def last_plan(self, rows: tuple[LoraAdapter | None, ...]) -> LoraBatch | None:
        """The plan :meth:`keep_plan` kept for exactly these rows' adapters, else None."""
        last = self._last
        return last[1] if last is not None and last[0] == rows else None

    def keep_plan(self, rows: tuple[LoraAdapter | None, ...], plan: LoraBatch) -> None:
        """Keep ``plan`` for the next step with the same rows; it holds its stacked copies,
        so a mix's eviction drops it."""
        self._last = (rows, plan)

    def forget_plan(self) -> None:
        """Drop the kept plan (and what it holds of adapters that may have been unloaded)."""
        self._last = None

    def stacked(self, adapters: tuple[LoraAdapter, ...], group: str) -> LoraGroup | None:
        """``group``'s A and B of ``adapters`` (each having it) stacked in order, held in
        their common dtype (float32 where they differ); None when the copy would not fit the
        byte bound. Its ``scale`` is 1: each adapter's own goes in the step's mask."""
        key = tuple(a.identity for a in adapters)
        mix = self._mixes.get(key)
        if mix is None:
            if sum(a.nbytes for a in adapters) > self._max_bytes:
                return None
            mix = self._mixes[key] = {}
            while len(self._mixes) > _MIXES or self._held() > self._max_bytes:
                self._mixes.popitem(last=False)
                self._last = None
            if key not in self._mixes:
                return None
        self._mixes.move_to_end(key)
        got = mix.get(group)
        if got is None:
            parts = [a.groups[group] for a in adapters]
            dtypes = {p.a.dtype for p in parts}
            held = dtypes.pop() if len(dtypes) == 1 else torch.float32
            got = mix[group] = LoraGroup(
                torch.cat([p.a.to(held) for p in parts], dim=1).contiguous(),
                torch.cat([p.b.to(held) for p in parts], dim=1).contiguous(),
                1.0,
            )
        return got

    def _held(self) -> int:
        return sum(
            g.a.numel() * g.a.element_size() + g.b.numel() * g.b.element_size()
            for mix in self._mixes.values()
            for g in mix.values()
        )
