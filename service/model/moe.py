"""A mixture-of-experts MLP: top-k routing, then each expert run once on its group of tokens.

Routing, as Mixtral and Qwen3-MoE compute it: a softmax (in float32) over every expert's
router logit, the ``top_k`` largest probabilities, then, where the family says so
(Mixtral always, Qwen3-MoE with ``norm_topk_prob``), those renormalised to sum to one.

Experts run grouped: the ``(token, slot)`` assignments are sorted by expert, so each expert's
tokens are one contiguous block and every expert that has any runs one gated-MLP matmul on
its block. The Python loop is over experts (a few dozen), never over tokens; the weighted
outputs go back to their tokens with one ``index_add_``, so each token's expert outputs add
in expert order (the native decoder stack adds them in the same order).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]
Projection = Callable[[torch.Tensor], torch.Tensor]  # x -> x @ w.T, dense or packed


@dataclass(frozen=True, slots=True)
class MoeRouting:
    """How a family picks and weighs experts."""

    num_experts: int
    top_k: int
    normalize_top_k: bool

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.num_experts}")


def route(logits: torch.Tensor, routing: MoeRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, experts [T, k] int64)`` for router ``logits`` ``[T, E]``."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, routing.top_k, dim=-1)
    if routing.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def moe_mlp(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    routing: MoeRouting,
    act: Activation,
) -> torch.Tensor:
    """``sum_k w_k * down_e(act(gate_e(x)) * up_e(x))`` for each row of ``x`` ``[T, H]``.

    ``router``: ``[E, H]``; ``gate_up``: ``[E, 2I, H]`` (gate rows, then up rows);
    ``down``: ``[E, H, I]``. Returns ``[T, H]`` in ``x``'s dtype."""
    return experts_mlp(
        x,
        router,
        [functools.partial(F.linear, weight=w) for w in gate_up],
        [functools.partial(F.linear, weight=w) for w in down],
        routing,
        act,
    )


def experts_mlp(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: Sequence[Projection],
    down: Sequence[Projection],
    routing: MoeRouting,
    act: Activation,
) -> torch.Tensor:
    """:func:`moe_mlp` with each expert's projections as callables (``gate_up[e]``,
    ``down[e]``): dense, or the packed ones decode-sized batches run."""
    weights, experts = route(F.linear(x, router), routing)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // routing.top_k  # the row of x each sorted assignment belongs to
    counts = torch.bincount(flat, minlength=routing.num_experts).tolist()
    grouped = x[token]
    scale = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    parts = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = grouped[start : start + n]
            gate, up = gate_up[e](rows).chunk(2, dim=-1)
            parts.append(down[e](act(gate) * up))
        start += n
    if not parts:
        return out
    # float32 routing weights times the expert outputs, as the reference models compute it
    mixed = (torch.cat(parts) * scale[:, None]).to(x.dtype)
    out.index_add_(0, token, mixed)
    return out
