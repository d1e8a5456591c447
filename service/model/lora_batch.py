"""The adapters of one step's rows, applied as segmented deltas beside the base projections.

A step may mix rows of several adapters and of the base. The base projection runs once over
every row (the same call a base-only step makes); each row then gets its own adapter's
``(x @ A.T) @ B.T`` and base rows nothing. The torch path computes it segment by segment: the
rows are gathered adapter by adapter and each adapter's matmul pair runs on its own rows only,
so one adapter's values never enter another row's arithmetic (a masked product over every row
would: NaN x 0 is NaN). The native decoder stack takes the adapters' weights stacked along the
rank axis (:mod:`service.model.lora_stack`) with a mask naming each row's own ranks; its kernel
groups the rows by that span and reads only their own ranks (``lora_plan`` in native/lora.h).
Never a forward per adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from service.model.layers import Layer
from service.model.lora import GROUPS, LoraAdapter, LoraGroup
from service.model.lora_stack import LoraStacks
from service.model.native.kernels import HELD, StackDelta


@dataclass(frozen=True, slots=True)
class _GroupPlan:
    """One fused projection's adapter rows in a step: ``rows`` lists them adapter by adapter
    (None = every row, all on one adapter) and ``parts`` gives each adapter's slice of it.
    ``stack`` and ``mask`` [T, R] are the native decoder stack's view of the same rows (the
    adapters' weights stacked along the rank axis, each row's own ranks named by its mask);
    None where the stacked copy does not fit its bound."""

    rows: torch.Tensor | None  # [n] int64
    parts: tuple[tuple[LoraGroup, int, int], ...]  # (weights, start, end) into ``rows``
    stack: LoraGroup | None = None
    mask: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """The adapters of one step's rows, planned once per step for every fused projection."""

    plans: dict[str, _GroupPlan]
    # stack_deltas by step rows, made once: a kept plan's next steps reuse them
    _deltas: dict[int, dict[str, StackDelta] | None] = field(default_factory=dict, compare=False)

    @staticmethod
    def of_rows(
        adapters: Sequence[LoraAdapter | None],
        device: torch.device,
        stacks: LoraStacks | None = None,
    ) -> LoraBatch | None:
        """Group each token row's adapter (None = base); None where no row has one. With
        ``stacks``, rows of several adapters (or one adapter beside base rows) are planned
        as one masked matmul pair per projection."""
        by_id: dict[str, tuple[LoraAdapter, list[int]]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                by_id.setdefault(adapter.identity, (adapter, []))[1].append(row)
        if not by_id:
            if stacks is not None:
                stacks.forget_plan()  # a base-only step lets go of the adapters' last plan
            return None
        key_rows = tuple(adapters)
        if stacks is not None and (kept := stacks.last_plan(key_rows)) is not None:
            return kept
        plans: dict[str, _GroupPlan] = {}
        for key in GROUPS:
            having = [(a, rows) for a, rows in by_id.values() if key in a.groups]
            segments = [(a.groups[key], rows) for a, rows in having]
            if not segments:
                continue
            if len(segments) == 1 and len(segments[0][1]) == len(adapters):
                plans[key] = _GroupPlan(None, ((segments[0][0], 0, len(adapters)),))
                continue
            order: list[int] = []
            parts = []
            for group, rows in segments:
                parts.append((group, len(order), len(order) + len(rows)))
                order.extend(rows)
            rows_t = torch.tensor(order, dtype=torch.long, device=device)
            stacked = None if stacks is None else _stacked(key, having, len(adapters), device, stacks)
            stack, mask = stacked if stacked is not None else (None, None)
            plans[key] = _GroupPlan(rows_t, tuple(parts), stack, mask)
        batch = LoraBatch(plans)
        if stacks is not None:
            stacks.keep_plan(key_rows, batch)
        return batch

    def stack_deltas(self, rows: int) -> dict[str, StackDelta] | None:
        """Every planned projection as one stacked, masked delta for the native decoder stack
        (:class:`~service.model.native.kernels.StackDelta`), for a step of ``rows`` rows; None
        where a plan is a per-adapter segment loop (its mix's stacked copy did not fit its
        bound) or the weights are not float32, bfloat16 or float16 on the CPU: that step
        runs the layer loop."""
        if rows not in self._deltas:
            self._deltas[rows] = self._stack_deltas(rows)
        return self._deltas[rows]

    def _stack_deltas(self, rows: int) -> dict[str, StackDelta] | None:
        deltas: dict[str, StackDelta] = {}
        for key, plan in self.plans.items():
            if plan.stack is not None:
                assert plan.mask is not None
                group, mask = plan.stack, plan.mask
            elif plan.rows is None:
                group = plan.parts[0][0]
                mask = torch.full((rows, group.a.shape[1]), group.scale)
            else:
                return None
            if group.a.dtype not in HELD or not group.a.is_cpu:
                return None
            # b is block-diagonal by module (lora._group): the kernel skips the zero blocks
            deltas[key] = StackDelta(group.a, group.b, mask, len(GROUPS[key]))
        return deltas

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[rows] += (x[rows] @ A[layer].T) @ B[layer]`` for each adapter of the step
        that has ``group`` (``"qkv"``, ``"o"``, ``"gate_up"``, ``"down"``), on its rows."""
        plan = self.plans.get(group)
        if plan is None:
            return
        if plan.rows is None:
            g = plan.parts[0][0]
            a, b = _weights(g, layer, x.dtype)
            out.addmm_((x @ a.T).mul_(g.scale), b)  # in place: no [T, out] temporary
            return
        # NOTE: one gather and one scatter for the whole step; each adapter's rows are then a
        # contiguous slice, so an adapter costs its two matmuls and nothing more, and reads
        # nothing of another adapter's weights (a base row is in no slice).
        xs = x.index_select(0, plan.rows)
        deltas = []
        for g, s, e in plan.parts:
            a, b = _weights(g, layer, x.dtype)
            deltas.append((xs[s:e] @ a.T).mul_(g.scale) @ b)
        out.index_add_(0, plan.rows, deltas[0] if len(deltas) == 1 else torch.cat(deltas))


def _weights(group: LoraGroup, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``group``'s A and B of ``layer`` in the compute ``dtype`` (bfloat16- and float16-held
    weights widen exactly to float32)."""
    return group.a[layer].to(dtype), group.b[layer].to(dtype)


def _stacked(
    key: str,
    having: list[tuple[LoraAdapter, list[int]]],
    total: int,
    device: torch.device,
    stacks: LoraStacks,
) -> tuple[LoraGroup, torch.Tensor] | None:
    """The native stack's weights and mask for ``having`` (each adapter with ``key`` and its
    rows); None when the stacked copy does not fit its bound."""
    if len(having) == 1:
        stack: LoraGroup | None = having[0][0].groups[key]
    else:
        stack = stacks.stacked(tuple(a for a, _ in having), key)
    if stack is None:
        return None
    mask = torch.zeros(total, stack.a.shape[1])
    start = 0
    for adapter, rows in having:
        group = adapter.groups[key]
        rank = group.a.shape[1]
        mask[rows, start : start + rank] = group.scale
        start += rank
    return stack, mask.to(device)


def lora_qkv(i: int, layer: Layer, x: torch.Tensor, lora: LoraBatch, eps: float) -> torch.Tensor:
    """Layer ``i``'s q|k|v rows (before their bias) with each adapter row's delta added."""
    h = F.rms_norm(x, (x.shape[-1],), layer.attn_norm, eps)
    qkv = layer.qkv(h)
    lora.add(i, "qkv", h, qkv)
    return qkv


def lora_rest(
    i: int, layer: Layer, out: torch.Tensor, x: torch.Tensor, lora: LoraBatch, eps: float
) -> None:
    """The plain Llama layer ``i`` after attention, on the base projections' plain calls (each
    projection's input is kept, so the adapter rows' deltas are added beside it)."""
    x.add_(layer.o(out))
    lora.add(i, "o", out, x)
    if layer.o_bias is not None:
        x.add_(layer.o_bias)
    h = F.rms_norm(x, (x.shape[-1],), layer.mlp_norm, eps)
    gate_up = layer.gate_up(h)
    lora.add(i, "gate_up", h, gate_up)
    if layer.gate_up_bias is not None:
        gate_up = gate_up + layer.gate_up_bias
    gate, up = gate_up.chunk(2, dim=-1)
    m = F.silu(gate).mul_(up)
    x.add_(layer.down(m))
    lora.add(i, "down", m, x)
    if layer.down_bias is not None:
        x.add_(layer.down_bias)
