"""The interface between the model and KV memory.

The model never touches KV tensors. For every layer it hands the step's freshly
projected (and RoPE'd) q, k, v to an :class:`AttentionFn`, which writes k/v into the
sequence's own pages and returns the attention output. Only ``kvcache`` implements it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


class AttentionFn(Protocol):
    """Attention for one forward step over a flattened batch of T tokens.

    ``q``: ``[T, num_q_heads, head_dim]``; ``k``, ``v``: ``[T, num_kv_heads, head_dim]``.
    Returns ``[T, num_q_heads, head_dim]`` in ``q``'s dtype, softmax scale ``head_dim**-0.5``,
    causal within each sequence (within the layer's window, scores softcapped where the
    layer says so: :class:`LayerAttention`).
    Implementations store k/v for later steps.
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention computes beyond causal GQA, given to kvcache as data (the
    page pool holds one per layer) and honoured by every backend.

    ``window`` > 0: a query at position p attends to keys ``p - window + 1 .. p`` only (a
    sliding window, the query's own key included); 0 attends to every earlier key.
    ``softcap`` > 0: each scaled score ``s`` becomes ``softcap * tanh(s / softcap)`` before
    the softmax (Gemma 2's attention-logit softcapping); 0 leaves scores as they are."""

    window: int = 0
    softcap: float = 0.0

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if not math.isfinite(self.softcap) or self.softcap < 0:
            raise ValueError(f"softcap must be finite and >= 0, got {self.softcap}")


@dataclass(frozen=True, slots=True)
class NativeAttend:
    """One all-decode float32 step's attention as a C function, for model code that runs a
    whole decode forward natively (``service/model/native/stack.h``): an :class:`AttentionFn`
    that offers ``native_attend(q_heads)`` answers one of these, or None.

    ``fn`` is the address of ``int attend(const void *ctx, int layer, const float *q,
    const float *k, const float *v, float *out)`` (``kvf_step_attend_f32``), with q
    ``[batch, q_heads, head_dim]``, k and v ``[batch, kv_heads, head_dim]`` and out like q,
    all contiguous. It stores layer ``layer``'s K/V at this step's rows and attends, as
    ``AttentionFn(layer, q, k, v)`` does, and answers 0, or -1 when the layer or a row is
    outside the pool (nothing written). ``ctx`` (the pool and the step's checked metadata)
    is opaque to the caller: the model passes its own buffers and a layer index, and every
    KV address is kvcache's. ``keep`` holds what ``ctx`` points into."""

    fn: int
    ctx: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    num_layers: int
    keep: object
