"""Several adapters' weights stacked along the rank axis, so a step mixing them adds every
row's delta with one matmul pair per fused projection, whatever the mix.

Row ``i`` of a step computes ``u = x @ A_all.T`` over the stacked ranks of every adapter in
the step, keeps only its own adapter's columns (a 0/1 mask; base rows keep none) and adds
``u @ B_all.T``. The extra work (every row through every adapter's A) is small beside the
base projections at LoRA ranks; what it saves is the per-adapter gather, matmuls and scatter
of a segment loop, each a separate parallel op.

The stacked copies are kept for the last few mixes (a step's mix changes only as streams
start and end), bounded in bytes; a mix past the bound runs the segment loop instead.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from service.model.lora import LoraAdapter, LoraGroup

MAX_STACK_BYTES = 512 << 20  # stacked copies held at once, over every cached mix
_MIXES = 4


class LoraStacks:
    """Stacked weights of recent mixes of adapters, per fused projection."""

    def __init__(self, max_bytes: int = MAX_STACK_BYTES) -> None:
        self._max_bytes = max_bytes
        self._mixes: OrderedDict[tuple[str, ...], dict[str, LoraGroup]] = OrderedDict()

    def stacked(self, adapters: tuple[LoraAdapter, ...], group: str) -> LoraGroup | None:
        """``group``'s A and B of ``adapters`` (each having it) stacked in order; None when
        the copy would not fit the byte bound."""
        key = tuple(a.identity for a in adapters)
        mix = self._mixes.get(key)
        if mix is None:
            if sum(a.nbytes for a in adapters) > self._max_bytes:
                return None
            mix = self._mixes[key] = {}
            while len(self._mixes) > _MIXES or self._held() > self._max_bytes:
                self._mixes.popitem(last=False)
            if key not in self._mixes:
                return None
        self._mixes.move_to_end(key)
        got = mix.get(group)
        if got is None:
            parts = [a.groups[group] for a in adapters]
            got = mix[group] = LoraGroup(
                torch.cat([p.a for p in parts], dim=1).contiguous(),
                torch.cat([p.b for p in parts], dim=2).contiguous(),
            )
        return got

    def _held(self) -> int:
        return sum(
            g.a.numel() * g.a.element_size() + g.b.numel() * g.b.element_size()
            for mix in self._mixes.values()
            for g in mix.values()
        )
